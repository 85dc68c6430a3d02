"""The `llm` model's wire contract: its inputs and outputs, one request read, and one response
decoded (`Delta`).

Each tensor has its name, Triton datatype, dims (after the batch dimension), whether it is
optional or ragged, and for an input the JSON type the HTTP front accepts in a /generate body
(Triton itself answers another JSON type with HTTP 500). engines/repository.py renders the llm
config.pbtxt from these; the llm model builds its responses with OUTPUTS' dtypes; the aliases
forward to llm asking for OUTPUTS; the front checks /generate bodies against INPUTS; the
OpenAI front and clients/api.py build their inputs with INPUTS' dtypes and decode responses
with `Delta`. Names, dtypes and meanings are TensorRT-LLM's ensemble / tensorrt_llm_bls ones
(README "Inputs and outputs" says what each does).

A request's inputs are read by one set of functions (`one_value`, `prompt_of`, ...) over
`Inputs`, whoever holds them: the llm model and its aliases a Triton request's tensors
(triton_models/requests.py), the router a /generate JSON body (`json_inputs`). So a request
means the same to both, and an input is parsed in one place.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from kvforge.errors import RequestError


@dataclass(frozen=True)
class JsonType:
    """What a /generate JSON field must be."""

    description: str  # as an error message names it: "an integer"
    accepts: Callable[[object], bool]


def _integer(value, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value < high


STRING = JsonType("a string", lambda v: isinstance(v, str))
STRINGS = JsonType("a string or a list of strings",
                   lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v))
BOOL = JsonType("true or false", lambda v: isinstance(v, bool))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


NUMBER = JsonType("a number", _number)
NUMBERS = JsonType("a number or a list of numbers",
                   lambda v: _number(v) or isinstance(v, list) and all(_number(n) for n in v))
INT32 = JsonType("an integer", lambda v: _integer(v, -2**31, 2**31))
INT32S = JsonType("an integer or a list of integers",
                  lambda v: _integer(v, -2**31, 2**31) or isinstance(v, list) and all(_integer(i, -2**31, 2**31)
                                                                                  for i in v))
UINT32 = JsonType("an integer in 0..2**32-1", lambda v: _integer(v, 0, 2**32))
UINT64 = JsonType("an integer in 0..2**64-1", lambda v: _integer(v, 0, 2**64))

NUMPY_DTYPES = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT32": np.uint32,
                "UINT64": np.uint64, "FP32": np.float32}


@dataclass(frozen=True)
class Tensor:
    name: str
    datatype: str  # Triton's protocol name (BYTES, BOOL, INT32, ...); config.pbtxt spells BYTES TYPE_STRING
    dims: tuple[int, ...]
    optional: bool = False
    ragged: bool = False  # allow_ragged_batch
    json: JsonType | None = None  # what /generate accepts for an input

    @property
    def numpy_dtype(self) -> type:
        return NUMPY_DTYPES[self.datatype]

    @property
    def config_type(self) -> str:
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"


def _input(name: str, datatype: str, json: JsonType, dims: tuple[int, ...] = (1,), ragged: bool = False) -> Tensor:
    return Tensor(name, datatype, dims, optional=True, ragged=ragged, json=json)


# Every input is optional to Triton; the model requires a prompt and max_tokens itself. Besides
# the ensemble's inputs: the tensorrt_llm model's input_ids / input_lengths / request_output_len
# / stop, which llama-index sends to cancel (request_output_len UINT32 as it sends it), and
# older aliases of renamed inputs (random_seed, min_length).
INPUTS = {t.name: t for t in (
    _input("text_input", "BYTES", STRING),
    _input("input_ids", "INT32", INT32S, dims=(-1,), ragged=True),
    _input("input_lengths", "INT32", INT32),
    _input("max_tokens", "INT32", INT32),
    _input("request_output_len", "UINT32", UINT32),
    _input("stream", "BOOL", BOOL),
    _input("stop", "BOOL", BOOL),
    _input("exclude_input_in_output", "BOOL", BOOL),
    _input("stop_words", "BYTES", STRINGS, dims=(-1,), ragged=True),
    _input("bad_words", "BYTES", STRINGS, dims=(-1,), ragged=True),
    _input("end_id", "INT32", INT32),
    _input("pad_id", "INT32", INT32),
    _input("temperature", "FP32", NUMBER),
    _input("top_k", "INT32", INT32),
    _input("top_p", "FP32", NUMBER),
    _input("seed", "UINT64", UINT64),
    _input("random_seed", "UINT64", UINT64),
    _input("repetition_penalty", "FP32", NUMBER),
    _input("presence_penalty", "FP32", NUMBER),
    _input("frequency_penalty", "FP32", NUMBER),
    _input("min_tokens", "INT32", INT32),
    _input("min_length", "INT32", INT32),
    _input("ignore_eos", "BOOL", BOOL),  # vLLM's: end tokens do not end the text; stop words still do
    _input("length_penalty", "FP32", NUMBER),
    _input("beam_width", "INT32", INT32),
    _input("num_return_sequences", "INT32", INT32),
    _input("return_log_probs", "BOOL", BOOL),
    # vLLM's (and TensorRT-LLM's LLM API) logprobs: also return this many most likely tokens'
    # log-probs per output token (0..20; > 0 implies return_log_probs)
    _input("logprobs", "INT32", INT32),
    _input("min_p", "FP32", NUMBER),  # vLLM's: keep tokens with p >= min_p * p_max (after temperature)
    # OpenAI's logit_bias as two lists: logit_bias[i] (in [-100, 100]) is added to token logit_bias_token_ids[i]
    _input("logit_bias_token_ids", "INT32", INT32S, dims=(-1,), ragged=True),
    _input("logit_bias", "FP32", NUMBERS, dims=(-1,), ragged=True),
    _input("allowed_token_ids", "INT32", INT32S, dims=(-1,), ragged=True),  # vLLM's: only these are chosen
    _input("stop_token_ids", "INT32", INT32S, dims=(-1,), ragged=True),  # vLLM's: these end the text too, unsent
    _input("speculative", "BYTES", STRING),  # "ngram" | "off" (default: the server's --speculative)
    # constrained decoding, as TensorRT-LLM names it: json | json_schema | regex | ebnf_grammar | choice
    _input("guided_decoding_guide_type", "BYTES", STRING),
    _input("guided_decoding_guide", "BYTES", STRING),
    _input("return_num_input_tokens", "BOOL", BOOL),
    _input("return_num_output_tokens", "BOOL", BOOL),
    # the prefix cache: a tenant's salt, and the operator's clear (needs the control key)
    _input("cache_salt", "BYTES", STRING),
    _input("clear_prefix_cache", "BOOL", BOOL),
    _input("control_key", "BYTES", STRING),
)}
OUTPUTS = {t.name: t for t in (
    Tensor("text_output", "BYTES", (-1,)),
    Tensor("output_ids", "INT32", (-1,)),
    Tensor("num_input_tokens", "INT32", (1,)),
    Tensor("num_output_tokens", "INT32", (1,)),  # tokens in this response
    Tensor("sequence_length", "INT32", (1,)),  # tokens generated so far
    Tensor("finish_reason", "BYTES", (1,)),  # "" until the last response
    Tensor("cum_log_probs", "FP32", (-1,)),  # these two only when return_log_probs is true
    Tensor("output_log_probs", "FP32", (-1, -1)),
    # [beam 1, tokens, k]: each output token's k = logprobs most likely tokens and their log-probs,
    # most likely first (only when logprobs > 0)
    Tensor("output_top_log_probs", "FP32", (-1, -1, -1)),
    Tensor("output_top_token_ids", "INT32", (-1, -1, -1)),
    Tensor("cached_tokens", "INT32", (1,)),  # prompt tokens served by the prefix cache
)}


# ---------------------------------------------------------------------- one request read

# A request's inputs: name -> the values sent, flattened (an input not sent is absent)
Inputs = Mapping[str, np.ndarray]


def json_inputs(body: dict) -> Inputs:
    """A /generate body's inputs, as Triton makes tensors of them: a field holds one value or a
    list, strings become UTF-8 bytes; fields that are no input are left out (Triton makes them
    request parameters). The body must have passed the inputs' JSON types (frontend/proxy.py)."""
    inputs = {}
    for name, value in body.items():
        spec = INPUTS.get(name)
        if spec is not None:
            values = value if isinstance(value, list) else [value]
            if spec.datatype == "BYTES":
                values = [v.encode("utf-8") for v in values]
            inputs[name] = np.array(values, dtype=spec.numpy_dtype)
    return inputs


