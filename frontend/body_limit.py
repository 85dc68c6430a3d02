"""ASGI middleware: no request body larger than a bound reaches the app (or Triton behind it).

A body over the bound (declared by Content-Length or counted as chunks arrive) is refused with
413; up to DISCARD_BYTES of it are read and dropped first, so a client still sending sees the
answer instead of a reset connection. Bodies within the bound are handed on whole, so the app
never sees a partial one; after the body, `receive` is the server's again (the app still hears
a client disconnect).
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DISCARD_BYTES = 64 << 20


async def send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()), *headers]})
    await send({"type": "http.response.body", "body": payload})


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def too_large(self, size: str) -> dict:
        return {"error": f"the request body is {size} bytes; the limit is {self.max_bytes} bytes"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                return await send_json(send, 400, {"error": "Content-Length must be a decimal number"})
        chunks, size, more = [], 0, True
        while more and size <= DISCARD_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        if size > self.max_bytes:
            return await send_json(send, 413, self.too_large(declared.decode() if declared else
                                                             f"more than {self.max_bytes}"),
                                   [(b"connection", b"close")])
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
