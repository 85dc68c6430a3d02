"""The prefix cache (runtime/kv/prefix_cache.py) and swapping (runtime/kv/manager.py) over the
host block pool and the arithmetic stand-in runner (tests/arithmetic_runner.py): what a hit
copies into a row is exactly what computing it wrote, a request waits for blocks a running
sequence is computing, salts keep prefixes apart, and a swapped-out row comes back whole, read
after the moves decided before it. Milliseconds; the real-export tests check that the engine
decodes the same with a hit (tests/test_prefix_cache.py)."""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

from runtime.kv.block_pool import HostBlockPool
from runtime.kv.manager import KVManager
from tests.arithmetic_runner import ArithmeticRunner, kv_of
from tests.waiting import wait_for
from tests.test_kv_rows import assert_rows_hold_their_kv, feed, prefilled, sequence

NAMESPACE = b"test-namespace"


def manager(pool_blocks: int = 64) -> KVManager:
    runner = ArithmeticRunner()
    pool = HostBlockPool(runner.block, pool_blocks * runner.block.bytes_per_block)
    return KVManager(runner, 8, 1 << 30, pool, NAMESPACE)


def stored(kv: KVManager, seq) -> None:
    """seq's filled blocks go to the pool, as postprocess does after a step."""
    kv.prefix.store(seq, kv.rows.running.index(seq))


def test_a_stored_prefix_is_copied_into_the_next_row_as_computed():
    kv = manager()
    a = prefilled(kv, sequence(1, 50))
    stored(kv, a)
    assert a.num_stored_blocks == 3 and kv.pool.bytes_used == 3 * kv.pool.spec.bytes_per_block
    b = sequence(2, 60)
    b.prompt_ids[:48] = b.tokens[:48] = a.tokens[:48]  # the same 3 blocks, then another tail
    hit, wait = kv.prefix.match(b)
    assert len(hit) == 3 and not wait
    kv.place(b, hit)
    assert (b.num_cached, b.cached_tokens) == (48, 48) and b.pool_blocks == hit
    assert_rows_hold_their_kv(kv)  # row 0 (b) holds a's K/V of positions 0..47
    counters = kv.prefix.counters
    assert (counters["prefix_cache_hit_tokens"], counters["copy_in_blocks"]) == (48, 3)
    assert counters["prefix_cache_queried_tokens"] == 50 + 60


def test_the_last_prompt_token_is_never_a_hit():
    kv = manager()
    a = prefilled(kv, sequence(1, 48))
    stored(kv, a)  # 3 full blocks
    again = sequence(2, 48)
    again.prompt_ids[:] = again.tokens[:] = a.tokens[:48]
    assert len(kv.prefix.match(again)[0]) == 2  # its last token's logits are needed: block 3 is recomputed


def test_a_request_waits_for_blocks_a_running_sequence_is_computing():
    kv = manager()
    other = prefilled(kv, sequence(9, 20))
    a = sequence(1, 70)
    kv.place(a, [])
    b = sequence(2, 70)
    b.prompt_ids[:] = b.tokens[:] = a.tokens
    assert kv.prefix.match(b) == ([], True)
    feed(kv, [40 if s is a else 0 for s in kv.rows.running])
    stored(kv, a)  # 2 blocks in, the 3rd still being computed
    hit, wait = kv.prefix.match(b)
    assert len(hit) == 2 and wait
    kv.preempt(a)  # a will not compute it now: b goes on without waiting
    assert kv.prefix.match(b)[1] is False and kv.rows.running == (other,)


def test_a_salt_keeps_prefixes_apart():
    kv = manager()
    a = prefilled(kv, sequence(1, 50))
    stored(kv, a)
    salted = sequence(2, 50)
    salted.prompt_ids[:] = salted.tokens[:] = a.tokens[:50]
    salted.cache_salt = b"tenant"
    assert kv.prefix.match(salted) == ([], False)


