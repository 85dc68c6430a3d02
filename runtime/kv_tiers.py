"""KV tiers below the host RAM pool: a local disk directory and a Redis server that several
replicas share. Order: slot buffers -> RAM pool (runtime/kv_manager.py) -> disk -> Redis.

Unit: one KV block (kvforge.manifest.KVBlockSpec), named by its prefix-cache chain hash, one
file or one Redis key each, header and data together (an entry is whole or absent, never half
evicted). Measured (`/tmp` on this machine's virtio disk, 256 blocks, read + checksum): a
small-llama block (1 MiB) reads at 0.84 GB/s one per file vs 0.78 GB/s sixteen per file, and a
tiny-llama block (16 KiB) costs 0.03 vs 0.02 ms: chunks buy nothing worth losing exact partial
hits and per-block LRU, so a file is a block.

Entry format (never pickle): a fixed little-endian header - magic, format version, tensor count,
the cache namespace, the block hash, payload length and a blake2b checksum of the payload -
then one (dtype, 3 dims) record per cache tensor, then the tensors' bytes in spec order. Any
mismatch (another model or KV dtype, a truncated or corrupt file) is a miss; a bad file is
removed and counted.

Faults are misses, never errors: a full or unwritable disk switches the disk tier off with one
warning; a Redis that is down, killed or restarted empty costs misses and counted errors, and
is retried after an exponential backoff. Writes are write-behind through a bounded queue
(full: the block is dropped and counted, the engine never waits); loads run on a loader thread,
so a request whose prefix is below RAM waits in a loading state while the batch keeps decoding.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import numpy as np

from kvforge.manifest import KVBlockSpec

log = logging.getLogger("kvforge.tiers")

MAGIC, VERSION = b"KVFB", 1
HEADER = struct.Struct("<4sHH32s16sQ16s")  # magic, version, tensors, namespace, hash, payload bytes, checksum
TENSOR = struct.Struct("<B3I")  # dtype code, block shape
DTYPE_CODES = {"float32": 1, "float16": 2, "int8": 3, "uint8": 4}
SUFFIX = ".kvb"
WRITE_QUEUE_BLOCKS = 1024
DRAIN_SECONDS = 3.0  # a graceful stop flushes queued writes within Triton's --exit-timeout-secs=5
REDIS_TIMEOUT_SECONDS = 1.0
BACKOFF_SECONDS = (0.5, 8.0)  # first retry after a Redis failure, and the cap of the doubling
LATENCY_SAMPLES = 256
# used until a tier has measured itself (bytes/s); deliberately optimistic so a first load is tried
INITIAL_BANDWIDTH = {"disk": 500e6, "redis": 100e6}
DISK_OFF_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}

Arrays = dict[str, np.ndarray]  # one block: cache tensor name -> [kv_heads, block_tokens, D]


class CorruptEntry(ValueError):
    pass


class BlockCodec:
    """Bytes <-> one block, checked against this engine's namespace and block spec."""

    def __init__(self, spec: KVBlockSpec, namespace: bytes):
        self.spec, self.namespace = spec, namespace
        self.tensors = b"".join(TENSOR.pack(DTYPE_CODES[t.dtype], *spec.block_shape(t.name)) for t in spec.tensors)
        self.payload_bytes = spec.bytes_per_block
        self.entry_bytes = HEADER.size + len(self.tensors) + self.payload_bytes

    def encode(self, block_hash: bytes, arrays: Arrays) -> bytes:
        payload = b"".join(np.ascontiguousarray(arrays[t.name], t.dtype).tobytes() for t in self.spec.tensors)
        checksum = hashlib.blake2b(payload, digest_size=16).digest()
        return HEADER.pack(MAGIC, VERSION, len(self.spec.tensors), self.namespace, block_hash, len(payload),
                           checksum) + self.tensors + payload

    def decode(self, block_hash: bytes, raw: bytes) -> Arrays:
        if len(raw) != self.entry_bytes:
            raise CorruptEntry(f"entry is {len(raw)} bytes, expected {self.entry_bytes}")
        magic, version, count, namespace, stored_hash, length, checksum = HEADER.unpack_from(raw)
        if (magic, version, count, length) != (MAGIC, VERSION, len(self.spec.tensors), self.payload_bytes):
            raise CorruptEntry("header does not match this format")
        if namespace != self.namespace or stored_hash != block_hash:
            raise CorruptEntry("entry belongs to another model, KV dtype or block")
        if raw[HEADER.size:HEADER.size + len(self.tensors)] != self.tensors:
            raise CorruptEntry("tensor shapes or dtypes differ")
        payload = memoryview(raw)[HEADER.size + len(self.tensors):]
        if hashlib.blake2b(payload, digest_size=16).digest() != checksum:
            raise CorruptEntry("checksum mismatch")
        arrays, offset = {}, 0
        for t in self.spec.tensors:
            shape = self.spec.block_shape(t.name)
            array = np.frombuffer(payload, t.dtype, int(np.prod(shape)), offset).reshape(shape)
            arrays[t.name], offset = array, offset + array.nbytes
        return arrays


