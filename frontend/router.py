"""The KV-aware router: one front for N kvforge replicas, each prompt sent where its prefix is cached.

    python -m frontend.router --repo model_repository \\
        --replica http://127.0.0.1:8010,http://127.0.0.1:9010,http://127.0.0.1:8012 --replica ...

A replica is one kvforge launcher, named by three URLs: its front (/v2), its OpenAI API (/v1)
and its metrics port. The router serves on one port (127.0.0.1:8080 by default) the generate
endpoints (/v2/models/<m>/generate, /generate_stream), the OpenAI API (/v1), its own /metrics
and readiness (/v2/health/ready, /health: 503 while no replica is ready). Nothing else is
forwarded: Triton's control APIs (repository, logging, trace, shared memory) and metadata go
to a replica directly.

Routing: the prompt is tokenized with the engines' tokenizer (a chat through the front's chat
template) and named block by block with the engines' hash chain (kvforge/block_hash.py, under
the repository's cache namespace and the request's cache_salt). Each replica has an
approximate index: an LRU of the block hashes the router sent it, as many as its host RAM pool
holds. A replica's cost is the prompt tokens it would compute (the prompt minus the cached
prefix the index predicts) plus --balance-tokens for every sequence it is already serving;
the cheapest ready replica wins, ties go to the one routed to least. docs/fleet.md says why.
When a request completes, the blocks of its prompt + completion (which the replica now holds)
join the index: a conversation's next turn is predicted up to the end of the last answer.
That is --policy kv (the default); --policy round-robin takes the ready replicas in turn,
whatever they cache, and --policy affinity sends every request of a session (the X-Session-ID
header, or the OpenAI API's `user`) to the replica its hash names, by kv when it has none or
that replica is not ready. Both are there to compare against (bench/fleet.py) and for
operators whose clients expect one of them.

Health: every replica's readiness and metrics are polled each second; one that fails readiness
(or refuses a connection) leaves the rotation and its index is dropped (a restarted server has
an empty pool); it comes back when ready and still serving the router's cache namespace. A
request that fails before its first token (no connection, a 5xx) is retried once on another
replica; a stream that breaks later ends with an error event. `stop` goes to the replica
serving that X-Request-ID, `clear_prefix_cache` to every replica.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import httpx
import uvicorn
import uvloop
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from frontend.body_limit import BodyLimit
from frontend.config import DEFAULT_MAX_BODY_BYTES, FrontConfig
from frontend.openai_api import APIError, ChatRequest, CompletionRequest, OpenAIServer, Sampling
from frontend.proxy import DROPPED_HEADERS, STREAM_ERROR, error, generate_body_error, request_id_of, \
    response_headers, retry_after
from kvforge import env
from kvforge.block_hash import chain
from kvforge.cli import fail_cleanly
from kvforge.errors import INTERNAL, UNAVAILABLE, RequestError
from kvforge.limits import DRAIN_SECONDS
from kvforge.llm_io import Inputs, cache_salt, json_inputs, one_value, prompt_of
from kvforge.manifest import KV_BLOCK_TOKENS, cache_namespace, kv_block_spec
from kvforge.net import CONTROL_KEY_HEADER, is_loopback, port_in_use
from runtime.scheduler import PREFILL_BUDGET

DEFAULT_PORT = 8080
POLL_SECONDS = 1.0
POLL_TIMEOUT = 2.0  # a replica slower than this to answer readiness is treated as not ready
START_TIMEOUT = 10.0  # how long each replica may take to answer the checks at start
# An upper bound on one replica's index whatever its pool: 2**18 hashes (4M tokens) is ~40 MB here
MAX_INDEX_BLOCKS = 1 << 18
MAX_SCANNED_EVENT = 1 << 16  # an SSE event longer than this is passed on but not read
POLICIES = ("kv", "round-robin", "affinity")
SESSION_HEADER = "x-session-id"
# The router never hands on the control key: the APIs it guards are not forwarded
FORWARD_DROPPED = DROPPED_HEADERS | {CONTROL_KEY_HEADER}
ROUTES_SERVED = "/v2/models/<model>/generate, /v2/models/<model>/generate_stream, /v1, /metrics, /v2/health/ready"


class RouterError(ValueError):
    """A setting or replica the router refuses at start (one line, exit code 2)."""


# ---------------------------------------------------------------------- prompts -> block chains

@dataclass
class Prompt:
    """One prompt as the engines will see it: its tokens, salt and full blocks' chain hashes."""

    ids: list[int]
    salt: bytes | None
    chain: list[bytes]

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def reusable_blocks(self) -> int:
        """Blocks an engine may take from its cache: full ones, never the last prompt token's."""
        return max(0, self.tokens - 1) // KV_BLOCK_TOKENS


