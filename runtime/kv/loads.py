"""Loads from the tiers below the host RAM pool (disk, Redis, a prefill worker's hand-off;
runtime/kv/tiers/): a waiting request whose prompt blocks after its RAM hit may be below asks
for them once, waits in the loading state while the batch keeps decoding, and finds what arrived
in the pool when it is admitted (PrefixCache.match)."""
from __future__ import annotations

from kvforge.block_hash import placement_tags
from runtime.kv.prefix_cache import PrefixCache
from runtime.kv.tiers.lower import LowerTiers
from runtime.sequence import Sequence


class TierLoads:
    """Not thread-safe: called under the engine's lock. tiers None: nothing is ever loaded."""

    def __init__(self, prefix: PrefixCache, tiers: LowerTiers | None):
        self.prefix = prefix
        self.pool = prefix.pool
        self.tiers = tiers  # needs the pool
        # request id -> pool blocks a loading request holds (its RAM hit and what arrived), so
        # promoting the rest of its prefix cannot evict the head
        self.refs: dict[int, list[int]] = {}
        if tiers is not None:
            self.pool.on_evict = tiers.demote
            tiers.pool = self.pool

    def start(self, seq: Sequence, hit: list[int], recompute_seconds: float | None) -> bool:
        """Ask the tiers below RAM for the prompt blocks after `hit` (once per request); True if
        seq should wait in the loading state for them."""
        if self.tiers is None or seq.tiers_checked:
            return False
        seq.tiers_checked = True
        hashes = self.prefix.prompt_hashes(seq)[len(hit):]
        if not hashes:
            return False
        self.pool.acquire(hit)
        self.refs[seq.request_id] = list(hit)
        tags = placement_tags(seq.block_hashes, len(hit), len(hashes))
        self.tiers.request_load(seq.request_id, hashes, tags, recompute_seconds)
        return True

    def finish(self) -> list[int]:
        """Cache the blocks finished loads decoded into the RAM pool, held for their request until
        it is admitted (match then finds them); returns the request ids whose loads ended."""
        ended = []
        for request_id, hashes, taken in self.tiers.finished_loads() if self.tiers is not None else []:
            self.pool.release(taken[len(hashes):])  # taken, never filled: the chain ended first
            ids = self.pool.named(taken[:len(hashes)], hashes)
            if request_id in self.refs:
                self.refs[request_id] += ids
            else:  # the request went on without it: the blocks stay cached for the next one
                self.pool.release(ids[::-1])
            ended.append(request_id)
        return ended

    def drop(self, seq: Sequence) -> None:
        """seq no longer waits for a load (admitted: its hit holds the blocks now; or gone)."""
        if self.pool is not None:
            self.pool.release(self.refs.pop(seq.request_id, [])[::-1])