class TierStats:
    """Counters of one tier, and its measured read bandwidth and load latencies."""

    def __init__(self, name: str):
        self.name = name
        self.counters = dict(hit_blocks=0, miss_blocks=0, read_bytes=0, written_bytes=0, written_blocks=0,
                             evicted_blocks=0, errors=0, corrupt_blocks=0, read_seconds=0.0)
        self.bandwidth = INITIAL_BANDWIDTH[name]
        self.measured_bandwidth = False
        self.latency = 0.0
        self.latencies: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.lock = threading.Lock()

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counters[key] += n

    def measured(self, seconds: float, nbytes: int) -> None:
        with self.lock:
            self.latencies.append(seconds)
            if nbytes:
                rate = nbytes / max(seconds, 1e-6)
                self.bandwidth = 0.7 * self.bandwidth + 0.3 * rate if self.measured_bandwidth else rate
                self.measured_bandwidth = True
                self.counters["read_seconds"] += seconds

    def estimate(self, nbytes: int) -> float:
        """Seconds a load of nbytes is expected to take."""
        p50 = float(np.median(self.latencies)) if self.latencies else 0.0
        return min(p50, 0.05) + nbytes / self.bandwidth

    def snapshot(self) -> dict:
        with self.lock:
            lat = np.array(self.latencies) if self.latencies else np.zeros(1)
            return dict(self.counters, load_p50_seconds=float(np.percentile(lat, 50)),
                        load_p99_seconds=float(np.percentile(lat, 99)), bandwidth_bytes_per_second=self.bandwidth)


