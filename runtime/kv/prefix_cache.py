"""The prefix cache over the host block pool (runtime/kv/block_pool.py), named by
kvforge.block_hash chain hashes.

On admission the longest cached prefix of full blocks (never the last prompt token: its logits
are needed) is copied into the sequence's row, and prefill starts after it. A request whose next
blocks are being computed by a running sequence waits for them instead of computing them again
(`in_flight`). Filled blocks are copied out to the pool after each step (and written behind to
the lower tiers). The copies go through the packed rows (runtime/kv/rows.py).
"""
from __future__ import annotations

import time
from functools import partial

from kvforge.block_hash import block_hash, chain, placement_tags, root_hash
from runtime.kv.block_pool import HostBlockPool
from runtime.kv.rows import PackedRows
from runtime.kv.tiers.lower import LowerTiers
from runtime.sequence import Sequence


class PrefixCache:
    """Not thread-safe: called under the engine's lock. pool None: the cache is off (nothing is
    matched or stored)."""

    def __init__(self, pool: HostBlockPool | None, namespace: bytes, rows: PackedRows,
                 tiers: LowerTiers | None = None):
        self.pool = pool
        self.namespace = namespace
        self.rows = rows
        self.tiers = tiers  # write-behind of every stored block (disk / Redis)
        self.block_tokens = rows.runner.block.tokens
        self.spec = rows.runner.manifest.model  # which longrope factors a prompt runs on is in its chain
        self.in_flight: dict[bytes, int] = {}  # block hash -> request id of the running sequence computing it
        self.counters = dict(prefix_cache_queried_tokens=0, prefix_cache_hit_tokens=0, copy_in_blocks=0,
                             copy_in_seconds=0.0, copy_out_blocks=0, copy_out_seconds=0.0)

    def hashes(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The chain hashes of seq's first `blocks` full blocks (computed once, extended as it grows)."""
        hashes, b = seq.block_hashes, self.block_tokens
        parent = hashes[-1] if hashes else root_hash(self.namespace, seq.cache_salt,
                                                     self.spec.long_factors(seq.rope_length))
        for i in range(len(hashes), blocks):
            parent = block_hash(parent, seq.tokens[i * b:(i + 1) * b])
            hashes.append(parent)
        return hashes[:blocks]

    def prompt_hashes(self, seq: Sequence) -> list[bytes]:
        """The hashes of the prompt blocks a hit may cover (never the last prompt token's block)."""
        return self.hashes(seq, (seq.num_prompt - 1) // self.block_tokens)

    def match(self, seq: Sequence) -> tuple[list[int], bool]:
        """(ids of the cached blocks seq can start from, whether its next block is being computed
        by a running sequence - then it should wait for it)."""
        if self.pool is None:
            return [], False
        hashes = self.prompt_hashes(seq)
        hit = self.pool.lookup(hashes)
        return hit, len(hit) < len(hashes) and hashes[len(hit)] in self.in_flight

    def uncached_tokens(self, seq: Sequence) -> int:
        """Prompt tokens seq would compute if admitted now (its RAM prefix hit aside)."""
        return seq.num_prompt - len(self.match(seq)[0]) * self.block_tokens

    def cached_blocks(self, token_ids: list[int], salt: bytes | None) -> tuple[list[bytes], dict]:
        """The hashes and copies of the leading full blocks of token_ids (the last token's block
        never: a prompt's last token is always recomputed) that the pool holds."""
        if self.pool is None:
            return [], {}
        hashes = chain(self.namespace, salt, token_ids, (len(token_ids) - 1) // self.block_tokens, self.block_tokens,
                       self.spec.long_factors(len(token_ids)))
        found = self.pool.lookup(hashes)
        return hashes[:len(found)], self.pool.get(found)

    def admit(self, seq: Sequence, row: int, hit: list[int]) -> None:
        """seq now owns row `row`: copy its cached prefix in, and announce the prompt blocks it is
        about to compute so that requests with the same prefix wait for them."""
        self.counters["prefix_cache_queried_tokens"] += seq.num_prompt
        if self.pool is None:
            return
        if hit:
            tokens = len(hit) * self.block_tokens
            self.rows.fit_capacity(tokens + 1)
            self.pool.acquire(hit)
            self.rows.copy_in(row, self.pool.runs(hit), partial(self._copied_in, len(hit)))
            self.counters["prefix_cache_hit_tokens"] += tokens
            seq.num_cached = seq.cached_tokens = tokens
            seq.pool_blocks, seq.num_stored_blocks = list(hit), len(hit)
        for h in self.hashes(seq, seq.num_prompt // self.block_tokens)[len(hit):]:
            self.in_flight.setdefault(h, seq.request_id)

    def _copied_in(self, blocks: int, seconds: float) -> None:
        self.counters["copy_in_seconds"] += seconds
        self.counters["copy_in_blocks"] += blocks

    def store(self, seq: Sequence, row: int) -> None:
        """Copy the blocks seq has filled since the last call out to the pool (right after a step)."""
        full = seq.num_cached // self.block_tokens
        start = seq.num_stored_blocks
        if self.pool is None or full <= start or not seq.stores_blocks:
            return
        hashes = self.hashes(seq, full)[start:]
        for h in hashes:
            if self.in_flight.get(h) == seq.request_id:
                del self.in_flight[h]
        began = time.perf_counter()
        data = self.rows.read(row, start, len(hashes))
        ids = self.pool.put(data, hashes)
        if self.tiers is not None:  # write-behind: every full block reaches disk / Redis when it is made
            self.tiers.store(hashes, data, placement_tags(seq.block_hashes, start, len(hashes)))
        self.counters["copy_out_seconds"] += time.perf_counter() - began
        self.counters["copy_out_blocks"] += len(hashes)
        seq.pool_blocks += ids
        seq.num_stored_blocks = full
        if len(ids) < len(hashes):  # the pool is full of referenced blocks: a gap ends seq's chain
            seq.stores_blocks = False

    def withdraw(self, seq: Sequence) -> None:
        """seq will not compute the blocks it announced (it left, or was preempted): requests
        waiting for them compute them themselves."""
        for h in seq.block_hashes:
            if self.in_flight.get(h) == seq.request_id:
                del self.in_flight[h]

    def release(self, seq: Sequence) -> None:
        """seq's references on cached blocks go (tail first, so the tail is evicted first)."""
        if self.pool is not None:
            self.pool.release(seq.pool_blocks[::-1])
        seq.pool_blocks = []

    def clear(self) -> int:
        """Empty the prefix cache (running sequences keep their slots); returns the blocks dropped."""
        return self.pool.clear() if self.pool is not None else 0
