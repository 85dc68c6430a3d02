"""The host RAM pool of KV blocks (automatic prefix caching), named by kvforge.block_hash.

A block is KV_BLOCK_TOKENS positions of every cache tensor, exactly as a slot holds them
(int8/int4 scales included; kvforge.manifest.KVBlockSpec, each tensor sized by its
CacheTensor). Block ids are rows of per-tensor host arrays sized by `--kv-host-bytes`. A running
sequence holds a reference on the blocks it loaded or stored; blocks nobody references stay
cached and are evicted least recently released first (a sequence releases its tail first, so a
shared head outlives the tails). Identical blocks are stored once.
"""
from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np

from kvforge.manifest import KVBlockSpec
from runtime.runners.base import Blocks

# Default pool budget: a quarter of the machine's RAM, at most 8 GiB (pages are committed only
# as blocks are stored).
DEFAULT_HOST_FRACTION, DEFAULT_HOST_CAP = 4, 8 << 30


def default_kv_host_bytes() -> int:
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return min(DEFAULT_HOST_CAP, ram // DEFAULT_HOST_FRACTION)


class HostBlockPool:
    """Fixed storage for `budget_bytes // bytes_per_block` blocks; block id = row of every array."""

    def __init__(self, spec: KVBlockSpec, budget_bytes: int):
        self.spec = spec
        self.budget_bytes = budget_bytes
        self.num_blocks = budget_bytes // spec.bytes_per_block
        # np.zeros maps pages lazily: the budget is a bound, not memory taken up front
        self.arrays = {t.name: np.zeros((self.num_blocks, *t.block_shape(spec.tokens)), t.dtype)
                       for t in spec.tensors}
        self.free = list(range(self.num_blocks - 1, -1, -1))
        self.refs = np.zeros(self.num_blocks, np.int32)
        self.by_hash: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self.on_evict = None  # (hash, read the block) -> None: the disk tier keeps what RAM lets go
        self.counters = dict(blocks_evicted=0, blocks_stored=0, blocks_deduplicated=0, blocks_dropped=0)

    @property
    def bytes_used(self) -> int:
        return (self.num_blocks - len(self.free)) * self.spec.bytes_per_block

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """Ids of the longest run of hashes[0..] that is cached."""
        found = []
        for h in hashes:
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def acquire(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1
            self.evictable.pop(b, None)

    def release(self, blocks: list[int]) -> None:
        """Drop one reference each, in the given order (the first released is the first evicted)."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def _take(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.evictable:
            return None
        block, _ = self.evictable.popitem(last=False)
        if self.on_evict is not None:
            self.on_evict(self.hash_of[block], lambda: {name: array[block] for name, array in self.arrays.items()})
        del self.by_hash[self.hash_of.pop(block)]
        self.counters["blocks_evicted"] += 1
        return block

    def put(self, data: Blocks, hashes: list[bytes | None]) -> list[int]:
        """Store blocks (hash None: anonymous, e.g. a swapped-out row), one reference each held by
        the caller; `data` may hold a list of per-block arrays per tensor (no stacked copy). A
        block already cached under its hash is shared, not copied. Returns the ids of the leading
        blocks that could be kept (storage full of referenced blocks: fewer)."""
        ids = []
        for i, h in enumerate(hashes):
            block = self.by_hash.get(h) if h is not None else None
            if block is not None:
                self.counters["blocks_deduplicated"] += 1
                self.acquire([block])
                ids.append(block)
                continue
            block = self._take()
            if block is None:
                self.counters["blocks_dropped"] += len(hashes) - i
                break
            for name, array in self.arrays.items():
                array[block] = data[name][i]
            self.refs[block] = 1
            if h is not None:
                self.by_hash[h], self.hash_of[block] = block, h
                self.counters["blocks_stored"] += 1
            ids.append(block)
        return ids

    def anonymous(self, n: int) -> list[int] | None:
        """n blocks without a hash (a swapped-out row), one reference each held by the caller, their
        contents written later (write); None if fewer than n can be taken."""
        if len(self.free) + len(self.evictable) < n:
            return None
        ids = [self._take() for _ in range(n)]
        self.refs[ids] = 1
        return ids

    def write(self, blocks: list[int], data: Blocks) -> None:
        """Fill `blocks` with data[name][i] each (read_blocks-shaped)."""
        for name, array in self.arrays.items():
            array[blocks] = data[name]

    def runs(self, blocks: list[int]) -> list[tuple[int, Blocks]]:
        """`blocks` as views of the pool, one per run of consecutive ids: (index of the run's first
        block in `blocks`, its views). Copying a prefix into a slot through them stages nothing: a
        2K-token prefix staged through get() and as_tokens was two fresh 31 MB arrays, and pages
        touched for the first time cost ~1 ms per MB on this VM (more beside busy cores)."""
        starts = []  # [index in blocks, first id, length]
        for i, block in enumerate(blocks):
            if starts and starts[-1][1] + starts[-1][2] == block:
                starts[-1][2] += 1
            else:
                starts.append([i, block, 1])
        return [(i, {name: array[block:block + n] for name, array in self.arrays.items()}) for i, block, n in starts]

    def get(self, blocks: list[int]) -> Blocks:
        return {name: array[blocks] for name, array in self.arrays.items()}

    def clear(self) -> int:
        """Forget every cached block; referenced ones stay until released. Returns how many were dropped."""
        dropped = len(self.by_hash)
        for block in list(self.hash_of):
            del self.by_hash[self.hash_of.pop(block)]
        self.free.extend(self.evictable)
        self.evictable.clear()
        return dropped
