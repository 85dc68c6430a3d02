"""Triton model `vllm_model`: the vLLM backend's convention over the `llm` engine.

Its inputs and outputs are the vLLM backend's (max_batch_size 0, `text_input` [1], sampling
options as a JSON string in `sampling_parameters` or as request parameters, string values
coerced as vLLM does, `guided_decoding` as the same guide llm's guided inputs carry, `return_*`
flags choosing the outputs), so the vLLM backend's
samples/client.py runs unchanged. Each request is forwarded to `llm` (triton_models/forwarding.py).
As in vLLM, a request that does not stream gets the prompt in front of its text unless it sets
exclude_input_in_output, and a streaming one cannot ask for the prompt.
"""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from kvforge.errors import RequestError, quote
from kvforge.llm_io import one_value
from runtime.grammar import VLLM_KINDS, Guide
from triton_models.forwarding import Forwarder, llm_input, tensor_value
from triton_models.lifeline import exit_with_server
from triton_models.requests import inputs_of, request_parameters
from triton_models.responses import FINAL, send_error

NAME = "vllm_model"
# vLLM sampling parameter -> (llm input, coercion of vLLM's string values)
SAMPLING = {
    "max_tokens": ("max_tokens", int),
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "seed": ("seed", int),
    "min_tokens": ("min_tokens", int),
    "presence_penalty": ("presence_penalty", float),
    "frequency_penalty": ("frequency_penalty", float),
    "repetition_penalty": ("repetition_penalty", float),
    "min_p": ("min_p", float),
    "n": ("num_return_sequences", int),
}
WORDS = {"stop": "stop_words", "bad_words": "bad_words"}  # a string or a list of strings
TOKEN_IDS = ("stop_token_ids", "allowed_token_ids")  # lists of token ids, llm's inputs of the same names
GUIDED = "guided_decoding"  # the vLLM backend's {json | regex | choice | grammar | json_object}
VLLM_DEFAULTS = {"max_tokens": 16, "temperature": 1.0}  # vLLM's SamplingParams defaults where llm's differ
RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_num_input_tokens",
                "return_num_output_tokens")


def sampling_parameters(request) -> dict:
    """The sampling options: the `sampling_parameters` input, else the request parameters (as vLLM)."""
    tensor = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
    parameters = known(request_parameters(request))
    if tensor is None:
        return parameters
    try:
        options = json.loads(tensor.as_numpy().reshape(-1)[0])
    except ValueError as e:
        raise RequestError(f"sampling_parameters is not a JSON object: {e}") from None
    if not isinstance(options, dict):
        raise RequestError("sampling_parameters must be a JSON object")
    return known(options)


def known(options: dict) -> dict:
    readable = {*SAMPLING, *WORDS, *TOKEN_IDS, GUIDED}
    unknown = sorted(set(options) - readable)
    if unknown:
        raise RequestError(f"unknown sampling parameters {', '.join(unknown)}; {NAME} reads "
                           f"{', '.join(sorted(readable))}")
    return options


def guide_inputs(value) -> list:
    """llm's guided decoding inputs for the vLLM backend's guided_decoding: exactly one of its keys."""
    if not isinstance(value, dict):
        raise RequestError(f"{GUIDED} must be a JSON object with one of {', '.join(VLLM_KINDS)}, got {quote(value)}")
    unknown = sorted(set(value) - set(VLLM_KINDS))
    if unknown:
        raise RequestError(f"unknown {GUIDED} keys {', '.join(unknown)}; {NAME} reads {', '.join(VLLM_KINDS)} "
                           "(one backend, llguidance, and one JSON layout)")
    given = [(key, v) for key, v in value.items() if v not in (None, False)]  # json_object false asks for nothing
    if len(given) != 1:
        raise RequestError(f"{GUIDED} needs exactly one of {', '.join(VLLM_KINDS)}, got {len(given)}")
    key, v = given[0]
    guide = Guide.of_value(VLLM_KINDS[key], v)
    return [llm_input("guided_decoding_guide_type", [[guide.kind.encode()]]),
            llm_input("guided_decoding_guide", [[guide.text.encode()]])]


def llm_inputs(request):
    """(inputs for llm, which vLLM outputs to return, stream)."""
    options = {**VLLM_DEFAULTS, **sampling_parameters(request)}
    given = inputs_of(request)
    stream = one_value(given, "stream", False, bool)
    exclude = one_value(given, "exclude_input_in_output", None, bool)
    if stream and exclude is False:
        raise RequestError("when streaming, exclude_input_in_output = False is not allowed (as in vLLM)")
    echo = not stream if exclude is None else not exclude
    prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(1, -1)
    inputs = [llm_input("text_input", prompt), llm_input("stream", [[stream]]),
              llm_input("exclude_input_in_output", [[not echo]])]
    for key, value in options.items():
        if value is None:
            continue
        if key in WORDS:
            words = [value] if isinstance(value, str) else value
            if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
                raise RequestError(f"{key} must be a string or a list of strings, got {quote(value)}")
            if words:
                inputs.append(llm_input(WORDS[key], [[w.encode() for w in words]]))
            continue
        if key in TOKEN_IDS:
            if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                      for t in value):
                raise RequestError(f"{key} must be a list of token ids, got {quote(value)}")
            if value:
                inputs.append(llm_input(key, [value]))
            continue
        if key == GUIDED:
            inputs += guide_inputs(value)
            continue
        name, coerce = SAMPLING[key]
        try:
            number = coerce(value)
        except (TypeError, ValueError):
            raise RequestError(f"{key} must be {'an integer' if coerce is int else 'a number'}, got {quote(value)}") from None
        if key == "top_k" and number == -1:
            number = 0  # vLLM's "off"
        if key == "seed" and number < 0:
            raise RequestError(f"seed must be >= 0, got {number}")
        inputs.append(llm_input(name, [[number]]))
    returns = {flag: one_value(given, flag, False, bool) for flag in RETURN_FLAGS}
    if returns["return_cumulative_logprob"]:
        inputs.append(llm_input("return_log_probs", [[True]]))
    return inputs, returns


def translate(returns):
    def send(sender, response, final) -> bool:
        value = lambda name: tensor_value(response, name).reshape(-1)  # noqa: E731
        tensors = [pb_utils.Tensor("text_output", value("text_output").astype(np.object_))]
        if returns["return_finish_reason"]:  # vLLM says "None" until the sequence finishes
            reason = value("finish_reason")[0].decode() or "None"
            tensors.append(pb_utils.Tensor("finish_reason", np.array([reason.encode()], np.object_)))
        if returns["return_cumulative_logprob"]:
            tensors.append(pb_utils.Tensor("cumulative_logprob", value("cum_log_probs").astype(np.float32)))
        if returns["return_num_input_tokens"]:
            tensors.append(pb_utils.Tensor("num_input_tokens", value("num_input_tokens").astype(np.uint32)))
        if returns["return_num_output_tokens"]:
            tensors.append(pb_utils.Tensor("num_output_tokens", value("num_output_tokens").astype(np.uint32)))
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=FINAL if final else 0)
        return final
    return send


class TritonPythonModel:
    def initialize(self, args):
        exit_with_server()
        self.forwarder = Forwarder(NAME)

    def execute(self, requests):
        for request in requests:
            try:
                inputs, returns = llm_inputs(request)
                self.forwarder.start(request, inputs, translate(returns))
            except RequestError as e:
                send_error(request.get_response_sender(), e.kind, str(e))
        return None
