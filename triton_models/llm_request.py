"""Reading one request of the `llm` model: the prompt, its SamplingParams, the prefix-cache inputs
and the ids it is logged under (inputs as in kvforge/llm_io.py)."""
from __future__ import annotations

import hmac
import json
import os

import triton_python_backend_utils as pb_utils

from kvforge import env, llm_io
from kvforge.errors import RequestError
from runtime.sampling import SamplingParams
from triton_models.requests import either, identity_only, one_value, refuse_unknown_parameters, strings, utf8

ALL_OUTPUTS = frozenset(llm_io.OUTPUTS)


def prompt_of(request, tokenizer):
    """(prompt for the engine, its text for echoing): text_input, or TensorRT-LLM's input_ids."""
    text = one_value(request, "text_input", None, utf8("text_input"))
    ids = pb_utils.get_input_tensor_by_name(request, "input_ids")
    if text is not None and ids is not None:
        raise RequestError("send the prompt as text_input or as input_ids, not both")
    if ids is None:
        return text or "", text or ""
    ids = ids.as_numpy().reshape(-1).tolist()
    length = one_value(request, "input_lengths", len(ids), int)
    if not 0 <= length <= len(ids):
        raise RequestError(f"input_lengths must be in 0..{len(ids)} (the input_ids sent), got {length}")
    return ids[:length], tokenizer.decode(ids[:length])


def parse(request, engine):
    """(prompt, SamplingParams, stream, echo text) of a generation request."""
    refuse_unknown_parameters(request)
    identity_only(request, "beam_width", 1, "kvforge does not implement beam search")
    identity_only(request, "length_penalty", 1, "it scores beams and kvforge does not implement beam search")
    identity_only(request, "num_return_sequences", 1,
                  "kvforge returns one sequence per request; send several requests (the OpenAI API's n does)")
    pad_id = one_value(request, "pad_id", None, int)
    vocab = engine.limits.vocab_size
    if pad_id is not None and not 0 <= pad_id < vocab:  # kvforge never pads an output, so that is all
        raise RequestError(f"pad_id must be a token id in 0..{vocab - 1}, got {pad_id}")
    max_tokens = either(request, ("max_tokens", "request_output_len"), int)
    if max_tokens is None:
        raise RequestError("max_tokens is required: how many tokens to generate at most")
    top_p = one_value(request, "top_p", 1.0, float)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=one_value(request, "temperature", 0.0, float),
        top_p=1.0 if top_p == 0 else top_p,  # TensorRT-LLM reads top_p 0 as "off"
        top_k=one_value(request, "top_k", 0, int),
        seed=either(request, ("seed", "random_seed"), int),
        stop=strings(request, "stop_words"),
        bad_words=strings(request, "bad_words"),
        end_id=one_value(request, "end_id", None, int),
        ignore_eos=one_value(request, "ignore_eos", False, bool),
        repetition_penalty=one_value(request, "repetition_penalty", 1.0, float),
        presence_penalty=one_value(request, "presence_penalty", 0.0, float),
        frequency_penalty=one_value(request, "frequency_penalty", 0.0, float),
        min_tokens=either(request, ("min_tokens", "min_length"), int) or 0,
        logprobs=one_value(request, "return_log_probs", False, bool),
        speculative=one_value(request, "speculative", None, utf8("speculative")))
    prompt, prompt_text = prompt_of(request, engine.tokenizer)
    echo = prompt_text if not one_value(request, "exclude_input_in_output", True, bool) else ""
    return prompt, params, one_value(request, "stream", False, bool), echo


def requested_outputs(request) -> frozenset[str]:
    """The outputs the client asked for (none named: all); only those are built."""
    return frozenset(request.requested_output_names()) or ALL_OUTPUTS


def cache_salt(request):
    """The request's optional cache_salt (raw bytes): it shares cached prefixes only with the same salt."""
    return one_value(request, "cache_salt", None, bytes)


def clears_prefix_cache(request) -> bool:
    """Whether this is the operator's request to empty the prefix cache; refused without the
    server's control key (the secret that guards Triton's model control; no key set = refused)."""
    if not one_value(request, "clear_prefix_cache", False, bool):
        return False
    expected = os.environ.get(env.CONTROL_KEY, "").encode()
    given = one_value(request, "control_key", b"", bytes)
    if not expected or not hmac.compare_digest(given, expected):
        raise RequestError("clearing the prefix cache needs the server's control key (control_key input)")
    return True


def log_id_of(request):
    """The id the front (or a gRPC client's `request_id` parameter) gave the request."""
    try:
        given = json.loads(request.parameters() or "{}").get("request_id")
    except ValueError:
        given = None
    return str(given)[:64] if given else (request.request_id() or None)
