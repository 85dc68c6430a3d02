"""The tiers below the host RAM pool, as one: a writer thread drains the write-behind queue (full:
the block is dropped and counted, the engine never waits) and a loader thread fetches the
prefixes waiting requests asked for, so a request whose prefix is below RAM waits in a loading
state while the batch keeps decoding. Faults are misses, never errors.

A load decodes straight into host pool blocks (mapped ahead: block_pool.py), taken under the
engine's lock as each tier finds entries and named by the engine when the load ends: a loaded
byte is copied from the page cache (or a Redis reply) into the pool, and from there into a row
at admission. Before, a 16K-token load from page-cached disk made a bytes object per block, then
the engine thread copied them into the pool: 0.3 GB/s, all of it first-touched pages.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from functools import partial
from typing import Callable

import numpy as np

from runtime.kv.tiers.base import Tier
from runtime.kv.tiers.codec import Arrays, BlockCodec

log = logging.getLogger("kvforge.tiers")

WRITE_QUEUE_BLOCKS = 1024
DRAIN_SECONDS = 3.0  # a graceful stop flushes queued writes within Triton's --exit-timeout-secs=5


class LowerTiers:
    """Disk and/or Redis behind the RAM pool."""

    def __init__(self, codec: BlockCodec, tiers: list[Tier], wake: Callable[[], None],
                 lock: threading.Lock | threading.Condition | None = None, queue_blocks: int = WRITE_QUEUE_BLOCKS):
        """tiers: nearest first; wake() is called when a load has finished; lock: the engine's,
        under which the pool is used (loads take their blocks under it)."""
        self.codec, self.tiers, self.wake = codec, list(tiers), wake
        self.lock = lock or threading.Lock()
        self.pool = None  # the host pool loads decode into (runtime/kv/loads.py sets it)
        # the nearest tier that keeps what RAM evicts (disk: a write-behind may have been dropped)
        self.demote_to = next((t for t in self.tiers if t.keeps_evictions), None)
        self.writes: queue.Queue = queue.Queue(queue_blocks)
        self.loads: queue.Queue = queue.Queue()
        self.done: list[tuple[int, list[bytes], list[int]]] = []
        self.done_lock = threading.Lock()
        self.counters = dict(tier_write_dropped_blocks=0, tier_loads=0, tier_loads_abandoned=0)
        self.writer = threading.Thread(target=self._write_loop, name="kvforge-tier-writer", daemon=True)
        self.loader = threading.Thread(target=self._load_loop, name="kvforge-tier-loader", daemon=True)
        self.writer.start()
        self.loader.start()

    # ------------------------------------------------------------------ writes (engine thread: never blocks)

    def store(self, hashes: list[bytes], data: dict[str, np.ndarray], tags: list[bytes] | None = None,
              tiers: list[Tier] | None = None) -> None:
        """Queue blocks i of data[name][i] (fresh copies, as read_blocks returns them) under hashes[i]
        with placement tags[i] (default: each block its own group), for `tiers` (default: all)."""
        tags = tags or hashes
        for i, h in enumerate(hashes):
            try:
                self.writes.put_nowait((h, tags[i], {name: array[i] for name, array in data.items()}, tiers))
            except queue.Full:
                self.counters["tier_write_dropped_blocks"] += len(hashes) - i
                return

    def demote(self, block_hash: bytes, read: Callable[[], Arrays]) -> None:
        """A block leaves RAM: keep it in the nearest local tier unless it is there already (its
        write-behind may have been dropped)."""
        tier = self.demote_to
        if tier is not None and tier.enabled and not tier.contains(block_hash):
            self.store([block_hash], {name: array[None].copy() for name, array in read().items()}, tiers=[tier])

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
            encoded = [(h, tag, self.codec.encode(h, arrays), tiers) for h, tag, arrays, tiers in batch]
            for tier in self.tiers:
                mine = [(h, tag, raw) for h, tag, raw, tiers in encoded
                        if (tier.write_behind if tiers is None else tier in tiers)]
                if mine:
                    tier.put_many([(h, raw) for h, _, raw in mine], [tag for _, tag, _ in mine])

    # ------------------------------------------------------------------ loads (off the step loop)

    def request_load(self, request_id: int, hashes: list[bytes], tags: list[bytes],
                     recompute_seconds: float | None) -> None:
        self.counters["tier_loads"] += 1
        self.loads.put((request_id, hashes, tags, recompute_seconds))

    def estimate(self, tier, blocks: int) -> float:
        return tier.stats.estimate(blocks * self.codec.entry_bytes)

    def _take(self, taken: list[int], n: int) -> list[Arrays]:
        """Up to n pool blocks for a load to decode into (fewer when the pool cannot spare them),
        recorded in `taken`."""
        with self.lock:
            ids = self.pool.anonymous(n, partial=True)
        taken += ids
        return [self.pool.block(b) for b in ids]

    def _load(self, hashes: list[bytes], tags: list[bytes], recompute_seconds: float | None, taken: list[int]) -> int:
        """How many of hashes[0..] arrived, into the pool blocks `taken` lists first (a leading
        run found in the first tier, continued from the next); a tier expected to be slower than
        recomputing those tokens is skipped."""
        found = 0
        for tier in self.tiers:
            rest = hashes[found:]
            if not rest:
                break
            wanted = tier.present(rest)
            if wanted == 0:
                continue
            if recompute_seconds is not None and self.estimate(tier, wanted) > recompute_seconds * wanted / len(hashes):
                self.counters["tier_loads_abandoned"] += 1
                break
            got = len(tier.get_many(rest[:wanted], tags[found:found + wanted], partial(self._take, taken)))
            found += got
            if got < wanted:
                break  # an entry went bad or is gone: a chain does not continue past a hole
        return found

    def _load_loop(self) -> None:
        while True:
            item = self.loads.get()
            if item is None:
                return
            request_id, hashes, tags, recompute_seconds = item
            taken: list[int] = []
            try:
                found = self._load(hashes, tags, recompute_seconds, taken)
            except Exception:  # a tier bug must cost a miss, not the loader
                log.exception("loading KV blocks failed")
                found = 0
            with self.done_lock:
                self.done.append((request_id, hashes[:found], taken))
            self.wake()

    def finished_loads(self) -> list[tuple[int, list[bytes], list[int]]]:
        """(request id, the hashes that arrived, the pool blocks the load took: the first
        len(hashes) hold them, in order; the rest were taken but not filled)."""
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
        for tier in self.tiers:
            tier.close()

    def stats(self) -> dict:
        tiers = {}
        for t in self.tiers:
            snapshot = t.stats.snapshot()
            tiers[t.name] = dict(snapshot, hit_tokens=snapshot["hit_blocks"] * self.codec.spec.tokens,
                                 enabled=int(t.enabled), bytes=t.bytes_used)
        return dict(self.counters, tier_write_queue_blocks=self.writes.qsize(), tiers=tiers)

    @staticmethod
    def no_stats() -> dict:
        """stats() of an engine without lower tiers."""
        return dict(tier_write_dropped_blocks=0, tier_loads=0, tier_loads_abandoned=0, tier_write_queue_blocks=0,
                    tiers={})
