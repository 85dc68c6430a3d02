"""KV memory, in real bytes, as one object for the scheduler: the packed rows of the runner's
slots (rows.py), the prefix cache over the host block pool (prefix_cache.py, block_pool.py), the
loads from the tiers below it (loads.py) and, here, what joins them: a sequence taking a row
(its prefix hit or its swapped-out KV copied in) or leaving one, and preemption, which swaps a
whole row out to the pool when running sequences outgrow the budget.

KVManager stays as a facade rather than the scheduler holding the three parts: placing,
preempting and releasing a sequence each touch all of them, in an order that is the manager's
to keep (references taken before copies, released after).
"""
from __future__ import annotations

from functools import partial

from runtime.kv.block_pool import HostBlockPool
from runtime.kv.loads import TierLoads
from runtime.kv.prefix_cache import PrefixCache
from runtime.kv.rows import PackedRows
from runtime.kv.tiers.lower import LowerTiers
from runtime.runners.base import Runner
from runtime.sequence import Sequence

SWAP_RESERVE = 0.5  # share of the host pool that swapped-out rows may take; beyond it, preempt by recompute


class KVManager:
    """Not thread-safe: the scheduler calls it under the engine's lock."""

    def __init__(self, runner: Runner, slots: int, kv_cache_bytes: int, pool: HostBlockPool | None,
                 namespace: bytes, tiers: LowerTiers | None = None, optimistic: bool = False):
        self.pool = pool
        self.rows = PackedRows(runner, slots, kv_cache_bytes, optimistic)
        if pool is not None:  # what one admission wave can bring in lands in mapped pages
            pool.map_ahead(self.rows.reserved_bytes)
        self.prefix = PrefixCache(pool, namespace, self.rows, tiers)
        self.loads = TierLoads(self.prefix, tiers)
        self.tiers = tiers
        self.block_tokens = runner.block.tokens
        self.swapped_blocks = 0  # pool blocks holding swapped-out rows, within SWAP_RESERVE of the pool
        # pool blocks that copies decided this schedule may still read (a prefix or a swapped-out
        # row copied in): released once they ran, as a tier load takes free blocks from its own
        # thread at any time
        self.after_copies: list[int] = []

    def place(self, seq: Sequence, hit: list[int]) -> None:
        """seq takes a row: a preempted one with its swapped-out KV, a new one with its prefix hit."""
        row = self.rows.place(seq)
        if seq.swapped_blocks is not None:
            self.swap_in(seq, row, seq.swapped_blocks)
            seq.swapped_blocks = None
        else:
            self.prefix.admit(seq, row, hit)
        self.loads.drop(seq)

    def preempt(self, seq: Sequence, recompute: bool = False) -> None:
        """seq leaves the batch for now: its row goes to pool blocks (seq.swapped_blocks; None when
        the swap reserve is used up, there is no pool or `recompute` asks: seq will be recomputed
        from its tokens), and the rows left are refitted to the budget. Requests waiting for
        blocks it announced compute them themselves."""
        row = self.rows.running.index(seq)
        self.prefix.withdraw(seq)
        blocks = -(-seq.num_cached // self.block_tokens)
        seq.swapped_blocks = None
        if not recompute and self.pool is not None and \
                self.swapped_blocks + blocks <= SWAP_RESERVE * self.pool.num_blocks:
            seq.swapped_blocks = self.swap_out(seq, row)
        if seq.swapped_blocks is None:
            self.prefix.release(seq)
            seq.num_stored_blocks, seq.num_cached, seq.stores_blocks = 0, 0, True
        else:
            self.swapped_blocks += len(seq.swapped_blocks)
        self.rows.remove(row)
        self.rows.refit()

    def swap_out(self, seq: Sequence, row: int) -> list[int] | None:
        """Copy row's cached tokens, partial last block included, to anonymous pool blocks (one
        reference each, held by the caller); None if the pool cannot hold them."""
        blocks = -(-seq.num_cached // self.block_tokens)
        ids = self.pool.anonymous(blocks) if self.pool is not None else None
        if ids is not None:
            self.rows.copy_out(row, blocks, partial(self.pool.write, ids))
        return ids

    def swap_in(self, seq: Sequence, row: int, blocks: list[int]) -> None:
        """Copy a swapped-out row back into row `row`; its blocks are freed once the copy has run."""
        self.rows.fit_capacity(seq.num_cached + 1)
        self.rows.copy_in(row, self.pool.runs(blocks))
        self.after_copies += blocks
        self.swapped_blocks = max(0, self.swapped_blocks - len(blocks))

    def copies_done(self) -> None:
        """The copies decided so far have run, or the ones left read no pool block (a step's
        postprocess: rows moved and shrunk)."""
        if self.after_copies:
            self.pool.release(self.after_copies)
            self.after_copies = []

    def release(self, seq: Sequence) -> None:
        """seq left (finished, cancelled, expired; running or not): its references go, its
        announced blocks are no longer coming. Its cached blocks are released after the copies
        (it may have been admitted, its prefix copy still to run, in this same schedule)."""
        self.after_copies += seq.pool_blocks[::-1]  # tail first: evicted first
        seq.pool_blocks = []
        if self.pool is not None and seq.swapped_blocks is not None:  # cancelled while preempted
            self.pool.release(seq.swapped_blocks)
            self.swapped_blocks -= len(seq.swapped_blocks)
        seq.swapped_blocks = None
        self.loads.drop(seq)
        self.prefix.withdraw(seq)

    def stats(self) -> dict:
        pool = self.pool
        tiers = self.tiers.stats() if self.tiers is not None else LowerTiers.no_stats()
        return dict(**self.rows.stats(), **self.prefix.counters,
                    kv_host_pool_bytes=pool.bytes_used if pool else 0,
                    kv_host_pool_budget_bytes=pool.budget_bytes if pool else 0,
                    kv_host_pool_blocks=pool.num_blocks if pool else 0,
                    **(pool.counters if pool else dict(blocks_evicted=0, blocks_stored=0, blocks_deduplicated=0,
                                                       blocks_dropped=0)), **tiers)
