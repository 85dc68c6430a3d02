"""Triton's /v2 HTTP API through the front: readiness that knows about supervision, the generate
endpoints' JSON checked before Triton parses it, queue-full as 503, streams passed on unbuffered.

Triton answers malformed JSON and wrong JSON types with HTTP 500 and a full queue (the llm
model's UNAVAILABLE) with 400; the front answers 400 naming the field and 503 + Retry-After.
Every proxied request carries one id (X-Request-ID, made here unless the client sent a sane
one), handed to the llm model as the request parameter `request_id` and written to the
access log with the status and times; the engine logs its token counts under the same id.
"""
from __future__ import annotations

import contextlib
import json
import re
import secrets
import time
from pathlib import Path
from typing import Callable

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from frontend.config import FrontConfig
from kvforge.errors import quote
from kvforge.jsonlog import append_json_line

UNAVAILABLE = "UNAVAILABLE:"  # how the llm model starts a queue-full error (the documented prefix)
RETRY_AFTER_SECONDS = 1
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# hop-by-hop headers and those httpx sets itself are not forwarded
DROPPED_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "content-length", "proxy-authorization", "proxy-connection"}
STREAM_ERROR = "the server ended the stream early ({}); the request did not finish"


def integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# what each generate field must be in JSON (the llm model checks the values' ranges itself)
GENERATE_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "text_input": (lambda v: isinstance(v, str), "a string"),
    "max_tokens": (lambda v: integer(v) and -2**31 <= v < 2**31, "an integer"),
    "temperature": (number, "a number"),
    "top_p": (number, "a number"),
    "top_k": (lambda v: integer(v) and -2**31 <= v < 2**31, "an integer"),
    "seed": (lambda v: integer(v) and 0 <= v < 2**64, "an integer in 0..2**64-1"),
    **{name: (lambda v: isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v),
              "a string or a list of strings") for name in ("stop_words", "bad_words")},
    **{name: (lambda v: isinstance(v, bool), "true or false")
       for name in ("stream", "stop", "exclude_input_in_output", "return_log_probs")},
    **{name: (number, "a number")
       for name in ("repetition_penalty", "presence_penalty", "frequency_penalty", "length_penalty")},
    **{name: (lambda v: integer(v) and -2**31 <= v < 2**31, "an integer")
       for name in ("min_tokens", "min_length", "end_id", "pad_id", "beam_width", "num_return_sequences")},
    "random_seed": (lambda v: integer(v) and 0 <= v < 2**64, "an integer in 0..2**64-1"),
    "cache_salt": (lambda v: isinstance(v, str), "a string"),
    "clear_prefix_cache": (lambda v: isinstance(v, bool), "true or false"),
    "control_key": (lambda v: isinstance(v, str), "a string"),
}