def one_value(inputs: Inputs, name: str, default, convert):
    values = inputs.get(name)
    if values is None:
        return default
    if values.size != 1:
        raise RequestError(f"{name} must hold exactly one value (one prompt per request), got {values.size}")
    return convert(values[0])


def utf8(name: str) -> Callable[[bytes], str]:
    def convert(value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    return convert


def strings(inputs: Inputs, name: str) -> tuple[str, ...]:
    values = inputs.get(name)
    return tuple(map(utf8(name), values)) if values is not None else ()


def token_ids(inputs: Inputs, name: str) -> tuple[int, ...]:
    values = inputs.get(name)
    return tuple(values.tolist()) if values is not None else ()


def either(inputs: Inputs, names: tuple[str, str], convert):
    """The value of whichever of two alias inputs was sent (TensorRT-LLM renamed some inputs)."""
    values = {name: one_value(inputs, name, None, convert) for name in names}
    given = {k: v for k, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise RequestError(f"{' and '.join(names)} name the same option; send one of them")
    return next(iter(given.values()), None)


def identity_only(inputs: Inputs, name: str, identity: float, why: str) -> None:
    value = one_value(inputs, name, identity, float)
    if value != identity:
        raise RequestError(f"{name} must be {identity:g}: {why}, got {value:g}")


def prompt_of(inputs: Inputs) -> str | list[int]:
    """The prompt: text_input, or TensorRT-LLM's input_ids cut at input_lengths."""
    text = one_value(inputs, "text_input", None, utf8("text_input"))
    ids = inputs.get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("send the prompt as text_input or as input_ids, not both")
    if ids is None:
        return text or ""
    ids = ids.tolist()
    length = one_value(inputs, "input_lengths", len(ids), int)
    if not 0 <= length <= len(ids):
        raise RequestError(f"input_lengths must be in 0..{len(ids)} (the input_ids sent), got {length}")
    return ids[:length]


def cache_salt(inputs: Inputs) -> bytes | None:
    """The optional cache_salt (raw bytes): a request shares cached prefixes only with the same salt."""
    return one_value(inputs, "cache_salt", None, bytes)


# ---------------------------------------------------------------------- one response decoded

@dataclass
class Delta:
    """What one response of `llm` carries; outputs a request did not ask for keep these defaults."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, log p), most likely first
    finish_reason: str | None = None  # on the last response: "stop", "length" or "cancelled"
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @classmethod
    def from_result(cls, result, **more) -> "Delta":
        """From a tritonclient InferResult (anything whose as_numpy(name) gives an array or None);
        `more` fills the fields a subclass adds."""
        def values(name: str) -> list | None:
            array = result.as_numpy(name)
            return None if array is None else array.reshape(-1).tolist()

        text, logprobs, reason = values("text_output"), values("output_log_probs"), values("finish_reason")
        prompt_tokens, cached_tokens = values("num_input_tokens"), values("cached_tokens")
        ids = values("output_ids") or []
        return cls(text=b"".join(text).decode("utf-8") if text is not None else "",
                   token_ids=ids, logprobs=logprobs,
                   top_logprobs=per_token(values("output_top_token_ids"), values("output_top_log_probs"), len(ids)),
                   finish_reason=(reason[0].decode() or None) if reason else None,
                   prompt_tokens=prompt_tokens[0] if prompt_tokens else 0,
                   cached_tokens=cached_tokens[0] if cached_tokens else 0, **more)

    @classmethod
    def from_json(cls, body: dict, **more) -> "Delta":
        """From a /generate response body or generate_stream event (Triton writes a one-element
        output as a bare value)."""
        def listed(value) -> list | None:
            return value if isinstance(value, list) or value is None else [value]

        ids = listed(body.get("output_ids")) or []
        return cls(text=body.get("text_output", ""), token_ids=ids, logprobs=listed(body.get("output_log_probs")),
                   top_logprobs=per_token(listed(body.get("output_top_token_ids")),
                                          listed(body.get("output_top_log_probs")), len(ids)),
                   finish_reason=body.get("finish_reason") or None,
                   prompt_tokens=body.get("num_input_tokens", 0), cached_tokens=body.get("cached_tokens", 0), **more)


def per_token(ids: list[int] | None, logprobs: list[float] | None, tokens: int) -> list[list[tuple[int, float]]] | None:
    """The top-k outputs, flattened, as each token's [(id, log p)]."""
    if ids is None or logprobs is None:
        return None
    k = len(ids) // tokens if tokens else 0
    return [list(zip(ids[i * k:(i + 1) * k], logprobs[i * k:(i + 1) * k])) for i in range(tokens)]
