"""The router's HTTP app: the endpoints it serves (/v2 generate, the OpenAI API /v1, /metrics,
readiness), each request's prompts read and handed to the relay; everything else is 404.
"""
from __future__ import annotations

import asyncio
import contextlib

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from frontend.openai_api import APIError
from frontend.proxy import error, generate_body_error, request_id_of
from frontend.router.policies import Policy
from frontend.router.prompts import Prompts
from frontend.router.relay import Relay
from frontend.router.replicas import Health, Replica
from kvforge.llm_io import json_inputs, one_value

SESSION_HEADER = "x-session-id"
ROUTES_SERVED = "/v2/models/<model>/generate, /v2/models/<model>/generate_stream, /v1, /metrics, /v2/health/ready"


class Router:
    """One client connection pool to the replicas, shared by their health checks and the relay."""

    def __init__(self, prompts: Prompts, replicas: list[Replica], balance_tokens: int, api_key: str | None,
                 policy: str = "kv"):
        self.prompts, self.replicas, self.api_key = prompts, replicas, api_key
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.health = Health(self.client, replicas, prompts, api_key)
        self.relay = Relay(self.client, replicas, Policy(policy, replicas, balance_tokens), self.health, prompts)

    async def generate(self, request: Request) -> Response:
        request_id = request_id_of(request)
        problem, parsed = generate_body_error(await request.body())
        if problem:
            return error(400, problem, request_id)
        endpoint = request.url.path.rsplit("/", 1)[-1]
        inputs = json_inputs(parsed)
        if one_value(inputs, "clear_prefix_cache", False, bool):
            return await self.relay.fan_out(request, await request.body(), request_id)
        if one_value(inputs, "stop", False, bool):  # to the replica serving that request (any one if none does)
            return await self.relay.route(request, "stop", await request.body(), [], request_id, openai=False,
                                          owner=self.relay.owners.get(request_id))
        prompts = await asyncio.to_thread(self.prompts.of_generate, inputs)
        return await self.relay.route(request, endpoint, await request.body(), prompts, request_id, openai=False,
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
        return await self.relay.route(request, endpoint, body, prompts, request_id, openai=True,
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
            ("kvforge_router_retries_total", "counter", "Requests retried on another replica",
             [("", self.relay.retries)]),
            ("kvforge_router_stream_errors_total", "counter", "Streams that broke after their first token",
             [("", self.relay.stream_errors)]),
        ]
        lines = []
        for name, kind, description, samples in families:
            lines += [f"# HELP {name} {description}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{{{labels}}} {value}" if labels else f"{name} {value}" for labels, value in samples]
        return "\n".join(lines) + "\n"

    def app(self) -> Starlette:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            poller = asyncio.create_task(self.health.poll_forever())
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
