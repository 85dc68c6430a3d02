"""The runtime's view of an engine: one step of the decoder over a batch of KV slots.

A Runner owns the KV buffers for `slots` sequences. Active sequences occupy rows 0..rows-1
(the scheduler keeps them packed with `move`), so every step binds a contiguous prefix of
each buffer: no gather, no copy. Implementations:

- OrtInplaceRunner: fixed-capacity buffers, the same memory bound as past input and present
  output through IOBinding, so ONNX Runtime's TensorScatter writes the new K/V in place.
  Capacity lives in power-of-two buckets (attention cost follows capacity on ORT CPU).
- OrtConcatRunner: the Optimum-style layout, present = concat(past, new), for comparison.
- TensorRTRunner (runtime/tensorrt_runner.py): the in-place layout on a GPU.

`open_runner(engine_dir)` picks the implementation from the manifest.
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from kvforge.manifest import Manifest, ManifestError, capacity_bucket, kv_pairs

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8, "uint8": np.uint8}


class Runner(ABC):
    """allocate -> step* (with move/resize between steps); the KV cache never leaves the runner."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.slots = 0
        self.capacity = 0

    @abstractmethod
    def allocate(self, slots: int, capacity: int) -> None:
        """(Re)create empty KV buffers for `slots` sequences of up to `capacity` tokens."""

    @abstractmethod
    def step(self, input_ids: np.ndarray, write_positions: np.ndarray, num_new: np.ndarray) -> np.ndarray:
        """Run rows 0..len(input_ids)-1: input_ids [rows, S] (right-padded), write_positions [rows]
        (tokens already cached per row), num_new [rows] (real tokens per row, <= S).
        Returns logits [rows, S, vocab] float32; row b's cache now holds write_positions[b] + num_new[b]."""

    @abstractmethod
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached tokens of slot src into slot dst (keeps rows packed)."""

    @abstractmethod
    def resize(self, capacity: int, rows: int) -> None:
        """Change capacity keeping the cached tokens of rows 0..rows-1 (up to the new capacity)."""

    @property
    @abstractmethod
    def kv_bytes_allocated(self) -> int:
        """Bytes held by KV buffers right now."""

    def bucket_for(self, tokens: int) -> int:
        return capacity_bucket(tokens, self.manifest.max_seq_len)

    def check_step(self, input_ids: np.ndarray, write_positions: np.ndarray, num_new: np.ndarray) -> None:
        rows, seq = input_ids.shape
        if rows > self.slots:
            raise ValueError(f"{rows} rows exceed the {self.slots} allocated slots")
        if write_positions.shape != (rows,) or num_new.shape != (rows,):
            raise ValueError("write_positions and num_new need one entry per row")
        needed = int((write_positions + seq).max())
        if needed > self.capacity:
            raise ValueError(f"step needs {needed} cache positions but capacity is {self.capacity}; resize first")


def session_options(threads: int | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads or int(os.environ.get("KVFORGE_THREADS", 0)) or (os.cpu_count() or 1)
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return opts


class _OrtRunner(Runner):
    def __init__(self, manifest: Manifest, onnx_path: Path, threads: int | None = None):
        super().__init__(manifest)
        import onnxruntime as ort

        if "onnxruntime" not in manifest.kv.runs_on:
            raise ManifestError(
                f"KV dtype {manifest.kv_dtype} cannot run on ONNX Runtime ({manifest.kv.note})")
        try:
            self.session = ort.InferenceSession(str(onnx_path), session_options(threads),
                                                providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for unreadable models
            raise ManifestError(f"cannot load engine {onnx_path}: {str(e).splitlines()[0][:300]}") from None
        inputs, _ = manifest.io()
        self.dtypes = {t.name: NUMPY_DTYPES.get(t.dtype) for t in inputs}
        self.pairs = kv_pairs(manifest.model, manifest.kv_dtype)

    def _buffer_shape(self, past_name: str, rows: int, length: int) -> tuple[int, ...]:
        spec = next(t for t in self.manifest.io()[0] if t.name == past_name)
        return (rows, spec.shape[1], length, spec.shape[3])


class OrtInplaceRunner(_OrtRunner):
    def allocate(self, slots: int, capacity: int) -> None:
        self.slots, self.capacity = slots, capacity
        self.buffers = {past: np.zeros(self._buffer_shape(past, slots, capacity), self.dtypes[past])
                        for past, _ in self.pairs}

    def step(self, input_ids, write_positions, num_new):
        from onnxruntime import OrtValue

        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        write_positions = np.ascontiguousarray(write_positions, dtype=np.int64)
        self.check_step(input_ids, write_positions, np.asarray(num_new))
        rows = input_ids.shape[0]
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", input_ids)
        binding.bind_cpu_input("write_positions", write_positions)
        binding.bind_output("logits")
        for past, present in self.pairs:
            # rows 0..rows-1 of a C-contiguous buffer are one contiguous block: a view, not a copy.
            value = OrtValue.ortvalue_from_numpy(self.buffers[past][:rows])
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        self.session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy()

    def move(self, src, dst, length):
        for buf in self.buffers.values():
            buf[dst, :, :length] = buf[src, :, :length]

    def resize(self, capacity, rows):
        if capacity == self.capacity:
            return
        keep = min(capacity, self.capacity)
        old = self.buffers
        self.allocate(self.slots, capacity)
        for name, buf in self.buffers.items():
            buf[:rows, :, :keep] = old[name][:rows, :, :keep]

    @property
    def kv_bytes_allocated(self):
        return sum(b.nbytes for b in self.buffers.values())

    def data_pointers(self) -> list[int]:
        return [b.ctypes.data for b in self.buffers.values()]


class OrtConcatRunner(_OrtRunner):
    """present = concat(past, new). Rows share one past length; a row's unused columns are
    masked out through attention_mask. The capacity is only the bound on that length."""

    def allocate(self, slots, capacity):
        self.slots, self.capacity = slots, capacity
        self.past = {past: np.zeros(self._buffer_shape(past, slots, 0), self.dtypes[past]) for past, _ in self.pairs}
        self.mask = np.zeros((slots, 0), np.int64)

    def check_step(self, input_ids, write_positions, num_new):
        if self.mask.shape[1] + input_ids.shape[1] > self.capacity:
            raise ValueError(f"concat cache would grow past its capacity {self.capacity}; resize first")
        super().check_step(input_ids, write_positions, num_new)

    def step(self, input_ids, write_positions, num_new):
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        write_positions = np.asarray(write_positions, dtype=np.int64)
        num_new = np.asarray(num_new, dtype=np.int64)
        self.check_step(input_ids, write_positions, num_new)
        rows, seq = input_ids.shape
        self.mask[:rows][write_positions == 0] = 0  # a row starting over forgets its old tokens
        new_mask = (np.arange(seq)[None, :] < num_new[:, None]).astype(np.int64)
        mask = np.concatenate([self.mask[:rows], new_mask], axis=1)
        feeds = {"input_ids": input_ids, "attention_mask": mask,
                 "position_ids": write_positions[:, None] + np.arange(seq)[None, :]}
        feeds.update({past: self.past[past][:rows] for past, _ in self.pairs})
        outputs = self.session.run(["logits"] + [present for _, present in self.pairs], feeds)
        if rows == self.slots:
            self.past = {past: present for (past, _), present in zip(self.pairs, outputs[1:])}
            self.mask = mask
            return outputs[0]
        # rows beyond `rows` keep their columns (masked) so the past stays rectangular
        for (past, _), present in zip(self.pairs, outputs[1:]):
            grown = np.zeros(self._buffer_shape(past, self.slots, present.shape[2]), present.dtype)
            grown[:rows] = present
            grown[rows:, :, :self.past[past].shape[2]] = self.past[past][rows:]
            self.past[past] = grown
        grown_mask = np.zeros((self.slots, mask.shape[1]), np.int64)
        grown_mask[:rows] = mask
        grown_mask[rows:, :self.mask.shape[1]] = self.mask[rows:]
        self.mask = grown_mask
        return outputs[0]

    def move(self, src, dst, length):
        for buf in self.past.values():
            buf[dst] = buf[src]
        self.mask[dst] = self.mask[src]

    def resize(self, capacity, rows):
        if self.mask.shape[1] > capacity:
            raise ValueError(f"concat cache holds {self.mask.shape[1]} columns, more than {capacity}")
        self.capacity = capacity

    @property
    def kv_bytes_allocated(self):
        return sum(b.nbytes for b in self.past.values())


def open_runner(engine_dir: Path, threads: int | None = None) -> Runner:
    """The runner for an engine or export directory, chosen from its manifest."""
    engine_dir = Path(engine_dir)
    manifest = Manifest.load(engine_dir)
    backend = manifest.engine.get("backend", "onnxruntime")
    if backend == "tensorrt":
        from runtime.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(manifest, engine_dir / manifest.engine["file"])
    import onnxruntime

    built_with = manifest.engine.get("onnxruntime_version")
    if built_with and built_with != onnxruntime.__version__:
        raise ManifestError(f"engine {engine_dir} was built with ONNX Runtime {built_with} but this runtime "
                            f"is {onnxruntime.__version__}; rebuild it with `make build-engines`")
    path = engine_dir / manifest.engine.get("file", manifest.onnx_file)
    if not path.is_file():
        raise ManifestError(f"{path} is missing; rebuild with `make build-engines`")
    cls = OrtInplaceRunner if manifest.kv_layout == "inplace" else OrtConcatRunner
    return cls(manifest, path, threads or manifest.engine.get("threads"))
