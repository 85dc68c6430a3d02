"""Trace the decoder to ONNX with the cache tensors the manifest names, in its layout and dtype."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import onnxscript.optimizer
import torch

from kvforge.manifest import OPSET, Manifest, TensorSpec
from export.model import CausalLM

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8,
                "uint8": torch.uint8, "int64": torch.int64, "float8e4m3fn": torch.float8_e4m3fn}
# Sizes of the example inputs; each dim is exported as dynamic, so these only need to differ.
EXAMPLE_SIZES = {"batch": 2, "seq": 3, "tokens": 6, "kept": 4, "past": 5, "total": 8, "capacity": 16, "ring_past": 5}
# An in-place step of the example sizes: row 0 a 3-token chunk at 0, row 1 one decode token at 7
# (tokens 4-5 unused), chunk rows P = 1 over L = 3 positions, decode queries over D = 8; token_slots
# index [3 chunk, 2 decode].
EXAMPLE_STEP = {"positions": [0, 1, 2, 7, 8, 9], "write_positions": [0, 7], "row_tokens": [[0, 1, 2], [3, 0, 0]],
                "attention_extent": [1, 3, 8], "token_slots": [0, 1, 2, 4, 4, 4], "logit_index": [2, 3, 0, 1]}
EXTERNAL_DATA_BYTES = 1 << 30  # protobuf cannot hold more than 2 GiB; keep weights beside it well before
FOLD_LIMIT = 1 << 40  # elements: fold weight-only subgraphs whatever their size


def example_input(t: TensorSpec) -> torch.Tensor:
    shape = [EXAMPLE_SIZES[d] if isinstance(d, str) else d for d in t.shape]
    if t.name in EXAMPLE_STEP:
        return torch.tensor(EXAMPLE_STEP[t.name])
    if t.name == "input_ids":
        return torch.randint(0, 100, shape)
    if t.name == "attention_mask":
        return torch.ones(shape, dtype=torch.int64)
    if t.name == "position_ids":
        return torch.arange(EXAMPLE_SIZES["past"], EXAMPLE_SIZES["total"]).repeat(EXAMPLE_SIZES["batch"], 1)
    if t.dtype == "float8e4m3fn":
        return torch.zeros(shape).to(torch.float8_e4m3fn)
    return torch.zeros(shape, dtype=TORCH_DTYPES[t.dtype])


def export_onnx(model: CausalLM, manifest: Manifest, path: Path) -> None:
    inputs, outputs = manifest.io()
    args = tuple(example_input(t) for t in inputs)
    dims = {name: torch.export.Dim(name, min=1) for name in ("batch", "seq", "tokens", "kept", "total", "capacity")}
    dims["past"] = torch.export.Dim("past", min=0)
    dims["ring_past"] = torch.export.Dim("ring_past", min=0)  # a sliding layer's past in concat: <= its ring
    shapes = [{i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)} for t in inputs]
    dynamic_shapes = (shapes[0], tuple(shapes[1:]))  # forward(input_ids, *rest)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, args, dynamo=True, opset_version=OPSET, dynamic_shapes=dynamic_shapes,
            input_names=[t.name for t in inputs], output_names=[t.name for t in outputs],
            optimize=True, verbose=False, report=False)
    # The packed q/k/v and gate/up weights are exported as Concat (+ Transpose) of the checkpoint's
    # tensors; fold them into single initializers so every consumer sees MatMul(x, W): the weight
    # quantizer, TensorRT's weight cast and the op check (the exporter's own folding stops at 256K elements).
    onnxscript.optimizer.fold_constants(program.model, input_size_limit=FOLD_LIMIT, output_size_limit=FOLD_LIMIT)
    onnxscript.optimizer.remove_unused_nodes(program.model)
    proto = program.model_proto
    _name_symbolic_dims(proto, inputs, outputs)
    large = sum(t.ByteSize() for t in proto.graph.initializer) > EXTERNAL_DATA_BYTES
    onnx.save(proto, str(path), save_as_external_data=large, all_tensors_to_one_file=True,
              location=path.name + ".data")


def _name_symbolic_dims(proto: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """Give graph I/O the manifest's dim names (the exporter invents s0, s1, ...)."""
    specs = {t.name: t for t in inputs + outputs}
    for value in list(proto.graph.input) + list(proto.graph.output):
        spec = specs[value.name]
        for dim, want in zip(value.type.tensor_type.shape.dim, spec.shape):
            if isinstance(want, str):
                dim.ClearField("dim_value")
                dim.dim_param = want
