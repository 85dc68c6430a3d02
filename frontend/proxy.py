"""Triton's /v2 HTTP API through the front: readiness that knows about supervision, the generate
endpoints' JSON checked before Triton parses it, kvforge's errors with their kind's status,
streams passed on unbuffered.

Triton answers malformed JSON, wrong JSON types and text that is no Unicode with HTTP 500, and
a model's refusal for load (the llm model's UNAVAILABLE) with 400; the front answers 400 naming
the field, and every error carrying a kind's prefix (kvforge/errors.py: a full queue's
"UNAVAILABLE:", a server fault's "INTERNAL:") with that kind's status (503 + Retry-After, 500).
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

from frontend.config import RETRY_AFTER_SECONDS, FrontConfig
from frontend.json_text import lone_surrogate
from kvforge import llm_io
from kvforge.errors import UNAVAILABLE, kind_of, quote
from kvforge.jsonlog import append_json_line

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# hop-by-hop headers and those httpx sets itself are not forwarded
DROPPED_HEADERS = {"host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                   "content-length", "proxy-authorization", "proxy-connection"}
STREAM_ERROR = "the server ended the stream early ({}); the request did not finish"


def generate_body_error(body: bytes) -> tuple[str | None, dict | None]:
    """(what is wrong with a generate request's JSON, or None; the parsed object)."""
    try:
        request = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"the request body is not valid JSON: {getattr(e, 'msg', str(e))}", None
    if not isinstance(request, dict):
        return f"the request body must be a JSON object, got {type(request).__name__}", None
    not_text = lone_surrogate(request)
    if not_text:
        return not_text[1], None
    # what each input must be in JSON (the llm model checks the values' ranges itself)
    for name, spec in llm_io.INPUTS.items():
        if name in request and not spec.json.accepts(request[name]):
            value = request[name]
            shown = quote(value if isinstance(value, str) else json.dumps(value))
            return f"{name} must be {spec.json.description}, got {shown}", None
    if "parameters" in request and not isinstance(request["parameters"], dict):
        return "parameters must be a JSON object", None
    return None, request


def error(status: int, message: str, request_id: str, **headers) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers={"X-Request-ID": request_id, **headers})


def status_of(message: str, status: int) -> int:
    """The HTTP status of an error Triton answered with `status`: a kvforge error's comes from its
    kind (Triton's status does not follow it: UNAVAILABLE comes as 400); Triton's own keep theirs."""
    kind = kind_of(message)
    return kind.http_status if kind.prefix else status


def retry_after(status: int) -> dict[str, str]:
    """The Retry-After header a status calls for (a 503: busy, or not ready yet)."""
    return {"Retry-After": str(RETRY_AFTER_SECONDS)} if status == UNAVAILABLE.http_status else {}


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
            return error(503, reason, request_id, **retry_after(503))
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
                         **retry_after(503))
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
            if status >= 400:
                status = status_of(error_message(content), status)
            if logged:
                log(dict(record, status=status, bytes_out=len(content),
                         total_ms=round(1000 * (time.perf_counter() - started), 2)))
            return Response(content, status, headers={**response_headers(upstream), "X-Request-ID": request_id,
                                                      **retry_after(status)})
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
        kind = kind_of(message)
        if kind.prefix:  # refused before the first token: the status says so
            await upstream.aclose()
            # "queue full": the access log's word for a refusal for load since before the kinds
            log(dict(record, status=kind.http_status, error="queue full" if kind is UNAVAILABLE else kind.name))
            return error(kind.http_status, message, record["request_id"], **retry_after(kind.http_status))
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