class DiskTier:
    """Files DIR/<namespace>/<hash>.kvb within a byte budget, least recently used evicted first.
    The index is rebuilt from the directory at start, so a restarted server hits what it stored."""

    name = "disk"

    def __init__(self, root: Path, budget_bytes: int, codec: BlockCodec):
        self.codec, self.budget_bytes = codec, budget_bytes
        self.stats = TierStats(self.name)
        self.dir = Path(root) / codec.namespace.hex()[:32]
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes; least recently used first
        self.bytes_used = 0
        self.enabled = True
        self.lock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as e:
            self._switch_off(e)

    def _rebuild(self) -> None:
        entries = []
        for path in self.dir.iterdir():
            if path.suffix != SUFFIX:  # a temporary file left by a crash mid-write
                path.unlink(missing_ok=True)
                continue
            try:
                block_hash = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime, block_hash, st.st_size))
        for _, block_hash, size in sorted(entries):
            self.index[block_hash] = size
            self.bytes_used += size
        self._evict(0)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _switch_off(self, e: OSError) -> None:
        if self.enabled:  # the file name stays out of the message: paths are the operator's business
            log.warning("the disk KV tier is off from now on: %s (serving continues without it)",
                        e.strerror or type(e).__name__)
        self.enabled = False
        self.stats.count("errors")

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def present(self, hashes: list[bytes]) -> int:
        """How many of hashes[0..] are stored, as a run."""
        with self.lock:
            return next((i for i, h in enumerate(hashes) if h not in self.index), len(hashes))

    def get(self, block_hash: bytes) -> Arrays | None:
        with self.lock:
            if not self.enabled or block_hash not in self.index:
                self.stats.count("miss_blocks")
                return None
            self.index.move_to_end(block_hash)
        path = self._path(block_hash)
        began = time.perf_counter()
        try:
            raw = path.read_bytes()
            arrays = self.codec.decode(block_hash, raw)
        except (OSError, CorruptEntry) as e:
            self._forget(block_hash, corrupt=isinstance(e, CorruptEntry))
            return None
        self.stats.measured(time.perf_counter() - began, len(raw))
        self.stats.count("hit_blocks")
        self.stats.count("read_bytes", len(raw))
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return arrays

    def _forget(self, block_hash: bytes, corrupt: bool) -> None:
        with self.lock:
            self.bytes_used -= self.index.pop(block_hash, 0)
        self._path(block_hash).unlink(missing_ok=True)
        self.stats.count("miss_blocks")
        self.stats.count("corrupt_blocks" if corrupt else "errors")

    def put(self, block_hash: bytes, raw: bytes) -> None:
        with self.lock:
            if not self.enabled or block_hash in self.index or len(raw) > self.budget_bytes:
                return
            self._evict(len(raw))
        path = self._path(block_hash)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in DISK_OFF_ERRNOS:
                self._switch_off(e)
            else:
                self.stats.count("errors")
            return
        with self.lock:
            if block_hash not in self.index:
                self.index[block_hash] = len(raw)
                self.bytes_used += len(raw)
        self.stats.count("written_blocks")
        self.stats.count("written_bytes", len(raw))

    def _evict(self, incoming: int) -> None:
        """Under the lock: drop least recently used files until `incoming` more bytes fit."""
        while self.index and self.bytes_used + incoming > self.budget_bytes:
            block_hash, size = self.index.popitem(last=False)
            self.bytes_used -= size
            self._path(block_hash).unlink(missing_ok=True)
            self.stats.count("evicted_blocks")


class RedisTier:
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


