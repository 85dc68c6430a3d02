"""The ONNX Runtime runners.

- OrtInplaceRunner: fixed-capacity buffers, the same memory bound as past input and present
  output through IOBinding, so ONNX Runtime's TensorScatter writes the new K/V in place.
  Capacity lives in buckets, 4 per power of two (attention cost follows capacity on ORT CPU).
- OrtConcatRunner: the Optimum-style layout, present = concat(past, new), for comparison.

The interface they share is runtime/runners/base.py.
"""
from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np

from kvforge.engine_config import DEFAULT_SPIN_US, read_variable
from kvforge.manifest import CacheTensor, Manifest, ManifestError
from runtime.pages import populate
from runtime.runners.base import Blocks, Runner, as_blocks, as_tokens, pack_step

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8}


def session_options(threads: int | None = None, spin_us: int | None = None):
    """threads and spin_us: the engine's settings (kvforge/engine_config.py); None: $KVFORGE_THREADS
    and $KVFORGE_SPIN_US as a served engine's process has them, else every core and DEFAULT_SPIN_US."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or read_variable("threads") or (os.cpu_count() or 1)
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    spin_us = read_variable("spin_us") if spin_us is None else spin_us
    spin_us = DEFAULT_SPIN_US if spin_us is None else spin_us
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin_us else "0")
    if spin_us:
        opts.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    return opts


class _OrtRunner(Runner):
    def __init__(self, manifest: Manifest, onnx_path: Path, threads: int | None = None, spin_us: int | None = None):
        super().__init__(manifest)
        import onnxruntime as ort

        if "onnxruntime" not in manifest.kv.runs_on:
            raise ManifestError(
                f"KV dtype {manifest.kv_dtype} cannot run on ONNX Runtime ({manifest.kv.note})")
        try:
            self.session = ort.InferenceSession(str(onnx_path), session_options(threads, spin_us),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for unreadable models
            raise ManifestError(f"cannot load engine {onnx_path}: {str(e).splitlines()[0][:300]}") from None
        # what the session runs, not what was asked: the served engine reports it (kvforge_engine_threads)
        self.threads = self.session.get_session_options().intra_op_num_threads

    def _buffer(self, past_name: str, rows: int, length: int) -> np.ndarray:
        """A zeroed buffer [rows, heads, length, width] for a cache tensor."""
        t = self.cache[past_name]
        return np.zeros((rows, t.heads, length, t.width), NUMPY_DTYPES[t.dtype])

    def _slot_buffer(self, past_name: str, rows: int, capacity: int) -> np.ndarray:
        """A buffer of what a slot of `capacity` holds of the tensor: a ring all its cells."""
        return self._buffer(past_name, rows, self.cache[past_name].held(capacity))


def reserved_positions(tensors: tuple[CacheTensor, ...], nbytes: int, slots: int) -> dict[str, int]:
    """Per cache tensor, the most positions any layout of at most `slots` slots within `nbytes`
    puts in it. A tensor holding every position: s slots x the widest capacity s slots leave room
    for. A ring: s x its cells at the most slots that fit, since a ring is whole at any capacity
    (so rings and full tensors do not share positions in one proportion)."""
    ring_bytes = sum(t.bytes_per_token * t.tokens for t in tensors if t.window is not None)
    position_bytes = sum(t.bytes_per_token for t in tensors if t.window is None)
    most_slots = min(slots, nbytes // (ring_bytes + position_bytes))  # every slot at least one position
    longest = max((t.tokens for t in tensors if t.window is None), default=0)
    widest = max((s * min(longest, (nbytes // s - ring_bytes) // position_bytes) for s in range(1, most_slots + 1)),
                 default=0) if position_bytes else 0
    return {t.name: most_slots * t.tokens if t.window is not None else widest for t in tensors}


class SlotReservation:
    """One flat array per cache tensor (its heads x width per position, as the manifest sizes
    it: kvforge.manifest.CacheTensor) holding `positions[name]` positions (reserved_positions),
    kept for the runner's life: every layout within it is a view of its start, and a resize moves
    each row's KV inside it. Why: a page touched for the first time is slow on this VM
    (runtime/pages.py; a resize into new zeroed arrays took 5-260 ms, a stall for every decoding
    stream). So a background thread maps every page at once, and the process holds the
    reservation from then on. Views hold stale (finite) KV beyond each row's length, as reused
    rows always have: attention reads a row only up to its write position."""

    def __init__(self, tensors: tuple[CacheTensor, ...], positions: dict[str, int]):
        self.tensors = {t.name: t for t in tensors}
        self.positions = positions
        # zeros (a fresh mapping this large), never stale bytes that could read as NaN
        self.flat = {t.name: np.zeros(positions[t.name] * t.heads * t.width, NUMPY_DTYPES[t.dtype]) for t in tensors}
        self.nbytes = sum(a.nbytes for a in self.flat.values())
        self.populated = threading.Event()
        threading.Thread(target=self._populate, name="kvforge-kv-populate", daemon=True).start()

    def _populate(self) -> None:
        try:
            for array in self.flat.values():
                if not populate(array):
                    break
        finally:
            self.populated.set()

    def fits(self, slots: int, capacity: int) -> bool:
        return all(slots * t.held(capacity) <= self.positions[name] for name, t in self.tensors.items())

    def views(self, slots: int, capacity: int) -> dict[str, np.ndarray]:
        return {name: self.flat[name][:slots * t.heads * t.held(capacity) * t.width]
                .reshape(slots, t.heads, t.held(capacity), t.width) for name, t in self.tensors.items()}

    def relayout(self, old_capacity: int, new_capacity: int, rows: int, keep: int) -> None:
        """Rows 0..rows-1 keep their first `keep` positions from [slots, heads, old_capacity, width]
        to [slots, heads, new_capacity, width]. Each (row, head) block starts at its index x
        capacity: growing, blocks move up and go last-first; shrinking, down and first-first, so
        no block overwrites one not moved yet. A ring stays where it is (whole at any capacity)."""
        for name, flat in self.flat.items():
            t = self.tensors[name]
            old, new = t.held(old_capacity), t.held(new_capacity)
            if old == new:
                continue  # only the slot count changes, or a ring: every row stays where it is
            position = flat.itemsize * t.width
            blocks = range(rows * t.heads)
            for b in (reversed(blocks) if new > old else blocks):
                ctypes.memmove(flat.ctypes.data + b * new * position,
                               flat.ctypes.data + b * old * position, min(keep, old, new) * position)


class OrtInplaceRunner(_OrtRunner):
    reservation: SlotReservation | None = None

    def reserve(self, nbytes: int, slots: int) -> None:
        """Before allocate: one reservation (SlotReservation) holds every later layout of at most
        `slots` slots within `nbytes` of KV."""
        tensors = tuple(self.cache.values())
        self.reservation = SlotReservation(tensors, reserved_positions(tensors, nbytes, slots))

    def close(self) -> None:
        if self.reservation is not None:
            self.reservation.populated.wait()
        self.reservation, self.buffers, self._binding, self._bound_rows = None, {}, None, 0

    def _reserved(self, slots: int, capacity: int) -> bool:
        return self.reservation is not None and self.reservation.fits(slots, capacity)

    def allocate(self, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        if self._reserved(slots, capacity):
            self.buffers = self.reservation.views(slots, capacity)
        else:
            self.buffers = {past: self._slot_buffer(past, slots, capacity) for past, _ in self.pairs}
        self._binding, self._bound_rows = None, 0

    def step(self, input_ids, write_positions, num_new, logit_positions=None, prompt_lengths=None):
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        write_positions = np.ascontiguousarray(write_positions, dtype=np.int64)
        positions = self.check_step(input_ids, write_positions, np.asarray(num_new), logit_positions)
        rows = input_ids.shape[0]
        binding = self._kv_binding(rows)
        lengths = self.rope_lengths(write_positions, num_new, prompt_lengths)
        for name, value in pack_step(input_ids, write_positions, num_new, positions, lengths).items():
            binding.bind_cpu_input(name, np.ascontiguousarray(value, dtype=np.int64))
        binding.bind_output("logits")  # unbound from the last step's array: ORT allocates this step's shape
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().reshape(rows, positions.shape[1], -1)

    def _kv_binding(self, rows: int):
        """An IOBinding with rows 0..rows-1 of every cache buffer bound as both past and present,
        kept until the row count or the buffers change: binding 2 OrtValues per cache tensor
        anew was a third of a decode step's Python on stdlib-llama."""
        from onnxruntime import OrtValue

        if self._bound_rows != rows:
            self._binding, self._bound_rows = self.session.io_binding(), rows
            self._binding.bind_output("logits")  # first: get_outputs() lists in binding order
            for past, present in self.pairs:
                # rows 0..rows-1 of a C-contiguous buffer are one contiguous block: a view, not a copy.
                value = OrtValue.ortvalue_from_numpy(self.buffers[past][:rows])
                self._binding.bind_ortvalue_input(past, value)
                self._binding.bind_ortvalue_output(present, value)
        return self._binding

    def move(self, src, dst, length):
        for buf in self.buffers.values():  # a ring past its cells: every cell (the slice stops there)
            buf[dst, :, :length] = buf[src, :, :length]

    def resize(self, capacity, rows, slots=None):
        slots = self.slots if slots is None else slots
        if capacity == self.capacity and slots == self.slots:
            return
        if rows > slots:
            raise ValueError(f"cannot keep {rows} rows in {slots} slots")
        keep = min(capacity, self.capacity)
        if self._reserved(self.slots, self.capacity) and self._reserved(slots, capacity):
            self.reservation.relayout(self.capacity, capacity, rows, keep)
            self.allocate(slots, capacity)
            return
        old = self.buffers
        self.allocate(slots, capacity)
        for name, buf in self.buffers.items():  # a ring below its cells holds no wrapped position
            buf[:rows, :, :keep] = old[name][:rows, :, :keep]

    def read_blocks(self, row, start, n) -> Blocks:
        """A ring's positions come from their cells (p mod its cells): read right after the step
        that filled them (the prefix cache's store), they are all still there; a swap-out's older
        ones read as whatever their cells hold now, and write_blocks puts exactly that back."""
        lo, hi = self.block_range(start, n)
        return {name: as_blocks(buf[row, :, lo:hi] if self.cache[name].window is None
                                else buf[row][:, np.arange(lo, hi) % buf.shape[2]], n, self.block.tokens)
                for name, buf in self.buffers.items()}

    def write_blocks(self, row, start, data: Blocks) -> None:
        """Straight into the slot: the full blocks through a [heads, blocks, block_tokens, D] view of
        it, then a partial last one (no staging copy). A ring takes the last of the positions that
        land in it, at their cells: what a miss leaves there (blocks come in position order)."""
        n = len(next(iter(data.values())))
        lo, hi = self.block_range(start, n)
        tokens = self.block.tokens
        full = (hi - lo) // tokens
        for name, buf in self.buffers.items():
            if self.cache[name].window is not None:
                kept = min(hi - lo, buf.shape[2])
                buf[row][:, np.arange(hi - kept, hi) % buf.shape[2]] = as_tokens(data[name], hi - lo)[:, -kept:]
                continue
            blocks = buf[row, :, lo:lo + full * tokens]
            blocks.shape = (buf.shape[1], full, tokens, buf.shape[3])  # a view, or an error: never a copy
            blocks[:] = data[name][:full].transpose(1, 0, 2, 3)
            if lo + full * tokens < hi:
                buf[row, :, lo + full * tokens:hi] = data[name][full, :, :hi - lo - full * tokens]

    @property
    def kv_bytes_allocated(self):
        return sum(b.nbytes for b in self.buffers.values())

    @property
    def kv_bytes_held(self):
        return self.kv_bytes_allocated if self.reservation is None else self.reservation.nbytes

    @property
    def kv_arrays(self) -> dict[str, np.ndarray]:
        return self.buffers

    def data_pointers(self) -> list[int]:
        return [b.ctypes.data for b in self.buffers.values()]


