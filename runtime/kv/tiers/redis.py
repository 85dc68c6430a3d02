"""The Redis tier that several replicas share: one Redis server, or a Redis Cluster (detected from
any node's URL; no flag). A Redis that is down, killed or restarted empty costs misses and
counted errors, and is retried after an exponential backoff; in a cluster, per node, so a dead
primary costs only the blocks it held.

Keys: kvforge:<namespace hex>:{<placement tag hex>}:<block hash hex>. The braces are Redis
Cluster's hash tag: the blocks of one placement group (kvforge.block_hash.placement_tags,
PLACEMENT_BLOCKS consecutive blocks of a chain) share a slot, so a dead primary cuts a prefix
at a group boundary instead of at the first block it held (per-block keys spread a prefix over
every slot: with one primary of three dead, a prefix keeps ~2 blocks on average).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from runtime.kv.tiers.base import Into, Tier, TierStats
from runtime.kv.tiers.codec import Arrays, BlockCodec, CorruptEntry

log = logging.getLogger("kvforge.tiers")

REDIS_TIMEOUT_SECONDS = 1.0
BACKOFF_SECONDS = (0.5, 8.0)  # first retry after a Redis failure, and the cap of the doubling
URL_FORMAT = "redis://[:PASSWORD@]HOST:PORT/DB or rediss://..."
# One pipeline's entries at most: a 100K-token prefix is gigabytes, and a pipeline holds its whole
# request (puts) or reply (gets) in memory at once.
PIECE_BYTES = 8 << 20  # measured best of 2-256 MiB on loopback (bench/tier_rate.py)
NODE_THREADS = 8  # a cluster's primaries served at once; more primaries queue
DECODED = b"decoded"  # a get's reply once copied into its block (not None: the run goes on)


class Backoff:
    """When a failing endpoint may be tried again: doubling waits, reset by a success."""

    def __init__(self, what: str):
        self.what, self.retry_at, self.wait, self.down = what, 0.0, BACKOFF_SECONDS[0], False
        self.lock = threading.Lock()

    def available(self) -> bool:
        return time.monotonic() >= self.retry_at

    def failed(self, e: Exception) -> None:
        with self.lock:
            if not self.down:  # once per outage; redis-py's message names host and port, never the password
                log.warning("%s is unreachable (%s: %s); misses until it is back", self.what, type(e).__name__, e)
            self.down = True
            self.retry_at = time.monotonic() + self.wait
            self.wait = min(self.wait * 2, BACKOFF_SECONDS[1])

    def ok(self) -> None:
        with self.lock:
            if self.down:
                log.warning("%s is reachable again", self.what)
            self.down, self.wait = False, BACKOFF_SECONDS[0]


class RedisTier(Tier):
    """Value = the whole entry. Shared by every replica of the same model (the namespace, the hash
    chain and the placement tags are the same in every process); two replicas writing one key
    write the same bytes. Eviction is Redis's (maxmemory with allkeys-lru, or the optional TTL
    with volatile-lru)."""

    name = "redis"

    def __init__(self, url: str, codec: BlockCodec, ttl_seconds: int | None = None):
        import redis
        import redis.connection

        self.codec, self.ttl, self.url = codec, ttl_seconds, url
        self.stats = TierStats(self.name)
        self.prefix = b"kvforge:" + codec.namespace.hex().encode() + b":"
        self.errors = (redis.RedisError, OSError)
        try:  # the URL may hold a password: never repeat it
            self.database = int(redis.connection.parse_url(url).get("db") or 0)
        except ValueError:
            raise ValueError(f"the KV Redis URL is not valid: {URL_FORMAT}") from None
        self.client = None  # connected on first use: a Redis down at start is retried on the backoff
        self.cluster = False
        self.backoff = Backoff("the Redis KV tier")
        self.node_backoff: dict[str, Backoff] = {}
        self.connect_lock = threading.Lock()
        self.threads: ThreadPoolExecutor | None = None

    def key(self, block_hash: bytes, tag: bytes | None = None) -> bytes:
        """The block's key; tag: its placement tag (default: the block is its own group)."""
        return self.prefix + b"{" + (tag or block_hash).hex().encode() + b"}:" + block_hash.hex().encode()

    def _connect(self):
        """The client: redis.Redis, or redis.cluster.RedisCluster when the node says it is in one."""
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import RedisCluster
        from redis.retry import Retry

        with self.connect_lock:
            if self.client is not None:
                return self.client
            # our own backoff instead of redis-py's retries: a failing call returns at once as a miss
            options = dict(socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS,
                           retry=Retry(NoBackoff(), 0))
            probe = redis.Redis.from_url(self.url, **options)
            probe.connection_pool.connection_kwargs["db"] = 0  # a cluster node refuses SELECT of another database
            try:
                in_cluster = bool(probe.info("cluster").get("cluster_enabled"))
            finally:
                probe.close()
            if not in_cluster:
                self.client = redis.Redis.from_url(self.url, **options)
                return self.client
            if self.database != 0:
                self.enabled = False
                log.warning("the Redis KV tier is off: the KV Redis URL names a Redis Cluster node and database %d, "
                            "but a cluster has database 0 only", self.database)
                return None
            self.client = RedisCluster.from_url(self.url, require_full_coverage=False, **options)
            self.cluster = True
            return self.client

    def available(self) -> bool:
        return self.enabled and self.backoff.available()

    def _by_node(self, keys: list[bytes]) -> list[tuple[str, object, list[int]]]:
        """(node name, its client, indices of keys) for one pipeline per node: one round trip each."""
        client = self._connect()
        if client is None:
            return []
        if not self.cluster:
            return [("", client, list(range(len(keys))))]
        groups: dict[str, tuple[object, list[int]]] = {}
        for i, key in enumerate(keys):
            node = client.get_node_from_key(key)
            groups.setdefault(node.name, (node, []))[1].append(i)
        return [(name, client.get_redis_connection(node), indices) for name, (node, indices) in groups.items()]

    def _pipelined(self, keys: list[bytes], add, leading_run: bool = False, arrived=None) -> list:
        """Run add(pipe, key) for every key: per node, pipelines of at most PIECE_BYTES of entries
        one after another, the nodes of a cluster in parallel. A node that fails (or a key whose
        slot moved) gives None for its keys, counted as an error, and refreshes the slot map.
        leading_run: only the replies before the first None matter (a get of a chain), so a node
        stops at a piece with a None in it (its later keys all come after it). arrived(results)
        is called after each piece (from a node's thread)."""
        try:
            groups = self._by_node(keys)
        except self.errors as e:
            self.backoff.failed(e)
            self.stats.count("errors")
            return [None] * len(keys)
        results, stale = [None] * len(keys), []
        per_piece = max(1, PIECE_BYTES // self.codec.entry_bytes)

        def run(name: str, client, indices: list[int]) -> None:
            node = self.node_backoff.setdefault(name, Backoff(f"Redis Cluster node {name}")) if self.cluster \
                else self.backoff
            for start in range(0, len(indices), per_piece):
                if not node.available():
                    return
                piece = indices[start:start + per_piece]
                try:
                    pipe = client.pipeline(transaction=False)
                    for i in piece:
                        add(pipe, keys[i])
                    replies = pipe.execute(raise_on_error=False)
                except self.errors as e:
                    node.failed(e)
                    self.stats.count("errors")
                    stale.append(self.cluster)
                    return
                node.ok()
                self.backoff.ok()
                for i, reply in zip(piece, replies):
                    if isinstance(reply, Exception):  # e.g. MOVED after a failover
                        stale.append(self.cluster)
                        self.stats.count("errors")
                    else:
                        results[i] = reply
                if arrived is not None:
                    arrived(results)
                if leading_run and any(results[i] is None for i in piece):
                    return

        if len(groups) == 1:
            run(*groups[0])
        else:
            list(self._node_threads().map(lambda group: run(*group), groups))
        if any(stale):
            self._refresh_slots()
        return results

    def _node_threads(self) -> ThreadPoolExecutor:
        """Threads that talk to a cluster's primaries at once (each on its own connection)."""
        with self.connect_lock:
            if self.threads is None:
                self.threads = ThreadPoolExecutor(NODE_THREADS, thread_name_prefix="kvforge-redis-node")
            return self.threads

    def _refresh_slots(self) -> None:
        try:
            self.client.nodes_manager.initialize()
        except self.errors as e:
            log.debug("refreshing the Redis Cluster slot map failed: %s", e)

    def get_many(self, hashes: list[bytes], tags: list[bytes] | None = None, into: Into | None = None) -> list[Arrays]:
        """The leading run of hashes that Redis holds (tags: their placement tags; default: each
        block its own group), copied from the replies into `into`'s blocks."""
        if not hashes or not self.available():
            self.stats.count("miss_blocks", len(hashes))
            return []
        began = time.perf_counter()
        keys = [self.key(h, t) for h, t in zip(hashes, tags or hashes)]
        into = into or self.codec.blanks
        found: list[Arrays] = []
        ended, lock = False, threading.Lock()

        def decode(results: list) -> None:
            """Decode the replies that extend the run as their pieces arrive (a cluster's nodes in
            any order) and drop each once copied: a long prefix's replies never pile up in
            memory the process has not touched before (this VM's slow first touch)."""
            nonlocal ended
            with lock:
                start = end = len(found)
                while not ended and end < len(results) and results[end] is not None:
                    end += 1
                blocks = into(end - start) if end > start else []
                ended |= len(blocks) < end - start  # the pool cannot spare more
                for i, block in enumerate(blocks, start):
                    try:
                        self.codec.decode_into(hashes[i], results[i], block)
                    except CorruptEntry:
                        self.stats.count("corrupt_blocks")
                        ended = True
                        break
                    results[i] = DECODED
                    found.append(block)

        self._pipelined(keys, lambda pipe, key: pipe.get(key), leading_run=True, arrived=decode)
        nbytes = len(found) * self.codec.entry_bytes
        self.stats.measured(time.perf_counter() - began, nbytes)
        self.stats.count("hit_blocks", len(found))
        self.stats.count("miss_blocks", len(hashes) - len(found))
        self.stats.count("read_bytes", nbytes)
        return found

    def put_many(self, entries: list[tuple[bytes, bytes]], tags: list[bytes] | None = None) -> int:
        if not entries or not self.available():
            return 0
        raw_of = {self.key(h, t): raw for (h, raw), t in zip(entries, tags or [h for h, _ in entries])}
        replies = self._pipelined(list(raw_of), lambda pipe, key: pipe.set(key, raw_of[key], ex=self.ttl))
        stored = [raw for raw, reply in zip(raw_of.values(), replies) if reply]
        self.stats.count("written_blocks", len(stored))
        self.stats.count("written_bytes", sum(map(len, stored)))
        return len(stored)

    def close(self) -> None:
        if self.threads is not None:
            self.threads.shutdown(wait=False)
        if self.client is not None:
            self.client.close()
