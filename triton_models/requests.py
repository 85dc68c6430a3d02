"""Reading one request's inputs inside a Triton python-backend model (imported only by model.py files).

Every model that takes requests (llm and its aliases) refuses request parameters it would not
read: over HTTP /generate a JSON field that is no input becomes a parameter, and ignoring it
would answer a different request than the one sent.
"""
from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from kvforge.errors import RequestError

# Triton reserves the triton_ prefix for its own request parameters; `request_id` is the id the
# HTTP front (or a gRPC client) gives a request for the access log
RESERVED_PARAMETER_PREFIX = "triton_"
LOG_ID_PARAMETER = "request_id"


def one_value(request, name, default, convert):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise RequestError(f"{name} must hold exactly one value (one prompt per request), got {values.size}")
    return convert(values[0])


def utf8(name):
    def convert(value: bytes) -> str:
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8: {e.reason} at byte {e.start}") from None
    return convert


def strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return tuple(map(utf8(name), tensor.as_numpy().reshape(-1))) if tensor is not None else ()


def either(request, names, convert):
    """The value of whichever of two alias inputs was sent (TensorRT-LLM renamed some inputs)."""
    values = {name: one_value(request, name, None, convert) for name in names}
    given = {k: v for k, v in values.items() if v is not None}
    if len(set(given.values())) > 1:
        raise RequestError(f"{' and '.join(names)} name the same option; send one of them")
    return next(iter(given.values()), None)


def request_parameters(request) -> dict:
    return {k: v for k, v in json.loads(request.parameters() or "{}").items()
            if not k.startswith(RESERVED_PARAMETER_PREFIX) and k != LOG_ID_PARAMETER}


def refuse_unknown_parameters(request, allowed=(), model="llm"):
    unknown = sorted(k for k in request_parameters(request) if k not in allowed)
    if unknown:
        raise RequestError(f"unknown request parameters {', '.join(unknown)}: the {model} model reads its inputs "
                           "only (over HTTP /generate every JSON field must be one of its inputs)")


def identity_only(request, name, identity, why):
    value = one_value(request, name, identity, float)
    if value != identity:
        raise RequestError(f"{name} must be {identity:g}: {why}, got {value:g}")
