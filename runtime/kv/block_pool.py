"""The host RAM pool of KV blocks (automatic prefix caching), named by kvforge.block_hash.

A block is KV_BLOCK_TOKENS positions of every cache tensor, exactly as a slot holds them
(int8/int4 scales included; kvforge.manifest.KVBlockSpec, each tensor sized by its
CacheTensor). Block ids are rows of per-tensor host arrays sized by `--kv-host-bytes`. A running
sequence holds a reference on the blocks it loaded or stored; blocks nobody references stay
cached and are evicted least recently released first (a sequence releases its tail first, so a
shared head outlives the tails). Identical blocks are stored once.

Pages are mapped ahead of use (map_ahead, runtime/pages.py): a block handed out for the first time
is written by a store or straight by a tier load (runtime/kv/tiers/lower.py), and a page first
touched there cost a restarted engine most of its load time (a 16K-token load from page-cached
disk ran at 0.3 GB/s into fresh pages, 12 GB/s into mapped ones).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from kvforge.manifest import KVBlockSpec
from runtime.pages import populate
from runtime.runners.base import Blocks

# Default pool budget: a quarter of the machine's RAM, at most 8 GiB (pages are committed as
# blocks are stored, and a margin ahead of them: map_ahead).
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
        # The free list hands out never-used ids in order, so blocks 0..touched-1 are the ones ever
        # written; blocks 0..mapped-1 have their pages mapped, `ahead` more than touched once asked.
        self.touched = self.mapped = self.ahead = 0
        self.populated = threading.Event()  # set while no mapping runs
        self.populated.set()

    def map_ahead(self, nbytes: int) -> None:
        """From now on keep about nbytes of blocks mapped past the ones ever handed out, by a
        background thread, topped up when half of it is used."""
        self.ahead = min(self.num_blocks, -(-nbytes // self.spec.bytes_per_block))
        self._map()

    def _map(self) -> None:
        if not self.ahead or not self.populated.is_set() or self.mapped - self.touched >= self.ahead // 2:
            return
        end = min(self.num_blocks, self.touched + self.ahead)
        if end > self.mapped:
            self.populated.clear()
            threading.Thread(target=self._populate, args=(self.mapped, end), name="kvforge-pool-populate",
                             daemon=True).start()

    def _populate(self, begin: int, end: int) -> None:
        try:
            for array in self.arrays.values():
                row = array.nbytes // self.num_blocks
                if not populate(array, begin * row, end * row):
                    self.ahead = 0  # the kernel cannot: pages come at their first write
                    return
            self.mapped = end
        finally:
            self.populated.set()

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
            block = self.free.pop()
            if block >= self.touched:
                self.touched = block + 1
                self._map()
            return block
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
            block = self._shared(h)
            if block is not None:
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

    def _shared(self, h: bytes | None) -> int | None:
        """The block cached under h, with a reference more for the caller; None if there is none."""
        block = self.by_hash.get(h) if h is not None else None
        if block is not None:
            self.counters["blocks_deduplicated"] += 1
            self.acquire([block])
        return block

    def anonymous(self, n: int, partial: bool = False) -> list[int] | None:
        """n blocks without a hash (a swapped-out row, a tier load), one reference each held by the
        caller, their contents written later (write, or in place through block); None if fewer
        than n can be taken (partial: as many as can)."""
        available = len(self.free) + len(self.evictable)
        if available < n and not partial:
            return None
        ids = [self._take() for _ in range(min(n, available))]
        self.refs[ids] = 1
        return ids

    def named(self, blocks: list[int], hashes: list[bytes]) -> list[int]:
        """Cache anonymous blocks filled in place (a tier load's) under their hashes; a hash cached
        meanwhile is shared instead, and its block freed. The caller holds one reference on each
        returned id."""
        ids = []
        for block, h in zip(blocks, hashes):
            cached = self._shared(h)
            if cached is not None:
                self.release([block])
                ids.append(cached)
                continue
            self.by_hash[h], self.hash_of[block] = block, h
            self.counters["blocks_stored"] += 1
            ids.append(block)
        return ids

    def block(self, block: int) -> Blocks:
        """Views of one block: name -> [kv_heads, block_tokens, D], to be written in place."""
        return {name: array[block] for name, array in self.arrays.items()}

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

    def close(self) -> None:
        """Give the storage back (the engine has stopped). A process that starts engine after engine
        (tests, benchmarks) would otherwise keep every pool's mapped margin until a garbage
        collection breaks the engine's reference cycles: a long-context benchmark's fourth engine
        in one process was killed for memory."""
        self.populated.wait()
        self.arrays = {}

    def clear(self) -> int:
        """Forget every cached block; referenced ones stay until released. Returns how many were dropped."""
        dropped = len(self.by_hash)
        for block in list(self.hash_of):
            del self.by_hash[self.hash_of.pop(block)]
        self.free.extend(self.evictable)
        self.evictable.clear()
        return dropped
