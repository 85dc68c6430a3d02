"""Forwarding: a request to the replica the policy picks, once more to the next best if it fails
before its first token (no connection, a 5xx); the response relayed as it comes, read on the
way for what the index learns (the cached tokens reported, what was generated). A stream that
breaks later ends with an error event. `stop` goes to the replica serving that X-Request-ID,
`clear_prefix_cache` to every replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from frontend.openai_api import APIError
from frontend.proxy import DROPPED_HEADERS, STREAM_ERROR, error, response_headers, retry_after
from frontend.router.policies import Policy
from frontend.router.prompts import Prompt, Prompts
from frontend.router.replicas import Health, Replica
from kvforge.errors import INTERNAL, UNAVAILABLE
from kvforge.net import CONTROL_KEY_HEADER

MAX_SCANNED_EVENT = 1 << 16  # an SSE event longer than this is passed on but not read
# The router never hands on the control key: the APIs it guards are not forwarded
FORWARD_DROPPED = DROPPED_HEADERS | {CONTROL_KEY_HEADER}


class ResponseScanner:
    """What a response tells the router as it passes by (a whole body, or SSE events as they
    come): the cached prompt tokens it reports (llm's cached_tokens, OpenAI's
    usage.prompt_tokens_details; the last report counts) and what it generated (llm's
    output_ids, else the text and tool calls of OpenAI's first choice)."""

    def __init__(self):
        self.pending, self.cached, self.ids, self.text = b"", None, [], ""
        self.calls: dict[int, list[str]] = {}  # a tool call's index -> [name, arguments], as they stream
        self.whole = True  # every event was read (a skipped one leaves a gap in what it generated)

    def feed(self, chunk: bytes) -> None:
        *events, self.pending = (self.pending + chunk).split(b"\n\n")
        if len(self.pending) > MAX_SCANNED_EVENT:
            self.pending, self.whole = b"", False
        for event in events:
            if event.startswith(b"data: {"):
                self.read(event[6:])

    def read(self, content: bytes) -> None:
        try:
            payload = json.loads(content)
        except ValueError:
            return
        if not isinstance(payload, dict):
            return
        usage = payload.get("usage") or {}
        cached = payload.get("cached_tokens", (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
        if isinstance(cached, int):
            self.cached = cached
        ids = payload.get("output_ids")
        if isinstance(ids, list):
            self.ids += [i for i in (ids[0] if ids and isinstance(ids[0], list) else ids) if isinstance(i, int)]
        for choice in payload.get("choices") or []:
            if isinstance(choice, dict) and choice.get("index", 0) == 0:
                message = choice.get("delta") or choice.get("message") or {}
                part = choice.get("text") or (message.get("content") if isinstance(message, dict) else None)
                self.text += part if isinstance(part, str) else ""
                calls = message.get("tool_calls") if isinstance(message, dict) else None
                for position, call in enumerate(calls if isinstance(calls, list) else []):
                    self.add_call(position, call)

    def add_call(self, position: int, call) -> None:
        """A whole call (message.tool_calls, in order) or a streamed piece of one (delta.tool_calls,
        by index)."""
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            return
        entry = self.calls.setdefault(call.get("index", position), ["", ""])
        for i, key in enumerate(("name", "arguments")):
            entry[i] += function[key] if isinstance(function.get(key), str) else ""

    @property
    def tool_calls(self) -> list[tuple[str, str]]:
        return [(name, arguments) for _, (name, arguments) in sorted(self.calls.items())]


@dataclass
class Upstream:
    """A replica's response being relayed: what was read of it, and the rest to come."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes = b""
    whole: bool = False  # `first` is the whole body


class Relay:
    """Requests to replicas and their responses back; the counts /metrics reports of both."""

    def __init__(self, client: httpx.AsyncClient, replicas: list[Replica], policy: Policy, health: Health,
                 prompts: Prompts):
        self.client, self.replicas, self.policy, self.health, self.prompts = client, replicas, policy, health, prompts
        self.owners: dict[str, Replica] = {}  # X-Request-ID -> the replica serving it (for `stop`)
        self.retries = 0
        self.stream_errors = 0

    async def send(self, replica: Replica, request: Request, base: str, body: bytes, request_id: str) -> Upstream:
        """The replica's answer, read up to its first event (a stream) or whole (anything else):
        a failure while reading that much still counts as before the first token."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in FORWARD_DROPPED}
        headers["x-request-id"] = request_id
        response = await self.client.send(self.client.build_request(
            request.method, base + request.url.path, params=request.query_params, headers=headers, content=body),
            stream=True)
        upstream = Upstream(response, response.aiter_raw())
        streaming = response.status_code == 200 and \
            response.headers.get("content-type", "").startswith("text/event-stream")
        try:
            async for chunk in upstream.chunks:
                upstream.first += chunk
                if streaming and b"\n\n" in upstream.first:
                    return upstream  # the rest is relayed from the same iterator
        except BaseException:
            await response.aclose()
            raise
        upstream.whole = True
        await response.aclose()
        return upstream

    async def route(self, request: Request, endpoint: str, body: bytes, prompts: list[Prompt], request_id: str,
                    openai: bool, owner: Replica | None = None, session: str | None = None) -> Response:
        """Forward to the best replica; once more to the next best if it fails before the first token."""
        tried: list[Replica] = []
        failure: Upstream | None = None  # a replica's 5xx, handed on if no other replica does better
        while len(tried) < 2 and (replica := self.policy.choose(prompts, tried, owner, session)) is not None:
            if tried:
                self.retries += 1
            tried.append(replica)
            predicted = replica.cached_prefix_tokens(prompts)
            replica.open += 1
            try:
                upstream = await self.send(replica, request, replica.openai if openai else replica.http,
                                           body, request_id)
            except httpx.HTTPError as e:
                replica.open -= 1
                replica.failed_attempts += 1
                self.health.leave(replica, f"failed a request ({type(e).__name__})")
                continue
            if upstream.response.status_code >= 500:
                replica.open -= 1
                replica.failed_attempts += 1
                failure = upstream
                continue
            replica.count(endpoint)
            if upstream.response.status_code == 200:
                replica.remember(prompts)
            return self.respond(replica, upstream, prompts, predicted, request_id, openai)
        if failure is not None:
            return Response(failure.first, failure.response.status_code,
                            headers={**response_headers(failure.response), "X-Request-ID": request_id})
        message = "no replica is ready; retry shortly" if not tried else \
            f"the request failed on {len(tried)} replicas before its first token; retry shortly"
        return unavailable(message, request_id, openai)

    def respond(self, replica: Replica, upstream: Upstream, prompts: list[Prompt], predicted: int, request_id: str,
                openai: bool) -> Response:
        """The replica's response passed on as it comes; once it ends, the replica's index and
        counts learn from it."""
        response = upstream.response
        headers = {**response_headers(response), "X-Request-ID": request_id}
        scanner = ResponseScanner()

        def settle() -> None:
            replica.open -= 1
            self.owners.pop(request_id, None)
            if response.status_code != 200:
                return
            if scanner.cached is not None:  # predicted vs actual, over the responses that report it
                replica.predicted_tokens += predicted
                replica.cached_tokens += scanner.cached
            generated = scanner.ids or self.prompts.generated_ids(scanner.text, scanner.tool_calls)
            if generated and scanner.whole and len(prompts) == 1 and replica.ready:  # the next turn's history
                replica.remember([self.prompts.answered(prompts[0], generated)])

        if upstream.whole:
            scanner.read(upstream.first)
            settle()
            return Response(upstream.first, response.status_code, headers=headers)
        self.owners[request_id] = replica

        async def body() -> AsyncIterator[bytes]:
            try:
                scanner.feed(upstream.first)
                yield upstream.first
                async for chunk in upstream.chunks:
                    scanner.feed(chunk)
                    yield chunk
            except httpx.HTTPError as e:  # the replica went away mid-stream: say so rather than just stop
                self.stream_errors += 1
                message = STREAM_ERROR.format(type(e).__name__)
                yield event(APIError(502, message, kind=INTERNAL.openai_type).body() if openai else {"error": message})
                if openai:
                    yield b"data: [DONE]\n\n"
            finally:
                await response.aclose()  # also on a client disconnect: the replica then cancels the request
                settle()

        return StreamingResponse(body(), response.status_code, headers=headers)

    async def fan_out(self, request: Request, body: bytes, request_id: str) -> Response:
        """clear_prefix_cache: to every replica (each checks the control key itself)."""
        async def clear(replica: Replica) -> tuple[int, object]:
            try:
                upstream = await self.send(replica, request, replica.http, body, request_id)
                await upstream.response.aclose()
            except httpx.HTTPError as e:
                return 503, f"not reachable ({type(e).__name__})"
            replica.count("clear_prefix_cache")
            if upstream.response.status_code == 200:
                replica.blocks.clear()
            with contextlib.suppress(ValueError):
                return upstream.response.status_code, json.loads(upstream.first)
            return upstream.response.status_code, upstream.first.decode(errors="replace")

        answers = await asyncio.gather(*(clear(r) for r in self.replicas))
        status = next((s for s, _ in answers if s != 200), 200)
        return JSONResponse({"replicas": {str(r.number): {"status": s, "response": a}
                                          for r, (s, a) in zip(self.replicas, answers)}},
                            status, headers={"X-Request-ID": request_id})


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def unavailable(message: str, request_id: str, openai: bool) -> Response:
    if openai:
        failure = APIError(503, message, kind=UNAVAILABLE.openai_type, retry=True)
        return JSONResponse(failure.body(), 503, headers={**failure.headers(), "X-Request-ID": request_id})
    return error(503, message, request_id, **retry_after(503))
