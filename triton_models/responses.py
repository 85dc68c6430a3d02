"""What every kvforge python-backend model sends: the final-response flag, and errors behind
their kind's wire prefix with the kind's Triton error code (kvforge/errors.py has the table)."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

from kvforge.errors import Kind, wire_message

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCELLED_MESSAGE = "the request was cancelled"  # behind the CANCELLED prefix


def error(kind: Kind, message: str):
    # TritonError exists only in a model instance's stub, not while Triton imports the model
    code = getattr(pb_utils.TritonError, kind.triton_code)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(wire_message(kind, message), code))


def send_error(sender, kind: Kind, message: str) -> None:
    """End a request (its response sender) with an error."""
    sender.send(error(kind, message), flags=FINAL)
