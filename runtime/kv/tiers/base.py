"""What every tier below RAM offers (LMCache's storage backends are the model), and its counters.

A tier stores encoded entries (tiers/codec.py) by block hash. `get_many` decodes the leading
run of the hashes it holds into blocks it is given (in the engine: host pool blocks, written in
place) and returns them; `put_many` stores entries; neither raises on a fault: a
failing tier is a miss, counted in its stats. Both take the blocks' placement tags (which
blocks a distributed tier keeps together); a local tier ignores them. `present` is a cheap upper bound of that run, for
the load-or-recompute estimate.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable

import numpy as np

from runtime.kv.tiers.codec import Arrays

# Blocks for the next n entries a tier has found, to decode into (fewer: no room for more).
# Default: new arrays (BlockCodec.blanks).
Into = Callable[[int], list[Arrays]]
LATENCY_SAMPLES = 256
# used until a tier has measured itself (bytes/s); deliberately optimistic so a first load is tried
INITIAL_BANDWIDTH = {"disk": 500e6, "redis": 100e6, "handoff": 2e9}


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


class Tier(ABC):
    name: str
    stats: TierStats
    enabled = True  # False once the tier switched itself off
    bytes_used = 0  # bytes it holds, where it knows (0: not tracked)
    keeps_evictions = False  # takes the blocks RAM evicts (a local tier; a shared one got them by write-behind)
    write_behind = True  # the engine writes its new blocks to it (not to a hand-off: a prefill worker does)

    def contains(self, block_hash: bytes) -> bool:
        """Whether the tier is known to hold the block (False when it cannot tell cheaply)."""
        return False

    def present(self, hashes: list[bytes]) -> int:
        """At most how many of hashes[0..] get_many could return, as a run."""
        return len(hashes)

    @abstractmethod
    def get_many(self, hashes: list[bytes], tags: list[bytes] | None = None, into: Into | None = None) -> list[Arrays]:
        """The leading run of hashes the tier holds, decoded into `into`'s blocks and checked. tags:
        each block's placement tag (kvforge.block_hash.placement_tags), for a tier that spreads
        blocks over nodes. A tier asks `into` in run order, for the entries it has found so far."""

    @abstractmethod
    def put_many(self, entries: list[tuple[bytes, bytes]], tags: list[bytes] | None = None) -> int:
        """Store encoded entries (block hash, entry bytes), with their placement tags; returns how
        many the tier holds now (a failed write, a tier in its backoff: fewer, without an error)."""

    def close(self) -> None:
        pass