class LowerTiers:
    """Disk and/or Redis behind the RAM pool: a writer thread drains the write-behind queue, a
    loader thread fetches the prefixes that waiting requests asked for."""

    def __init__(self, codec: BlockCodec, disk: DiskTier | None, redis: RedisTier | None,
                 wake: Callable[[], None], queue_blocks: int = WRITE_QUEUE_BLOCKS):
        self.codec, self.disk, self.redis, self.wake = codec, disk, redis, wake
        self.tiers = [t for t in (disk, redis) if t is not None]
        self.writes: queue.Queue = queue.Queue(queue_blocks)
        self.loads: queue.Queue = queue.Queue()
        self.done: list[tuple[int, list[bytes], list[Arrays]]] = []
        self.done_lock = threading.Lock()
        self.counters = dict(tier_write_dropped_blocks=0, tier_loads=0, tier_loads_abandoned=0)
        self.closing = False
        self.writer = threading.Thread(target=self._write_loop, name="kvforge-tier-writer", daemon=True)
        self.loader = threading.Thread(target=self._load_loop, name="kvforge-tier-loader", daemon=True)
        self.writer.start()
        self.loader.start()

    # ------------------------------------------------------------------ writes (engine thread: never blocks)

    def store(self, hashes: list[bytes], data: dict[str, np.ndarray]) -> None:
        """Queue blocks i of data[name][i] (fresh copies, as read_blocks returns them) under hashes[i]."""
        for i, h in enumerate(hashes):
            try:
                self.writes.put_nowait((h, {name: array[i] for name, array in data.items()}))
            except queue.Full:
                self.counters["tier_write_dropped_blocks"] += len(hashes) - i
                return

    def demote(self, block_hash: bytes, read: Callable[[], Arrays]) -> None:
        """A block leaves RAM: keep it on disk unless it is there already (its write may have been dropped)."""
        if self.disk is not None and self.disk.enabled and not self.disk.contains(block_hash):
            self.store([block_hash], {name: array[None].copy() for name, array in read().items()})

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            batch = [item]
            while len(batch) < 64:
                try:
                    item = self.writes.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self.writes.put(None)
                    break
                batch.append(item)
            entries = [(h, self.codec.encode(h, arrays)) for h, arrays in batch]
            if self.disk is not None:
                for h, raw in entries:
                    self.disk.put(h, raw)
            if self.redis is not None:
                self.redis.put_many(entries)

    # ------------------------------------------------------------------ loads (off the step loop)

    def request_load(self, request_id: int, hashes: list[bytes], recompute_seconds: float | None) -> None:
        self.counters["tier_loads"] += 1
        self.loads.put((request_id, hashes, recompute_seconds))

    def estimate(self, tier, blocks: int) -> float:
        return tier.stats.estimate(blocks * self.codec.entry_bytes)

    def _load(self, hashes: list[bytes], recompute_seconds: float | None) -> list[Arrays]:
        """The leading run of hashes found on disk, continued from Redis; a tier expected to be
        slower than recomputing those tokens is skipped."""
        found: list[Arrays] = []
        for tier in self.tiers:
            rest = hashes[len(found):]
            if not rest:
                break
            wanted = self.disk.present(rest) if tier is self.disk else len(rest)
            if wanted == 0:
                continue
            if recompute_seconds is not None and self.estimate(tier, wanted) > recompute_seconds * wanted / len(hashes):
                self.counters["tier_loads_abandoned"] += 1
                break
            if tier is self.disk:
                got = list(itertools.takewhile(lambda a: a is not None, map(self.disk.get, rest[:wanted])))
                found += got
                if len(got) < wanted:
                    break  # a file went bad: a chain does not continue past a hole
            else:
                found += tier.get_many(rest)
        return found

    def _load_loop(self) -> None:
        while True:
            item = self.loads.get()
            if item is None:
                return
            request_id, hashes, recompute_seconds = item
            try:
                found = self._load(hashes, recompute_seconds)
            except Exception:  # a tier bug must cost a miss, not the loader
                log.exception("loading KV blocks failed")
                found = []
            with self.done_lock:
                self.done.append((request_id, hashes[:len(found)], found))
            self.wake()

    def finished_loads(self) -> list[tuple[int, list[bytes], list[Arrays]]]:
        with self.done_lock:
            done, self.done = self.done, []
        return done

    # ------------------------------------------------------------------ lifetime

    def close(self, drain_seconds: float = DRAIN_SECONDS) -> None:
        """Flush queued writes for at most drain_seconds, then stop both threads."""
        self.loads.put(None)
        deadline = time.monotonic() + drain_seconds
        while self.writes.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            self.writes.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self.writer.join(max(0.0, deadline - time.monotonic()))
        self.loader.join(0.5)
        if self.redis is not None:
            self.redis.close()

    def stats(self) -> dict:
        tiers = {}
        for t in self.tiers:
            snapshot = t.stats.snapshot()
            tiers[t.name] = dict(snapshot, hit_tokens=snapshot["hit_blocks"] * self.codec.spec.tokens,
                                 enabled=int(getattr(t, "enabled", True)), bytes=getattr(t, "bytes_used", 0))
        return dict(self.counters, tier_write_queue_blocks=self.writes.qsize(), tiers=tiers)

    @staticmethod
    def no_stats() -> dict:
        """stats() of an engine without lower tiers."""
        return dict(tier_write_dropped_blocks=0, tier_loads=0, tier_loads_abandoned=0, tier_write_queue_blocks=0,
                    tiers={})