def test_a_preempted_row_swaps_out_after_the_moves_before_it_and_comes_back_whole():
    """Row 0 leaves (the last row, c, moves into it: a pending copy), then c is preempted: its
    swap-out reads row 0 after the move. c's partial last block comes back too."""
    kv = manager()
    for i in range(3):
        prefilled(kv, sequence(i, 37 + i))
    first, kept, c = kv.rows.running
    kv.release(kv.rows.remove(0))
    assert kv.rows.running == (c, kept)
    kv.preempt(c)
    assert c.swapped_blocks is not None and len(c.swapped_blocks) == -(-c.num_cached // 16) == 3
    assert kv.rows.running == (kept,)
    kv.rows.take_copies().run()
    d = prefilled(kv, sequence(7, 45))  # takes c's old row and overwrites it
    kv.place(c, [])
    assert c.swapped_blocks is None and kv.swapped_blocks == 0
    assert sorted(s.request_id for s in kv.rows.running) == sorted([kept.request_id, d.request_id, c.request_id])
    assert_rows_hold_their_kv(kv)
    assert kv.pool.bytes_used == 3 * kv.pool.spec.bytes_per_block  # held until the copy back has run
    kv.copies_done()
    assert kv.pool.bytes_used == 0  # anonymous blocks go straight back to the free list


def test_released_blocks_stay_cached_and_go_tail_first():
    kv = manager(pool_blocks=4)
    a = prefilled(kv, sequence(1, 50))
    stored(kv, a)
    blocks = list(a.pool_blocks)
    head, tail = blocks[0], blocks[-1]
    kv.release(kv.rows.remove(0))
    kv.copies_done()
    assert list(kv.pool.evictable) == blocks[::-1]  # unreferenced, still cached; the tail leaves first
    b = prefilled(kv, sequence(2, 40))
    stored(kv, b)  # 2 new blocks: the free one, then a's tail is evicted first
    assert kv.pool.counters["blocks_evicted"] == 1 and tail not in kv.pool.evictable and head in kv.pool.evictable
    np.testing.assert_array_equal(kv.rows.runner.row_kv(0, 40), kv_of(b.tokens[:40], 0))


def resident_blocks(pool: HostBlockPool) -> int:
    """How many leading blocks have every page of every array resident (mincore(2) on their
    exact range: /proc's per-mapping counts merge neighbouring allocations)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page, blocks = mmap.PAGESIZE, pool.num_blocks
    for array in pool.arrays.values():
        start = array.ctypes.data // page * page
        pages = -(-(array.ctypes.data + array.nbytes - start) // page)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(start, pages * page, vec) == 0, ctypes.get_errno()
        first_out = next((i for i, v in enumerate(vec) if not v & 1), pages)
        blocks = min(blocks, (start + first_out * page - array.ctypes.data) // (array.nbytes // pool.num_blocks))
    return blocks


def test_the_pool_maps_its_next_blocks_ahead_of_use():
    """map_ahead keeps about that many bytes of never-used blocks resident (mapped in the
    background, contents untouched), topped up as blocks are handed out, never the whole pool."""
    spec = ArithmeticRunner().block
    # 64 MiB an array: past glibc's largest mmap threshold (32 MiB), so its pages start unmapped
    # whatever this process allocated and freed before
    pool = HostBlockPool(spec, 65536 * spec.bytes_per_block)
    assert resident_blocks(pool) < 8
    pool.map_ahead(1024 * spec.bytes_per_block)
    wait_for(pool.populated.is_set, "the pool's first blocks")
    assert pool.mapped == 1024 and 1024 - 8 <= resident_blocks(pool) < 2048
    pool.anonymous(600)  # past half the margin: the next ones are mapped
    wait_for(pool.populated.is_set, "the pool's next blocks")
    assert pool.mapped - 600 >= 1024 // 2 and pool.mapped - 8 <= resident_blocks(pool) < pool.num_blocks // 2
    assert not any(a.any() for a in pool.arrays.values())


def test_blocks_a_load_filled_are_named_and_a_block_cached_meanwhile_is_shared():
    kv = manager(pool_blocks=8)
    pool = kv.pool
    loaded = pool.anonymous(3, partial=True)
    for i, b in enumerate(loaded):
        for array in pool.block(b).values():
            array[...] = i
    meanwhile = pool.put({name: array[None] + 7 for name, array in pool.block(loaded[1]).items()}, [b"h1"])
    ids = pool.named(loaded[:2], [b"h0", b"h1"])
    pool.release(loaded[2:])  # taken, never filled
    assert ids == [loaded[0], meanwhile[0]] and pool.lookup([b"h0", b"h1"]) == ids
    assert pool.refs[meanwhile[0]] == 2 and pool.refs[loaded[1]] == 0 and pool.refs[loaded[2]] == 0
    assert pool.anonymous(100, partial=True) is not None and len(pool.free) == 0
