"""The Redis tier that several replicas share. A Redis that is down, killed or restarted empty
costs misses and counted errors, and is retried after an exponential backoff."""
from __future__ import annotations

import logging
import threading
import time

from runtime.kv.tiers.base import Tier, TierStats
from runtime.kv.tiers.codec import Arrays, BlockCodec, CorruptEntry

log = logging.getLogger("kvforge.tiers")

REDIS_TIMEOUT_SECONDS = 1.0
BACKOFF_SECONDS = (0.5, 8.0)  # first retry after a Redis failure, and the cap of the doubling


class RedisTier(Tier):
    """One key per block, kvforge:<namespace hex>:<hash hex>, value = the whole entry. Shared by
    every replica of the same model (the namespace and hash chain are the same in every process);
    two replicas writing one key write the same bytes. Eviction is Redis's (maxmemory with
    allkeys-lru, or the optional TTL with volatile-lru)."""

    name = "redis"

    def __init__(self, url: str, codec: BlockCodec, ttl_seconds: int | None = None):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.codec, self.ttl = codec, ttl_seconds
        self.stats = TierStats(self.name)
        self.prefix = b"kvforge:" + codec.namespace.hex().encode() + b":"
        self.errors = (redis.RedisError, OSError)
        try:  # our own backoff instead of redis-py's retries: a failing call returns at once as a miss
            self.client = redis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_SECONDS,
                                               socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                                               retry=Retry(NoBackoff(), 0))
        except ValueError:  # the URL may hold a password: never repeat it
            raise ValueError("the KV Redis URL is not valid: redis://[:PASSWORD@]HOST:PORT/DB or rediss://...") from None
        self.retry_at, self.backoff, self.down = 0.0, BACKOFF_SECONDS[0], False
        self.lock = threading.Lock()

    def key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    def available(self) -> bool:
        return time.monotonic() >= self.retry_at

    def _failed(self, e: Exception) -> None:
        with self.lock:
            if not self.down:  # once per outage; redis-py's message names host and port, never the password
                log.warning("the Redis KV tier is unreachable (%s: %s); misses until it is back",
                            type(e).__name__, e)
            self.down = True
            self.retry_at = time.monotonic() + self.backoff
            self.backoff = min(self.backoff * 2, BACKOFF_SECONDS[1])
        self.stats.count("errors")

    def _ok(self) -> None:
        with self.lock:
            if self.down:
                log.warning("the Redis KV tier is reachable again")
            self.down, self.backoff = False, BACKOFF_SECONDS[0]

    def get_many(self, hashes: list[bytes]) -> list[Arrays]:
        """The leading run of hashes that Redis holds, in one pipelined round trip."""
        if not hashes or not self.available():
            self.stats.count("miss_blocks", len(hashes))
            return []
        began = time.perf_counter()
        try:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(self.key(h))
            values = pipe.execute()
        except self.errors as e:
            self._failed(e)
            self.stats.count("miss_blocks", len(hashes))
            return []
        self._ok()
        found = []
        for h, raw in zip(hashes, values):
            if raw is None:
                break
            try:
                found.append(self.codec.decode(h, raw))
            except CorruptEntry:
                self.stats.count("corrupt_blocks")
                break
        nbytes = len(found) * self.codec.entry_bytes
        self.stats.measured(time.perf_counter() - began, nbytes)
        self.stats.count("hit_blocks", len(found))
        self.stats.count("miss_blocks", len(hashes) - len(found))
        self.stats.count("read_bytes", nbytes)
        return found

    def put_many(self, entries: list[tuple[bytes, bytes]]) -> None:
        if not entries or not self.available():
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for h, raw in entries:
                pipe.set(self.key(h), raw, ex=self.ttl)
            pipe.execute()
        except self.errors as e:
            self._failed(e)
            return
        self._ok()
        self.stats.count("written_blocks", len(entries))
        self.stats.count("written_bytes", sum(len(raw) for _, raw in entries))

    def close(self) -> None:
        self.client.close()
