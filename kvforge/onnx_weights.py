"""An ONNX model's weights in the file beside it, written and read one tensor at a time, so that
neither the export nor the engine build ever holds a whole model (a 7-8B checkpoint is 30 GB of
float32). The layout is ONNX's external data: each tensor names the file, its offset and length."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

# Offsets on page boundaries: ONNX Runtime may then map a tensor instead of copying it.
ALIGNMENT = 4096
INLINE_BYTES = 1024  # smaller tensors stay in the graph file, as onnx.save would keep them


class WeightWriter:
    """Appends tensors to `<model file>.data`; add() returns the initializer that points at one."""

    def __init__(self, model_path: Path):
        self.location = Path(model_path).name + ".data"
        self.file = open(Path(model_path).parent / self.location, "wb")

    def add(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        array = np.require(array, requirements="C")  # (ascontiguousarray makes a scalar 1-D)
        if array.nbytes < INLINE_BYTES:
            return numpy_helper.from_array(array, name)
        offset = -self.file.tell() % ALIGNMENT + self.file.tell()
        self.file.seek(offset)
        self.file.write(memoryview(array).cast("B"))
        tensor = onnx.TensorProto(name=name, dims=array.shape,
                                  data_type=onnx.helper.np_dtype_to_tensor_dtype(array.dtype),
                                  data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(array.nbytes))):
            tensor.external_data.add(key=key, value=value)
        return tensor

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "WeightWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_weight(model_dir: Path, tensor: onnx.TensorProto) -> np.ndarray:
    """The initializer's values: a read-only map of its bytes in the data file when it is there."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {entry.key: entry.value for entry in tensor.external_data}
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    return np.memmap(Path(model_dir) / info["location"], dtype=dtype, mode="r", offset=int(info.get("offset", 0)),
                     shape=tuple(tensor.dims))


def save_graph(model: onnx.ModelProto, path: Path) -> None:
    """Save a model whose large weights are already written beside it (WeightWriter)."""
    onnx.save(model, str(path))
