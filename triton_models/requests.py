"""Reading one request's inputs inside a Triton python-backend model (imported only by model.py files).

`inputs_of` gives a request's tensors as kvforge/llm_io.py's `Inputs`, read with its functions
(`one_value`, `prompt_of`, ...), the ones the router reads a /generate body with. Every model
that takes requests (llm and its aliases) refuses request parameters it would not read: over
HTTP /generate a JSON field that is no input becomes a parameter, and ignoring it would answer
a different request than the one sent.
"""
from __future__ import annotations

import json

from kvforge.errors import RequestError
from kvforge.llm_io import Inputs

# Triton reserves the triton_ prefix for its own request parameters; `request_id` is the id the
# HTTP front (or a gRPC client) gives a request for the access log
RESERVED_PARAMETER_PREFIX = "triton_"
LOG_ID_PARAMETER = "request_id"


def inputs_of(request) -> Inputs:
    return {tensor.name(): tensor.as_numpy().reshape(-1) for tensor in request.inputs()}


def request_parameters(request) -> dict:
    return {k: v for k, v in json.loads(request.parameters() or "{}").items()
            if not k.startswith(RESERVED_PARAMETER_PREFIX) and k != LOG_ID_PARAMETER}


def refuse_unknown_parameters(request, allowed=(), model="llm"):
    unknown = sorted(k for k in request_parameters(request) if k not in allowed)
    if unknown:
        raise RequestError(f"unknown request parameters {', '.join(unknown)}: the {model} model reads its inputs "
                           "only (over HTTP /generate every JSON field must be one of its inputs)")
