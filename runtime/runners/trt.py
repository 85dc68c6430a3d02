"""The in-place KV cache on a GPU through a TensorRT plan (written from the TensorRT docs; it
runs only on a host with TensorRT and a CUDA GPU, which this project's CI does not have).

Each cache tensor is one device buffer [slots, kv_heads, capacity, D], bound with
set_tensor_address as BOTH the past_key_values.* input and the present.* output: the ONNX
TensorScatter becomes an IKVCacheUpdateLayer, whose output must share the input's device address
(TensorRT 10.15 docs, "KV Cache"). Rows 0..rows-1 of the buffer are one contiguous block, so a
step binds the base address with a smaller batch, as the ONNX Runtime runner does.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvforge.manifest import ITEMSIZE, Manifest, ManifestError, kv_buffer_shape, kv_pairs
from kvforge.tensorrt_host import capturing_logger, check_engine_match, cuda, missing_requirement, platform, \
    read_plan
from runtime.runners.base import Blocks, Runner, as_blocks, as_tokens, pack_step


class TensorRTRunner(Runner):
    """The inplace layout on a GPU. The plan fixes the cache capacity (IKVCacheUpdateLayer needs a
    static maximum sequence length), so every slot holds the plan's capacity and resize only checks."""

    def __init__(self, manifest: Manifest, plan_path: Path):
        super().__init__(manifest)
        missing = missing_requirement()
        if missing:
            raise ManifestError(f"cannot run the TensorRT engine: {missing}")
        if manifest.kv_layout != "inplace":
            raise ManifestError(f"the TensorRT runner binds the cache in place, so it runs the inplace layout "
                                f"only; this engine has the {manifest.kv_layout} layout")
        import tensorrt as trt

        check_engine_match(manifest.engine, platform())
        plan = read_plan(plan_path)
        self.logger = capturing_logger(trt)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(plan)
        if self.engine is None:
            reason = self.logger.errors[-1] if self.logger.errors else "deserialization failed"
            raise ManifestError(f"cannot load TensorRT plan {plan_path} (corrupt or not a plan?): {reason}")
        from cuda.bindings import runtime as cudart

        self.cudart = cudart
        self.context = self.engine.create_execution_context()
        self.stream = cuda(cudart.cudaStreamCreate())
        self.pairs = kv_pairs(manifest.model, manifest.kv_dtype)
        self.specs = {t.name: t for t in manifest.io()[0]}
        self.plan_capacity = self.engine.get_tensor_shape(self.pairs[0][0])[2]
        self.max_rows, self.max_seq = self.engine.get_tensor_profile_shape("row_tokens", 0)[2]
        self.buffers: dict[str, tuple[int, int]] = {}  # name -> (device pointer, bytes)
        self.host_inputs: dict[str, np.ndarray] = {}  # kept alive until the step has read them

    def bucket_for(self, tokens: int) -> int:
        if tokens > self.plan_capacity:
            raise ManifestError(f"{tokens} tokens exceed the plan's KV capacity {self.plan_capacity}")
        return self.plan_capacity

    def _shape(self, name: str, rows: int) -> tuple[int, ...]:
        return kv_buffer_shape(self.specs[name], rows, self.plan_capacity)

    def _device(self, name: str, nbytes: int) -> int:
        """The device buffer `name` of at least nbytes (reallocated only to grow)."""
        ptr, have = self.buffers.get(name, (0, 0))
        if have < nbytes:
            if ptr:
                cuda(self.cudart.cudaFree(ptr))
            ptr, have = cuda(self.cudart.cudaMalloc(nbytes)), nbytes
            self.buffers[name] = (ptr, have)
        return ptr

    def close(self) -> None:
        for ptr, _ in self.buffers.values():
            cuda(self.cudart.cudaFree(ptr))
        self.buffers = {}

    def allocate(self, slots: int, capacity: int) -> None:
        if slots > self.max_rows:
            raise ValueError(f"{slots} slots exceed the plan's batch profile (max {self.max_rows}); "
                             "rebuild it with more")
        self.bucket_for(capacity)
        self.close()
        self.slots, self.capacity = slots, self.plan_capacity
        for past, _ in self.pairs:
            nbytes = int(np.prod(self._shape(past, slots))) * ITEMSIZE[self.specs[past].dtype]
            cuda(self.cudart.cudaMemsetAsync(self._device(past, nbytes), 0, nbytes, self.stream))
        cuda(self.cudart.cudaStreamSynchronize(self.stream))

    def _upload(self, name: str, array: np.ndarray) -> None:
        if self.engine.is_shape_inference_io(name):
            # attention_extent sets the attention Slice bounds: TensorRT reads such inputs from host memory
            self.host_inputs[name] = array
            self.context.set_input_shape(name, array.shape)
            self.context.set_tensor_address(name, array.ctypes.data)
            return
        ptr = self._device(name, array.nbytes)
        cuda(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes,
                                         self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))
        self.context.set_input_shape(name, array.shape)
        self.context.set_tensor_address(name, ptr)

    def step(self, input_ids, write_positions, num_new, logit_positions=None, prompt_lengths=None):
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        write_positions = np.ascontiguousarray(write_positions, dtype=np.int64)
        positions = self.check_step(input_ids, write_positions, np.asarray(num_new), logit_positions)
        rows, seq = input_ids.shape
        if seq > self.max_seq:
            raise ValueError(f"{seq} new tokens in one step exceed the plan's profile (max {self.max_seq})")
        lengths = self.rope_lengths(write_positions, num_new, prompt_lengths)
        for name, value in pack_step(input_ids, write_positions, num_new, positions, lengths).items():
            self._upload(name, np.ascontiguousarray(value, dtype=np.int64))
        for past, present in self.pairs:
            ptr = self.buffers[past][0]
            self.context.set_input_shape(past, self._shape(past, rows))
            self.context.set_tensor_address(past, ptr)
            self.context.set_tensor_address(present, ptr)  # the same memory: updated in place
        logits = np.empty((rows * positions.shape[1], self.manifest.model.vocab_size), np.float32)
        out = self._device("logits", logits.nbytes)
        self.context.set_tensor_address("logits", out)
        if not self.context.execute_async_v3(int(self.stream)):
            errors = self.logger.errors
            raise RuntimeError("TensorRT step failed: " + (errors[-1] if errors else "no message"))
        cuda(self.cudart.cudaMemcpyAsync(logits.ctypes.data, out, logits.nbytes,
                                         self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
        cuda(self.cudart.cudaStreamSynchronize(self.stream))
        return logits.reshape(rows, positions.shape[1], -1)

    def move(self, src, dst, length):
        for past, _ in self.pairs:
            _, heads, capacity, width = self._shape(past, 1)
            token = width * ITEMSIZE[self.specs[past].dtype]
            pitch, base = capacity * token, self.buffers[past][0]
            slot = heads * pitch
            # one 2D copy per buffer: the first `length` tokens of each of the slot's `heads` rows
            cuda(self.cudart.cudaMemcpy2DAsync(base + dst * slot, pitch, base + src * slot, pitch,
                                               length * token, heads,
                                               self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream))
        cuda(self.cudart.cudaStreamSynchronize(self.stream))

    def resize(self, capacity, rows, slots=None):
        self.bucket_for(capacity)  # every slot already holds the plan's capacity
        if slots in (None, self.slots):
            return
        kept = {past: self.read_rows(past, rows) for past, _ in self.pairs}
        self.allocate(slots, capacity)
        for past, host in kept.items():
            self._copy(host.ctypes.data, self.buffers[past][0], host.nbytes, "cudaMemcpyHostToDevice")
        cuda(self.cudart.cudaStreamSynchronize(self.stream))

    def _copy(self, dst: int, src: int, nbytes: int, kind: str) -> None:
        cuda(self.cudart.cudaMemcpyAsync(dst, src, nbytes, getattr(self.cudart.cudaMemcpyKind, kind), self.stream))

    def read_rows(self, past: str, rows: int) -> np.ndarray:
        host = np.empty(self._shape(past, rows), np.dtype(self.specs[past].dtype))
        self._copy(host.ctypes.data, self.buffers[past][0], host.nbytes, "cudaMemcpyDeviceToHost")
        cuda(self.cudart.cudaStreamSynchronize(self.stream))
        return host

    def _token_span(self, past: str, row: int, lo: int, hi: int):
        """(device address of position lo of the row's first head, pitch between heads, bytes, heads)."""
        _, heads, capacity, width = self._shape(past, 1)
        token = width * ITEMSIZE[self.specs[past].dtype]
        base = self.buffers[past][0] + row * heads * capacity * token
        return base + lo * token, capacity * token, (hi - lo) * token, heads

    def read_blocks(self, row, start, n) -> Blocks:
        """One 2D device-to-host copy per tensor: positions lo..hi of each of the row's heads."""
        lo, hi = self.block_range(start, n)
        out = {}
        for past, _ in self.pairs:
            src, pitch, width, heads = self._token_span(past, row, lo, hi)
            host = np.empty((heads, hi - lo, self._shape(past, 1)[3]), np.dtype(self.specs[past].dtype))
            cuda(self.cudart.cudaMemcpy2DAsync(host.ctypes.data, width, src, pitch, width, heads,
                                               self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream))
            out[past] = host
        cuda(self.cudart.cudaStreamSynchronize(self.stream))
        return {past: as_blocks(host, n, self.block.tokens) for past, host in out.items()}

    def write_blocks(self, row, start, data: Blocks) -> None:
        n = len(next(iter(data.values())))
        lo, hi = self.block_range(start, n)
        staged = []  # the host arrays must live until the stream has read them
        for past, _ in self.pairs:
            dst, pitch, width, heads = self._token_span(past, row, lo, hi)
            host = np.ascontiguousarray(as_tokens(data[past], hi - lo))
            staged.append(host)
            cuda(self.cudart.cudaMemcpy2DAsync(dst, pitch, host.ctypes.data, width, width, heads,
                                               self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream))
        cuda(self.cudart.cudaStreamSynchronize(self.stream))

    @property
    def kv_bytes_allocated(self):
        return sum(self.buffers[past][1] for past, _ in self.pairs if past in self.buffers)
