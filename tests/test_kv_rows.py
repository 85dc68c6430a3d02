"""The packed rows (runtime/kv/rows.py) over the arithmetic stand-in runner
(tests/arithmetic_runner.py: the real runner's KV buffers and copies, no graph): runner row i
holds running[i], prompt rows before decoding rows, every sequence's KV follows it through
placements, removals, rotations and resizes, and the copies wait for the engine. Milliseconds."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from kvforge.manifest import kv_block_spec, slot_bytes
from runtime.kv.manager import KVManager
from runtime.runners.base import Batch
from runtime.sampling import SamplingParams
from runtime.sequence import Sequence
from tests.arithmetic_runner import ArithmeticRunner, kv_of, tiny_manifest

ROOT = Path(__file__).resolve().parents[1]


def sequence(request_id: int, prompt: int, max_tokens: int = 16) -> Sequence:
    tokens = ((np.arange(prompt) * 7 + request_id * 31) % 250 + 3).tolist()
    return Sequence(request_id, tokens, SamplingParams(max_tokens=max_tokens), print, None, frozenset())


def manager(slots: int = 8, kv_cache_bytes: int = 1 << 30, **options) -> KVManager:
    return KVManager(ArithmeticRunner(), slots, kv_cache_bytes, None, b"", **options)


def feed(kv: KVManager, counts: list[int]) -> None:
    """One step as the engine runs it: the copies decided so far, then counts[i] tokens into row i."""
    running = kv.rows.running
    kv.rows.fit_capacity(max(s.num_cached for s in running) + max(counts))  # every row gets the step's width
    kv.rows.take_copies().run()
    batch = Batch.of("prefill", running, max(counts), counts)
    kv.rows.runner.step(batch.input_ids, batch.write_positions, batch.num_new)
    for seq, n in zip(running, counts):
        seq.num_cached += n


def prefilled(kv: KVManager, seq: Sequence) -> Sequence:
    """seq placed, its whole prompt cached and one token sampled: a decoding row."""
    kv.place(seq, [])
    feed(kv, [seq.pending if s is seq else 0 for s in kv.rows.running])
    seq.tokens.append(5)
    return seq


def assert_rows_hold_their_kv(kv: KVManager) -> None:
    kv.rows.take_copies().run()
    for row, seq in enumerate(kv.rows.running):
        held = kv.rows.runner.row_kv(row, seq.num_cached)
        assert np.array_equal(held, kv_of(seq.tokens[:seq.num_cached], 0)), (row, seq.request_id)


def test_a_new_prompt_goes_before_the_decoding_rows_and_the_one_there_moves_with_its_kv():
    kv = manager()
    a, b = prefilled(kv, sequence(1, 40)), prefilled(kv, sequence(2, 30))
    assert kv.rows.running == (b, a)  # b was a prompt when it came: in front of decoding a
    c = sequence(3, 20)
    kv.place(c, [])
    assert kv.rows.running == (c, a, b)  # c took row 0; b, there before, moved to a new last row
    assert_rows_hold_their_kv(kv)


def test_a_leaving_row_is_filled_by_the_last_row_with_its_kv():
    kv = manager()
    for i in range(4):
        prefilled(kv, sequence(i, 20 + 10 * i))
    before = kv.rows.running
    assert kv.rows.remove(1) is before[1]
    assert kv.rows.running == (before[0], before[3], before[2])
    assert_rows_hold_their_kv(kv)


@pytest.mark.parametrize("parked", [1, 2, 3])
def test_a_decoding_row_rotates_behind_the_prompts_with_its_kv(parked):
    """Rows [prompt, decoding, prompt, prompt, decoding] (two prompts that finished prefilling
    ahead of newer ones): rows 1..3 rotate to [prompt, prompt, decoding] through the spare row,
    which holds whichever of them has the least KV (each case parks another one)."""
    kv = manager()
    running = [sequence(row, 40) for row in range(5)]
    for seq in running:
        kv.place(seq, [])  # all prompts yet: they keep their order
    feed(kv, [5 if row == parked else 30 + row for row in range(5)])
    for row in (1, 4):  # these finish their prompts and decode
        seq = running[row]
        feed(kv, [seq.pending if s is seq else 0 for s in running])
        seq.tokens.append(5)
    assert kv.rows.running == tuple(running)
    kv.rows.prompts_first()
    assert [s.request_id for s in kv.rows.running] == [0, 2, 3, 1, 4]
    assert kv.rows.counters["row_moves"] == 1
    assert_rows_hold_their_kv(kv)


def test_the_copies_wait_for_the_engine():
    """The rows decide (layout, moves) at once; the runner changes only when the copies run."""
    kv = manager()
    a = prefilled(kv, sequence(1, 40))
    capacity = kv.rows.runner.capacity
    kv.place(sequence(2, 300), [])
    kv.rows.fit_capacity(301)
    assert (kv.rows.capacity, kv.rows.allocated) == (320, 2) and kv.rows.runner.capacity == capacity
    with pytest.raises(RuntimeError, match="copies decided before"):
        kv.rows.read(1, 0, 1)  # a row read before its moves ran would be stale
    copies = kv.rows.take_copies()
    assert copies and not kv.rows.take_copies()
    copies.run()
    assert (kv.rows.runner.capacity, kv.rows.runner.slots) == (320, 2)
    assert kv.rows.running[1] is a
    assert_rows_hold_their_kv(kv)


def test_resizes_keep_every_row_and_stay_within_the_budget():
    per_row = slot_bytes(ArithmeticRunner().manifest.cache_tensors, 512)
    kv = manager(kv_cache_bytes=4 * per_row)
    seqs = [prefilled(kv, sequence(i, 30 + i)) for i in range(3)]
    assert (kv.rows.allocated, kv.rows.capacity) == (4, 64)
    long = sequence(9, 200, max_tokens=100)
    kv.place(long, [])
    kv.rows.fit_capacity(201, ahead=kv.rows.ends())  # grows at once to where the prompt will end
    assert kv.rows.capacity == kv.rows.runner.bucket_for(202)
    feed(kv, [long.pending if s is long else 0 for s in kv.rows.running])
    assert_rows_hold_their_kv(kv)
    assert kv.rows.runner.kv_bytes_allocated == kv.rows.allocated * slot_bytes(kv.rows.tensors, kv.rows.capacity)
    assert kv.rows.runner.kv_bytes_allocated <= 4 * per_row
    kv.rows.remove(kv.rows.running.index(long))
    kv.rows.shrink()
    assert_rows_hold_their_kv(kv)
    assert kv.rows.runner.capacity == 64 and kv.rows.runner.slots == 4  # rows kept for the next ones
    for seq in seqs:
        kv.rows.remove(kv.rows.running.index(seq))
    kv.rows.shrink()
    kv.rows.take_copies().run()
    assert (kv.rows.runner.slots, kv.rows.runner.capacity) == (1, 64)


def test_a_row_joining_after_a_wide_step_stays_within_the_budget():
    """A prompt's chunk widened every row's capacity (the in-place scatter): one more row at that
    capacity would pass the budget, so the capacity drops back to what the rows hold first. (A
    fresh-clone run's engine once held 1.25x its kv_cache_bytes this way.)"""
    budget = 2 * slot_bytes(ArithmeticRunner().manifest.cache_tensors, 224)
    kv = manager(kv_cache_bytes=budget)
    a = prefilled(kv, sequence(1, 100))
    b = sequence(2, 100)
    kv.place(b, [])
    feed(kv, [0 if s is a else 100 for s in kv.rows.running])  # a's row takes the chunk's width too
    kv.rows.take_copies().run()
    assert kv.rows.capacity >= 200 and 3 * slot_bytes(kv.rows.tensors, kv.rows.capacity) > budget
    b.tokens.append(5)
    c = sequence(3, 10)
    assert kv.rows.can_admit(c)  # three promises of 116 tokens fit
    kv.place(c, [])
    kv.rows.take_copies().run()
    assert kv.rows.runner.kv_bytes_allocated <= budget and kv.rows.runner.slots >= 3
    feed(kv, [c.pending if s is c else 0 for s in kv.rows.running])
    assert kv.rows.runner.kv_bytes_allocated <= budget
    assert_rows_hold_their_kv(kv)


def test_admission_counts_the_bytes_of_every_cache_tensor():
    """Reserving: each sequence's promise at its capacity bucket, rows a power of two, within
    the budget; the bytes are the manifest's per-tensor sizes, which the runner's buffers match."""
    tensors = ArithmeticRunner().manifest.cache_tensors
    kv = manager(kv_cache_bytes=2 * slot_bytes(tensors, 128))
    a, b, c = (sequence(i, 60, max_tokens=40) for i in range(3))  # promise 100 tokens: bucket 112
    assert kv.rows.can_admit(a)
    kv.place(a, [])
    assert kv.rows.can_admit(b)
    kv.place(b, [])
    assert not kv.rows.can_admit(c)  # 4 rows of 112 positions exceed two of 128
    assert kv.rows.fits_ever(c) and not kv.rows.fits_ever(sequence(4, 200, max_tokens=100))
    optimistic = manager(kv_cache_bytes=2 * slot_bytes(tensors, 128), optimistic=True)
    for seq in (sequence(i, 60, max_tokens=40) for i in range(3)):
        assert optimistic.rows.can_admit(seq)  # what they hold now: 60 tokens, bucket 64
        optimistic.place(seq, [])


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8", "int4"])
def test_sizes_come_from_the_manifest_per_cache_tensor(kv_dtype):
    """Every tensor holds max_seq_len positions today, so the aggregates are the sums they were;
    a tensor that holds fewer (a sliding-window layer) changes what a slot costs, nothing else."""
    manifest = tiny_manifest(kv_dtype=kv_dtype)
    tensors = manifest.cache_tensors
    assert all(t.tokens == manifest.max_seq_len for t in tensors)
    assert len(tensors) == 2 * (4 if kv_dtype != "fp32" else 2)  # key, value (and their scales) per layer
    assert manifest.kv_bytes_per_token == sum(t.bytes_per_token for t in tensors)
    assert kv_block_spec(manifest).bytes_per_block == 16 * manifest.kv_bytes_per_token
    assert slot_bytes(tensors, 256) == 256 * manifest.kv_bytes_per_token
    windowed = tuple(dataclasses.replace(t, tokens=64) if t.name.startswith("past_key_values.1.") else t
                     for t in tensors)
    per_layer = manifest.kv_bytes_per_token // 2
    assert slot_bytes(windowed, 256) == 256 * per_layer + 64 * per_layer


def test_only_the_packed_rows_resize_move_or_write_into_the_runner():
    """runtime/kv/rows.py is the one caller of runner.resize / move / write_blocks in runtime/."""
    call = re.compile(r"runner\.(resize|move|write_blocks)\b")
    callers = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "runtime").rglob("*.py")
                     if call.search(path.read_text()))
    assert callers == ["runtime/kv/rows.py"]