class OrtConcatRunner(_OrtRunner):
    """present = concat(past, new). Rows share one past length and step together; a row's
    unused columns are masked out through attention_mask. The capacity is only the bound on
    that length. (Continuous batching, with rows joining and leaving, runs the inplace layout.)"""

    def allocate(self, slots, capacity):
        self.slots, self.capacity = slots, capacity
        self.past = {past: self._buffer(past, slots, 0) for past, _ in self.pairs}
        self.mask = np.zeros((slots, 0), np.int64)

    def allocate_cached(self, slots, length, capacity):
        self.allocate(slots, capacity)
        self.past = {past: self._buffer(past, slots, min(length, self.cache[past].held(length))) for past, _ in self.pairs}
        self.mask = np.ones((slots, length), np.int64)

    @property
    def kv_arrays(self) -> dict[str, np.ndarray]:
        return self.past

    def check_step(self, input_ids, write_positions, num_new, logit_positions=None):
        if input_ids.shape[0] != self.slots:  # the past is one rectangle: every row steps together
            raise ValueError(f"the concat runner steps all {self.slots} rows at once, got {input_ids.shape[0]}")
        if self.mask.shape[1] + input_ids.shape[1] > self.capacity:
            raise ValueError(f"concat cache would grow past its capacity {self.capacity}; resize first")
        return super().check_step(input_ids, write_positions, num_new, logit_positions)

    def step(self, input_ids, write_positions, num_new, logit_positions=None, prompt_lengths=None):
        """The Optimum contract returns every position; the wanted ones are picked afterwards."""
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        write_positions = np.asarray(write_positions, dtype=np.int64)
        num_new = np.asarray(num_new, dtype=np.int64)
        positions = self.check_step(input_ids, write_positions, num_new, logit_positions)
        logits = self._step_all(input_ids, write_positions, num_new,
                                self.rope_lengths(write_positions, num_new, prompt_lengths))
        if logit_positions is None:
            return logits
        return np.take_along_axis(logits, positions[:, :, None], axis=1)

    def _step_all(self, input_ids, write_positions, num_new, prompt_lengths):
        rows, seq = input_ids.shape
        self.mask[:rows][write_positions == 0] = 0  # a row starting over forgets its old tokens
        new_mask = (np.arange(seq)[None, :] < num_new[:, None]).astype(np.int64)
        mask = np.concatenate([self.mask[:rows], new_mask], axis=1)
        gaps = int((mask.shape[1] - mask.sum(axis=1)).max())
        if self.manifest.rings and gaps >= self.manifest.max_chunk:
            raise ValueError(f"a row would have {gaps} padding columns; with sliding layers' rings (the last "
                             f"max_chunk - 1 + window columns) the concat layout allows at most "
                             f"{self.manifest.max_chunk - 1}: step rows with their prompts together, or run inplace")
        feeds = {"input_ids": input_ids, "attention_mask": mask,
                 "position_ids": write_positions[:, None] + np.arange(seq)[None, :]}
        if prompt_lengths is not None:
            feeds["prompt_lengths"] = prompt_lengths
        feeds.update({past: self.past[past][:rows] for past, _ in self.pairs})
        outputs = self.session.run(["logits"] + [present for _, present in self.pairs], feeds)
        self.past = {past: present for (past, _), present in zip(self.pairs, outputs[1:])}
        self.mask = mask
        return outputs[0]

    def move(self, src, dst, length):
        for buf in self.past.values():
            buf[dst] = buf[src]
        self.mask[dst] = self.mask[src]

    def resize(self, capacity, rows, slots=None):
        if slots not in (None, self.slots):
            raise ValueError("the concat runner keeps its slot count; allocate again to change it")
        if self.mask.shape[1] > capacity:
            raise ValueError(f"concat cache holds {self.mask.shape[1]} columns, more than {capacity}")
        self.capacity = capacity

    @property
    def kv_bytes_allocated(self):
        return sum(b.nbytes for b in self.past.values())
