"""KV bookkeeping in blocks of KV_BLOCK_TOKENS tokens: admission control and utilization.

A sequence is admitted only when a slot is free and the blocks for its whole budget
(prompt + max_tokens) can be promised, so a running sequence never runs out of KV and nothing
ever needs preempting. Block ids are handed out as tokens are written: the block table is what
a paged cache (and prefix reuse) will index by; the bucketed in-place runner only needs the counts.
"""
from __future__ import annotations

from kvforge.manifest import kv_blocks
from runtime.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, num_slots: int):
        self.num_blocks = num_blocks
        self.num_slots = num_slots
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.reserved = 0  # blocks promised to admitted sequences
        self.used_slots = 0

    def fits_ever(self, seq: Sequence) -> bool:
        return kv_blocks(seq.max_tokens_total) <= self.num_blocks

    def can_admit(self, seq: Sequence) -> bool:
        return (self.used_slots < self.num_slots
                and self.reserved + kv_blocks(seq.max_tokens_total) <= self.num_blocks)

    def admit(self, seq: Sequence) -> None:
        seq.reserved_blocks = kv_blocks(seq.max_tokens_total)
        self.reserved += seq.reserved_blocks
        self.used_slots += 1

    def grow(self, seq: Sequence, tokens: int) -> None:
        """Give seq's block table enough blocks for `tokens` cached tokens (within its promise)."""
        while len(seq.block_table) < min(kv_blocks(tokens), seq.reserved_blocks):
            seq.block_table.append(self.free_blocks.pop())

    def release(self, seq: Sequence) -> None:
        self.free_blocks.extend(reversed(seq.block_table))
        seq.block_table = []
        self.reserved -= seq.reserved_blocks
        seq.reserved_blocks = 0
        self.used_slots -= 1

    @property
    def utilization(self) -> float:
        """Share of the KV blocks holding cached tokens."""
        return (self.num_blocks - len(self.free_blocks)) / self.num_blocks