class Prompts:
    """Requests -> their Prompts, with the tokenizer and chat template the replicas use."""

    def __init__(self, repo: Path):
        # only its prompt building is used (manifest, tokenizer, chat template: the front's own
        # code); it never connects to anything
        self.openai = OpenAIServer(FrontConfig(triton_http="", triton_grpc="", model_repository=repo))
        self.namespace = cache_namespace(self.openai.manifest)
        self.block_bytes = kv_block_spec(self.openai.manifest).bytes_per_block

    def prompt(self, ids: list[int], salt: bytes | None) -> Prompt:
        return Prompt(ids, salt, chain(self.namespace, salt, ids, len(ids) // KV_BLOCK_TOKENS, KV_BLOCK_TOKENS))

    def answered(self, prompt: Prompt, generated: list[int]) -> Prompt:
        """The tokens a replica holds the KV of once it generated `generated` after `prompt`: all
        but the last generated one (sampled, never fed back)."""
        return self.prompt(prompt.ids + generated[:-1], prompt.salt)

    def of_text(self, text: str | list[int], salt: bytes | None) -> Prompt:
        return self.prompt(text if isinstance(text, list) else self.openai.tokenizer.encode(text), salt)

    def of_generate(self, inputs: Inputs) -> list[Prompt]:
        """A /v2 generate body's prompt, read as the llm model reads it (kvforge/llm_io.py); one it
        would refuse has none (the request is routed by load alone and the replica answers the error)."""
        try:
            return [self.of_text(prompt_of(inputs), cache_salt(inputs))]
        except RequestError:
            return []

    def of_openai(self, path: str, body: bytes) -> tuple[list[Prompt], str | None]:
        """A /v1 body's prompts, read as the front reads them, and its `user` (the end-user id
        the affinity policy may key on); a body the front would refuse has neither (it is
        routed by load alone and the replica answers the error)."""
        try:
            if path.endswith("/chat/completions"):
                chat = ChatRequest.model_validate_json(body)
                return [self.of_text(self.openai.chat_prompt(chat), salt_of(chat))], chat.user
            completion = CompletionRequest.model_validate_json(body)
        except (ValidationError, APIError):
            return [], None
        prompt = completion.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        return [self.of_text(p, salt_of(completion)) for p in prompts], completion.user


def salt_of(body: Sampling) -> bytes | None:
    """An OpenAI body's cache_salt as the front hands it to the llm model: UTF-8."""
    return body.cache_salt.encode() if body.cache_salt is not None else None


# ---------------------------------------------------------------------- replicas

@dataclass
class Replica:
    number: int  # 1..N: its label in the metrics (URLs stay out of every label but one)
    http: str  # the front: /v2
    openai: str  # the OpenAI API: /v1
    metrics: str  # Triton's metrics port
    ready: bool = True  # verified at start
    refused: str | None = None  # why it may not come back (logged once)
    open: int = 0  # requests the router has in flight there, counted as they happen
    outside: int = 0  # sequences it runs or queues that the router did not send (as of the last poll)
    capacity: int = 0  # blocks its host RAM pool holds (bounded by MAX_INDEX_BLOCKS)
    blocks: OrderedDict = field(default_factory=OrderedDict)  # chain hash -> None, least recent first
    routed: dict = field(default_factory=dict)  # endpoint -> requests
    predicted_tokens: int = 0
    cached_tokens: int = 0
    failed_attempts: int = 0

    @property
    def load(self) -> int:
        return self.open + self.outside

    def cached_prefix_tokens(self, prompts: list[Prompt]) -> int:
        """Prompt tokens this replica likely serves from its cache: the indexed run of leading blocks."""
        tokens = 0
        for prompt in prompts:
            for h in prompt.chain[:prompt.reusable_blocks]:
                if h not in self.blocks:
                    break
                tokens += KV_BLOCK_TOKENS
        return tokens

    def remember(self, prompts: list[Prompt]) -> None:
        """The replica computes (or reuses) these blocks now, so it holds them next."""
        for prompt in prompts:
            for h in prompt.chain:
                self.blocks[h] = None
                self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)

    def count(self, endpoint: str) -> None:
        self.routed[endpoint] = self.routed.get(endpoint, 0) + 1


def parse_replica(spec: str, number: int) -> Replica:
    urls = [u.strip().rstrip("/") for u in spec.split(",")]
    if len(urls) != 3 or not all(re.fullmatch(r"https?://[^/\s]+:\d+", u) for u in urls):
        raise RouterError(f"--replica {spec!r} must be three URLs: HTTP,OPENAI,METRICS "
                          "(e.g. http://127.0.0.1:8010,http://127.0.0.1:9010,http://127.0.0.1:8012)")
    return Replica(number, *urls)


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples in Prometheus text (the llm model's: one per instance), those
    carrying `label` (e.g. 'tier="redis"') when given."""
    return sum(float(value) for labels, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
               if label in labels)


class ResponseScanner:
    """What a response tells the router as it passes by (a whole body, or SSE events as they
    come): the cached prompt tokens it reports (llm's cached_tokens, OpenAI's
    usage.prompt_tokens_details; the last report counts) and what it generated (llm's
    output_ids, else the text of OpenAI's first choice)."""

    def __init__(self):
        self.pending, self.cached, self.ids, self.text = b"", None, [], ""
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


@dataclass
class Upstream:
    """A replica's response being relayed: what was read of it, and the rest to come."""

    response: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes = b""
    whole: bool = False  # `first` is the whole body


# ---------------------------------------------------------------------- the router

class Router:
    def __init__(self, prompts: Prompts, replicas: list[Replica], balance_tokens: int, api_key: str | None,
                 policy: str = "kv"):
        self.prompts, self.replicas, self.balance_tokens, self.api_key = prompts, replicas, balance_tokens, api_key
        self.policy = policy
        self.last_chosen = 0  # round-robin: the number of the replica chosen last
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.owners: dict[str, Replica] = {}  # X-Request-ID -> the replica serving it (for `stop`)
        self.retries = 0
        self.stream_errors = 0

    # -------------------------------------------------------------- checks and polling

    async def verify(self, replica: Replica) -> str | None:
        """Why this replica cannot join (None: it can): it must answer, serve our cache namespace
        and publish its pool's budget. Sets its index capacity."""
        what = f"replica {replica.number} ({replica.http})"
        url = f"{replica.http}/v2/models/llm/config"
        try:
            config = (await self.client.get(url, timeout=START_TIMEOUT)).json()
            url = f"{replica.metrics}/metrics"
            metrics = (await self.client.get(url, timeout=START_TIMEOUT)).text
            url = f"{replica.openai}/v1/models"
            models = await self.client.get(url, timeout=START_TIMEOUT,
                                           headers={"authorization": f"Bearer {self.api_key}"} if self.api_key else {})
        except (httpx.HTTPError, ValueError) as e:
            return f"{what} does not answer as a kvforge launcher: {url} ({type(e).__name__})"
        namespace = ((config.get("parameters") or {}).get("cache_namespace") or {}).get("string_value")
        if namespace is None:
            return f"{what}: its llm config has no cache_namespace parameter (a kvforge older than the router?)"
        if namespace != self.prompts.namespace.hex():
            return (f"{what} serves cache namespace {namespace[:16]}..., not this repository's "
                    f"{self.prompts.namespace.hex()[:16]}... (another model, weights, KV dtype or layout)")
        if models.status_code != 200:
            return f"{what}: its OpenAI URL {replica.openai} answers /v1/models with {models.status_code}"
        replica.capacity = min(MAX_INDEX_BLOCKS,
                               int(metric(metrics, "kvforge_kv_host_pool_budget_bytes")) // self.prompts.block_bytes)
        return None

    async def poll(self, replica: Replica) -> None:
        try:
            ready = (await self.client.get(f"{replica.http}/v2/health/ready", timeout=POLL_TIMEOUT)).status_code == 200
            metrics = (await self.client.get(f"{replica.metrics}/metrics", timeout=POLL_TIMEOUT)).text
        except httpx.HTTPError:
            ready = False
        if ready and not replica.ready:  # it may have come back as another model
            problem = await self.verify(replica)
            if problem:
                if problem != replica.refused:
                    log(f"{problem}; it stays out of the rotation")
                replica.refused = problem
                return
            replica.refused = None
            log(f"replica {replica.number} ({replica.http}) is ready: back in the rotation")
        if not ready:
            self.leave(replica, "fails readiness")
            return
        sequences = metric(metrics, "kvforge_running_sequences") + metric(metrics, "kvforge_waiting_sequences")
        replica.outside, replica.ready = max(0, int(sequences) - replica.open), True

    def leave(self, replica: Replica, why: str) -> None:
        if replica.ready:
            log(f"replica {replica.number} ({replica.http}) {why}: out of the rotation")
        replica.ready = False
        replica.blocks.clear()  # a server that restarts comes back with an empty pool

    async def poll_forever(self) -> None:
        while True:
            await asyncio.gather(*(self.poll(r) for r in self.replicas))
            await asyncio.sleep(POLL_SECONDS)

    # -------------------------------------------------------------- choosing

    def choose(self, prompts: list[Prompt], exclude: list[Replica], owner: Replica | None = None,
               session: str | None = None) -> Replica | None:
        """The ready replica the policy picks for this request (see the module docstring), or the
        owner of the request a `stop` names."""
        candidates = [r for r in self.replicas if r.ready and r not in exclude]
        if owner in candidates:
            return owner
        if self.policy == "round-robin":  # the next ready one after the last chosen (a retry: after the failed one)
            chosen = min(candidates, key=lambda r: (r.number - 1 - self.last_chosen) % len(self.replicas), default=None)
            self.last_chosen = chosen.number if chosen else self.last_chosen
            return chosen
        if self.policy == "affinity" and session is not None:
            home = self.replicas[session_home(session, len(self.replicas))]
            if home in candidates:
                return home
        tokens = sum(p.tokens for p in prompts)

        def cost(replica: Replica) -> tuple:
            work = tokens - replica.cached_prefix_tokens(prompts) + self.balance_tokens * replica.load
            return work, replica.load, sum(replica.routed.values()), replica.number

        return min(candidates, key=cost, default=None)

    # -------------------------------------------------------------- forwarding

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
        while len(tried) < 2 and (replica := self.choose(prompts, tried, owner, session)) is not None:
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
                self.leave(replica, f"failed a request ({type(e).__name__})")
                continue
            if upstream.response.status_code >= 500:
                replica.open -= 1
                replica.failed_attempts += 1
                failure = upstream
                continue
            replica.count(endpoint)
            if upstream.response.status_code == 200:
                replica.remember(prompts)
            return self.relay(replica, upstream, prompts, predicted, request_id, openai)
        if failure is not None:
            return Response(failure.first, failure.response.status_code,
                            headers={**response_headers(failure.response), "X-Request-ID": request_id})
        message = "no replica is ready; retry shortly" if not tried else \
            f"the request failed on {len(tried)} replicas before its first token; retry shortly"
        return unavailable(message, request_id, openai)

    def relay(self, replica: Replica, upstream: Upstream, prompts: list[Prompt], predicted: int, request_id: str,
              openai: bool) -> Response:
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
            generated = scanner.ids or (self.prompts.openai.tokenizer.encode(scanner.text, add_special_tokens=False)
                                        if scanner.text else [])
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

    # -------------------------------------------------------------- endpoints

    async def generate(self, request: Request) -> Response:
        request_id = request_id_of(request)
        problem, parsed = generate_body_error(await request.body())
        if problem:
            return error(400, problem, request_id)
        endpoint = request.url.path.rsplit("/", 1)[-1]
        inputs = json_inputs(parsed)
        if one_value(inputs, "clear_prefix_cache", False, bool):
            return await self.fan_out(request, await request.body(), request_id)
        if one_value(inputs, "stop", False, bool):  # to the replica serving that request (any one if none does)
            return await self.route(request, "stop", await request.body(), [], request_id, openai=False,
                                    owner=self.owners.get(request_id))
        prompts = await asyncio.to_thread(self.prompts.of_generate, inputs)
        return await self.route(request, endpoint, await request.body(), prompts, request_id, openai=False,
                                session=request.headers.get(SESSION_HEADER))

    async def openai(self, request: Request) -> Response:
        request_id = request_id_of(request)
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            failure = APIError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                               code="invalid_api_key")
            return JSONResponse(failure.body(), failure.status)
        body = await request.body()
        prompts, user = await asyncio.to_thread(self.prompts.of_openai, request.url.path, body) if body else ([], None)
        endpoint = request.url.path.removeprefix("/v1/").replace("/", "_")
        return await self.route(request, endpoint, body, prompts, request_id, openai=True,
                                session=request.headers.get(SESSION_HEADER) or user)

    async def ready(self, request: Request) -> Response:
        ready = [r.number for r in self.replicas if r.ready]
        return JSONResponse({"ready_replicas": ready}, 200 if ready else 503)

    async def not_served(self, request: Request) -> Response:
        return JSONResponse({"error": f"the router serves {ROUTES_SERVED} only; control and metadata APIs "
                                      "are not forwarded: send them to a replica"}, 404)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

    def metrics_text(self) -> str:
        families = [
            ("kvforge_router_replica_info", "gauge", "Each replica's number and front URL",
             [(f'replica="{r.number}",url="{r.http}"', 1) for r in self.replicas]),
            ("kvforge_router_replica_ready", "gauge", "1 while the replica is in the rotation",
             [(f'replica="{r.number}"', int(r.ready)) for r in self.replicas]),
            ("kvforge_router_replica_load", "gauge", "Sequences the replica serves (router's + others')",
             [(f'replica="{r.number}"', r.load) for r in self.replicas]),
            ("kvforge_router_index_blocks", "gauge", "Block hashes the router believes the replica holds",
             [(f'replica="{r.number}"', len(r.blocks)) for r in self.replicas]),
            ("kvforge_router_requests_total", "counter", "Requests routed, by replica and endpoint",
             [(f'replica="{r.number}",endpoint="{e}"', n) for r in self.replicas for e, n in sorted(r.routed.items())]),
            ("kvforge_router_predicted_cached_tokens_total", "counter",
             "Prompt tokens the index predicted cached, over responses that report cached tokens",
             [(f'replica="{r.number}"', r.predicted_tokens) for r in self.replicas]),
            ("kvforge_router_cached_tokens_total", "counter", "Prompt tokens the responses report cached",
             [(f'replica="{r.number}"', r.cached_tokens) for r in self.replicas]),
            ("kvforge_router_failed_attempts_total", "counter", "Attempts that failed before the first token",
             [(f'replica="{r.number}"', r.failed_attempts) for r in self.replicas]),
            ("kvforge_router_retries_total", "counter", "Requests retried on another replica", [("", self.retries)]),
            ("kvforge_router_stream_errors_total", "counter", "Streams that broke after their first token",
             [("", self.stream_errors)]),
        ]
        lines = []
        for name, kind, description, samples in families:
            lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            poller = asyncio.create_task(self.poll_forever())
            yield
            poller.cancel()
            await self.client.aclose()

        generate = [Route(path, self.generate, methods=["POST"]) for path in (
            "/v2/models/{model}/generate", "/v2/models/{model}/generate_stream",
            "/v2/models/{model}/versions/{version}/generate", "/v2/models/{model}/versions/{version}/generate_stream")]
        return Starlette(routes=[
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/health", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            *generate,
            Route("/v1/models", self.openai, methods=["GET"]),
            Route("/v1/completions", self.openai, methods=["POST"]),
            Route("/v1/chat/completions", self.openai, methods=["POST"]),
            Route("/{path:path}", self.not_served,
                  methods=["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]),
        ], lifespan=lifespan)


def session_home(session: str, replicas: int) -> int:
    """The index of a session's replica: a stable hash (Python's hash() changes per process, and
    a restarted router must send a session where it went before)."""
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % replicas


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def unavailable(message: str, request_id: str, openai: bool) -> Response:
    if openai:
        failure = APIError(503, message, kind=UNAVAILABLE.openai_type, retry=True)
        return JSONResponse(failure.body(), 503, headers={**failure.headers(), "X-Request-ID": request_id})
    return error(503, message, request_id, **retry_after(503))


def log(message: str) -> None:
    print(f"[router] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- the command

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m frontend.router", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("model_repository"),
                        help="the replicas' model repository: tokenizer, chat template, cache namespace")
    parser.add_argument("--replica", action="append", default=[], metavar="HTTP,OPENAI,METRICS",
                        help="a replica's front, OpenAI API and metrics URLs; once per replica")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--balance-tokens", type=int, default=PREFILL_BUDGET,
                        help="prompt tokens of cache hit worth one more sequence on a replica "
                             "(default: %(default)s, one prefill chunk)")
    parser.add_argument("--policy", default="kv", help=f"how a replica is chosen: {', '.join(POLICIES)} "
                        f"(default: kv; affinity keys on the {SESSION_HEADER} header or the OpenAI API's user)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if not args.replica:
        raise RouterError("give at least one --replica HTTP,OPENAI,METRICS")
    check_policy(args.policy)
    if not 0 < args.port < 65536:
        raise RouterError(f"--port must be a port in 1..65535, got {args.port}")
    if args.max_body_bytes <= 0 or args.balance_tokens < 0:
        raise RouterError("--max-body-bytes must be > 0 and --balance-tokens >= 0")
    if not os.environ.get(env.OPENAI_API_KEY) and not is_loopback(args.host):
        raise RouterError(f"the router on {args.host} would be open to anyone: set ${env.OPENAI_API_KEY} "
                          "(clients send it as a bearer token) or bind 127.0.0.1")
    if port_in_use(args.host, args.port):
        raise RouterError(f"port {args.port} on {args.host} (--port) is in use (another server?); choose another")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise RouterError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")


async def serve(args: argparse.Namespace) -> int:
    replicas = [parse_replica(spec, i) for i, spec in enumerate(args.replica, 1)]
    router = Router(Prompts(args.repo), replicas, args.balance_tokens, os.environ.get(env.OPENAI_API_KEY) or None,
                    args.policy)
    for problem in await asyncio.gather(*(router.verify(r) for r in replicas)):
        if problem:
            await router.client.aclose()
            raise RouterError(problem)
    server = uvicorn.Server(uvicorn.Config(BodyLimit(router.app(), args.max_body_bytes), host=args.host,
                                           port=args.port, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=DRAIN_SECONDS))
    log(f"routing http://{args.host}:{args.port} (/v2 generate, /v1, /metrics; policy {args.policy}) over "
        + ", ".join(f"{r.number}={r.http}" for r in replicas))
    await server.serve()  # uvicorn's own SIGINT/SIGTERM handling: in-flight requests finish first
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> int:
        check_args(args)
        return uvloop.run(serve(args))

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
