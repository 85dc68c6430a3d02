"""Error kinds and how each reaches a client: the one table from kind to HTTP, gRPC and OpenAI status.

The engine raises typed errors. The llm model sends an error's message behind its kind's wire
prefix (the text before the first colon, e.g. "UNAVAILABLE: the waiting queue is full ..."),
because a decoupled stream's error reaches a gRPC client as its message alone, with no status
code. The front and the clients read the kind back with `kind_of`, never by matching wording,
so rewording a message cannot change a status code. A message without a prefix is the
request's fault (400), which is what Triton itself refuses before a model runs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    name: str
    prefix: str  # what the llm model puts before the message ("" for the default kind)
    http_status: int
    grpc_status: str  # the gRPC status name a client sees for it
    triton_code: str  # the attribute of pb_utils.TritonError the llm model sends
    openai_type: str
    retry: bool = False  # clients should retry later (HTTP 503 with Retry-After)


INVALID = Kind("invalid_request", "", 400, "INVALID_ARGUMENT", "INVALID_ARG", "invalid_request_error")
UNAVAILABLE = Kind("unavailable", "UNAVAILABLE:", 503, "UNAVAILABLE", "UNAVAILABLE", "server_busy", retry=True)
CANCELLED = Kind("cancelled", "CANCELLED:", 499, "CANCELLED", "CANCELLED", "cancelled")
INTERNAL = Kind("internal", "INTERNAL:", 500, "INTERNAL", "INTERNAL", "server_error")
KINDS = (INVALID, UNAVAILABLE, CANCELLED, INTERNAL)


class KVForgeError(Exception):
    """An error a client is told about; its class decides the status."""

    kind = INTERNAL


class RequestError(KVForgeError, ValueError):
    """A request that cannot be served as given; the message says what to change."""

    kind = INVALID


class Unavailable(KVForgeError):
    """The server cannot take the request now (load, a deadline while waiting); retry later."""

    kind = UNAVAILABLE


class QueueFullError(Unavailable):
    """The waiting queue is at its bound."""


class EngineError(KVForgeError):
    """The server failed the request (a failed step, an engine shut down)."""


def quote(value, limit: int = 80) -> str:
    """What an error may echo of user input: at most `limit` characters, and its length."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def wire_message(kind: Kind, message: str) -> str:
    """The message as the llm model sends it: behind its kind's prefix (once)."""
    if not kind.prefix or message.startswith(kind.prefix):
        return message
    return f"{kind.prefix} {message}"


def kind_of(message: str) -> Kind:
    """The kind a message from the llm model (or Triton) carries."""
    return next((k for k in KINDS if k.prefix and message.startswith(k.prefix)), INVALID)