def generate_body_error(body: bytes) -> tuple[str | None, dict | None]:
    """(what is wrong with a generate request's JSON, or None; the parsed object)."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"the request body is not valid JSON: {getattr(e, 'msg', str(e))}", None
    if not isinstance(request, dict):
        return f"the request body must be a JSON object, got {type(request).__name__}", None
    for name, (valid, what) in GENERATE_FIELDS.items():
        if name in request and not valid(request[name]):
            return f"{name} must be {what}, got {quote(request[name] if isinstance(request[name], str) else json.dumps(request[name]))}", None
    if "parameters" in request and not isinstance(request["parameters"], dict):
        return "parameters must be a JSON object", None
    return None, request


def error(status: int, message: str, request_id: str, **headers) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers={"X-Request-ID": request_id, **headers})


def queue_full(message: str) -> bool:
    return message.startswith(UNAVAILABLE)


def create_proxy_app(config: FrontConfig, not_ready: Callable[[], str | None], access_log: Path | None) -> Starlette:
    """The /v2 API; `not_ready()` returns why the service must not get traffic (or None)."""
    client = httpx.AsyncClient(base_url=f"http://{config.triton_http}", timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def log(record: dict) -> None:
        append_json_line(access_log, dict(source="front", **record))

    async def ready(request: Request) -> Response:
        reason = not_ready()
        if reason:
            return JSONResponse({"error": reason}, 503)
        # a load balancer asks every few seconds: not worth an access-log line each
        return await forward(request, b"", request_id_of(request), logged=False)

    async def generate(request: Request) -> Response:
        request_id = request_id_of(request)
        reason = not_ready()
        if reason:
            return error(503, reason, request_id, **{"Retry-After": str(RETRY_AFTER_SECONDS)})
        problem, body = generate_body_error(await request.body())
        if problem:
            log(dict(request_id=request_id, path=request.url.path, status=400, error=problem))
            return error(400, problem, request_id)
        body["parameters"] = {**body.get("parameters", {}), "request_id": request_id}
        return await forward(request, json.dumps(body).encode(), request_id)

    async def proxy(request: Request) -> Response:
        return await forward(request, await request.body(), request_id_of(request))

    async def forward(request: Request, body: bytes, request_id: str, logged: bool = True) -> Response:
        started = time.perf_counter()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
        if headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            headers["content-type"] = "application/json"  # what curl -d sends; Triton's JSON is what it means
        headers["x-request-id"] = request_id
        upstream_request = client.build_request(request.method, request.url.path, params=request.query_params,
                                                headers=headers, content=body)
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as e:
            log(dict(request_id=request_id, path=request.url.path, status=503, error=type(e).__name__))
            return error(503, "the inference server is not reachable right now; retry shortly", request_id,
                         **{"Retry-After": str(RETRY_AFTER_SECONDS)})
        streaming = upstream.headers.get("content-type", "").startswith("text/event-stream")
        record = dict(request_id=request_id, method=request.method, path=request.url.path,
                      bytes_in=len(body), status=upstream.status_code)
        if not streaming:
            try:
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
            except httpx.HTTPError as e:
                content = json.dumps({"error": STREAM_ERROR.format(type(e).__name__)}).encode()
                upstream.status_code = 502
            finally:
                await upstream.aclose()
            status = upstream.status_code
            if status == 400 and queue_full(error_message(content)):
                status = 503
            if logged:
                log(dict(record, status=status, bytes_out=len(content),
                         total_ms=round(1000 * (time.perf_counter() - started), 2)))
            extra = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == 503 else {}
            return Response(content, status, headers={**response_headers(upstream), "X-Request-ID": request_id,
                                                      **extra})
        return await stream(upstream, record, started)

    async def stream(upstream: httpx.Response, record: dict, started: float) -> Response:
        """SSE passed on as it comes; the first event is read first so a refusal gets its status."""
        chunks = upstream.aiter_raw()
        first = b""
        try:
            while b"\n\n" not in first:
                first += await anext(chunks)
        except (StopAsyncIteration, httpx.HTTPError):
            pass
        first_event = first.split(b"\n\n", 1)[0]
        message = error_message(first_event[first_event.find(b"{"):]) if b"data:" in first_event else ""
        if queue_full(message):
            await upstream.aclose()
            log(dict(record, status=503, error="queue full"))
            return error(503, message, record["request_id"], **{"Retry-After": str(RETRY_AFTER_SECONDS)})
        first_byte = time.perf_counter()
        events = 0

        async def body():
            nonlocal events
            yield first
            events = first.count(b"\n\n")
            try:
                async for chunk in chunks:
                    events += chunk.count(b"\n\n")
                    yield chunk
            except httpx.HTTPError as e:  # Triton went away mid-stream: say so rather than just stop
                record["error"] = type(e).__name__
                yield b"data: " + json.dumps({"error": STREAM_ERROR.format(type(e).__name__)}).encode() + b"\n\n"
            finally:
                await upstream.aclose()  # also on a client disconnect: Triton then cancels the request
                log(dict(record, first_byte_ms=round(1000 * (first_byte - started), 2), events=events,
                         total_ms=round(1000 * (time.perf_counter() - started), 2)))

        return StreamingResponse(body(), upstream.status_code, media_type="text/event-stream",
                                 headers={"X-Request-ID": record["request_id"], "Cache-Control": "no-cache"})

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    app = Starlette(routes=[
        Route("/v2/health/ready", ready, methods=["GET"]),
        Route("/v2/models/{model}/ready", ready, methods=["GET"]),
        Route("/v2/models/{model}/versions/{version}/ready", ready, methods=["GET"]),
        Route("/v2/models/{model}/generate", generate, methods=["POST"]),
        Route("/v2/models/{model}/generate_stream", generate, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/generate", generate, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/generate_stream", generate, methods=["POST"]),
        Route("/v2", proxy, methods=methods),
        Route("/v2/{path:path}", proxy, methods=methods),
    ], lifespan=lambda app: closing(client))
    return app


@contextlib.asynccontextmanager
async def closing(client: httpx.AsyncClient):
    yield
    await client.aclose()


def request_id_of(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if REQUEST_ID.fullmatch(given) else secrets.token_hex(8)


def error_message(content: bytes) -> str:
    try:
        message = json.loads(content).get("error", "")
    except (ValueError, AttributeError):
        return ""
    return message if isinstance(message, str) else ""


def response_headers(upstream: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in DROPPED_HEADERS}
