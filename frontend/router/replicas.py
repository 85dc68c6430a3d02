"""The replicas: each one's URLs, load and approximate index, and their health.

A replica's index is an LRU of the block hashes the router sent it (and, once a request
completes, of its prompt + completion), as many as its host RAM pool holds: what it likely has
cached. Every replica's readiness and metrics are polled each second; one that fails readiness
(or refuses a connection) leaves the rotation and its index is dropped (a restarted server has
an empty pool); it comes back when ready and still serving the router's cache namespace.
"""
from __future__ import annotations

import asyncio
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import httpx

from frontend.router.prompts import Prompt, Prompts
from kvforge.manifest import KV_BLOCK_TOKENS

POLL_SECONDS = 1.0
POLL_TIMEOUT = 2.0  # a replica slower than this to answer readiness is treated as not ready
START_TIMEOUT = 10.0  # how long each replica may take to answer the checks at start
# An upper bound on one replica's index whatever its pool: 2**18 hashes (4M tokens) is ~40 MB here
MAX_INDEX_BLOCKS = 1 << 18


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


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples in Prometheus text (the llm model's: one per instance), those
    carrying `label` (e.g. 'tier="redis"') when given."""
    return sum(float(value) for labels, value in re.findall(rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.MULTILINE)
               if label in labels)


def log(message: str) -> None:
    print(f"[router] {message}", file=sys.stderr, flush=True)


class Health:
    """Which replicas are in the rotation: each verified at start and when it returns, polled each second."""

    def __init__(self, client: httpx.AsyncClient, replicas: list[Replica], prompts: Prompts, api_key: str | None):
        self.client, self.replicas, self.prompts, self.api_key = client, replicas, prompts, api_key

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
