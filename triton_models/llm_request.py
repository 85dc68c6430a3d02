"""Reading one request of the `llm` model: its SamplingParams, the prefix-cache clear and the ids
it is logged under (inputs as in kvforge/llm_io.py, read with its functions as the router reads them)."""
from __future__ import annotations

import hmac
import json
import os

from kvforge import env, llm_io
from kvforge.errors import RequestError
from kvforge.llm_io import Inputs, either, identity_only, one_value, prompt_of, strings, token_ids, utf8
from runtime.grammar import Guide
from runtime.sampling import SamplingParams
from triton_models.requests import refuse_unknown_parameters

ALL_OUTPUTS = frozenset(llm_io.OUTPUTS)


def parse(request, inputs: Inputs, engine):
    """(prompt, SamplingParams, stream, echo text) of a generation request (`inputs`: its inputs_of)."""
    refuse_unknown_parameters(request)
    identity_only(inputs, "beam_width", 1, "kvforge does not implement beam search")
    identity_only(inputs, "length_penalty", 1, "it scores beams and kvforge does not implement beam search")
    identity_only(inputs, "num_return_sequences", 1,
                  "kvforge returns one sequence per request; send several requests (the OpenAI API's n does)")
    pad_id = one_value(inputs, "pad_id", None, int)
    vocab = engine.limits.vocab_size
    if pad_id is not None and not 0 <= pad_id < vocab:  # kvforge never pads an output, so that is all
        raise RequestError(f"pad_id must be a token id in 0..{vocab - 1}, got {pad_id}")
    max_tokens = either(inputs, ("max_tokens", "request_output_len"), int)
    if max_tokens is None:
        raise RequestError("max_tokens is required: how many tokens to generate at most")
    top_p = one_value(inputs, "top_p", 1.0, float)
    top_logprobs = one_value(inputs, "logprobs", 0, int)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=one_value(inputs, "temperature", 0.0, float),
        top_p=1.0 if top_p == 0 else top_p,  # TensorRT-LLM reads top_p 0 as "off"
        top_k=one_value(inputs, "top_k", 0, int),
        seed=either(inputs, ("seed", "random_seed"), int),
        stop=strings(inputs, "stop_words"),
        bad_words=strings(inputs, "bad_words"),
        end_id=one_value(inputs, "end_id", None, int),
        ignore_eos=one_value(inputs, "ignore_eos", False, bool),
        repetition_penalty=one_value(inputs, "repetition_penalty", 1.0, float),
        presence_penalty=one_value(inputs, "presence_penalty", 0.0, float),
        frequency_penalty=one_value(inputs, "frequency_penalty", 0.0, float),
        min_tokens=either(inputs, ("min_tokens", "min_length"), int) or 0,
        logprobs=one_value(inputs, "return_log_probs", False, bool) or top_logprobs > 0,
        top_logprobs=top_logprobs,
        min_p=one_value(inputs, "min_p", 0.0, float),
        logit_bias=logit_bias_of(inputs),
        allowed_token_ids=token_ids(inputs, "allowed_token_ids"),
        stop_token_ids=token_ids(inputs, "stop_token_ids"),
        speculative=one_value(inputs, "speculative", None, utf8("speculative")),
        guide=guide_of(inputs))
    prompt = prompt_of(inputs)
    echo = "" if one_value(inputs, "exclude_input_in_output", True, bool) else \
        prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)
    return prompt, params, one_value(inputs, "stream", False, bool), echo


def logit_bias_of(inputs: Inputs) -> tuple[tuple[int, float], ...]:
    """logit_bias_token_ids and logit_bias, pairwise."""
    ids, biases = token_ids(inputs, "logit_bias_token_ids"), inputs.get("logit_bias")
    biases = () if biases is None else biases.tolist()
    if len(ids) != len(biases):
        raise RequestError(f"logit_bias_token_ids ({len(ids)}) and logit_bias ({len(biases)}) must be as long: "
                           "one bias per token id")
    return tuple(zip(ids, biases))


def guide_of(inputs: Inputs) -> Guide | None:
    """TensorRT-LLM's guided decoding inputs: the guide's type and its text (none for json)."""
    kind = one_value(inputs, "guided_decoding_guide_type", None, utf8("guided_decoding_guide_type"))
    text = one_value(inputs, "guided_decoding_guide", None, utf8("guided_decoding_guide"))
    if kind is None:
        if text is not None:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type: what kind of guide it is")
        return None
    return Guide(kind, text or "")


def requested_outputs(request) -> frozenset[str]:
    """The outputs the client asked for (none named: all); only those are built."""
    return frozenset(request.requested_output_names()) or ALL_OUTPUTS


def clears_prefix_cache(inputs: Inputs) -> bool:
    """Whether this is the operator's request to empty the prefix cache; refused without the
    server's control key (the secret that guards Triton's model control; no key set = refused)."""
    if not one_value(inputs, "clear_prefix_cache", False, bool):
        return False
    expected = os.environ.get(env.CONTROL_KEY, "").encode()
    given = one_value(inputs, "control_key", b"", bytes)
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
