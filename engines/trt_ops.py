"""Which ONNX ops (and element types) the TensorRT ONNX parser of a release imports: an offline
check of an export before it travels to a GPU host (`python -m engines check`).

Sources, read from the public documentation (not from a TensorRT run):
- Types and restrictions: onnx-tensorrt docs/operators.md as of the 10.15 GA parser
  ("TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24");
  a third-party copy of the 11.2 table on GitHub has the same Attention and TensorScatter rows.
- When ops arrived: onnx-tensorrt docs/Changelog.md ("TensorRT 10.14 GA: Added support for the
  Attention operator"; "TensorRT 10.15 GA: Added support for RotaryEmbedding, RMSNormalization and
  TensorScatter"), TensorRT 11.0 release notes on github.com/NVIDIA/TensorRT ("Added support for
  Swish operator"; custom ops TRT_Attention, TRT_MoE, TRT_KVCacheUpdate).
- TensorScatter imports as IKVCacheUpdateLayer: docs.nvidia.com/deeplearning/tensorrt, operators
  page "KVCacheUpdate" (cache type float32/float16/bfloat16; the cache must be a network input and
  the result a network output at the same device address).
- "INT8, INT4, FP8 and FP4 are treated as Quantized Types ... only through quantization" and
  "UINT8 is only supported as network input or output tensor types" (operators.md notes).
Ops older than 10.13 are taken to have the 10.15 types in every target.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from kvforge.manifest import ManifestError
from kvforge.onnx_graphs import all_nodes, subgraphs

TARGETS = ("10.13", "10.14", "10.15", "11.0")
DEFAULT_TARGET = TARGETS[-1]
ADDED_IN = {"Attention": "10.14", "RMSNormalization": "10.15", "RotaryEmbedding": "10.15",
            "TensorScatter": "10.15", "Swish": "11.0"}

_F, _I, _B = "FP32 FP16 BF16", "INT32 INT64", "BOOL"
TYPES = {op: set(types.split()) for op, types in {
    "Abs": f"{_F} {_I}", "Add": f"{_F} {_I}", "And": _B, "Attention": f"{_F} INT8 FP8",
    "Cast": f"{_F} {_I} UINT8 {_B}", "CastLike": f"{_F} {_I} UINT8 {_B}", "Clip": _F,
    "Concat": f"{_F} {_I} {_B}", "Constant": f"{_F} FP8 FP4 INT4 {_I} {_B}",
    "ConstantOfShape": f"{_F} FP8 FP4 INT4 {_I} {_B}", "Cos": _F, "CumSum": _F,
    "DequantizeLinear": "INT8 FP8 FP4 INT4", "Div": f"{_F} {_I}", "Einsum": _F, "Equal": f"{_F} {_I}",
    "Erf": _F, "Exp": _F, "Expand": f"{_F} {_I} {_B}", "Flatten": f"{_F} {_I} {_B}", "Floor": _F,
    "Gather": f"{_F} {_I} {_B}", "GatherElements": f"{_F} {_I} {_B}", "GatherND": f"{_F} {_I} {_B}",
    "Gelu": f"{_F} INT8 {_I}", "Gemm": _F, "If": f"{_F} {_I} {_B}", "Greater": f"{_F} {_I}", "GreaterOrEqual": f"{_F} {_I}",
    "Identity": f"{_F} {_I} {_B}", "IsInf": _F, "IsNaN": f"{_F} {_I}", "LayerNormalization": _F,
    "Less": f"{_F} {_I}", "LessOrEqual": f"{_F} {_I}", "Log": _F, "MatMul": _F, "Max": f"{_F} {_I}",
    "Min": f"{_F} {_I}", "Mod": f"{_F} {_I}", "Mul": f"{_F} {_I}", "Neg": f"{_F} {_I}", "Not": _B,
    "Or": _B, "Pad": f"{_F} {_I}", "Pow": f"{_F} {_I}", "QuantizeLinear": _F, "Range": f"{_F} {_I}",
    "Reciprocal": _F, "ReduceMax": f"{_F} {_I}", "ReduceMean": f"{_F} {_I}", "ReduceSum": f"{_F} {_I}",
    "Relu": f"{_F} {_I}", "Reshape": f"{_F} {_I} {_B}", "RMSNormalization": _F, "RotaryEmbedding": _F,
    "Round": _F, "ScatterElements": f"{_F} {_I}", "ScatterND": f"{_F} {_I}", "Shape": f"{_F} {_I} {_B}",
    "Sigmoid": _F, "Sin": _F, "Slice": f"{_F} {_I} {_B}", "Softmax": _F, "Softplus": _F,
    "Split": f"{_F} {_I} {_B}", "Sqrt": _F, "Squeeze": f"{_F} {_I} {_B}", "Sub": f"{_F} {_I}",
    "Sum": f"{_F} {_I}", "Swish": _F, "Tanh": _F, "TensorScatter": f"{_F} INT32",
    "Tile": f"{_F} {_I} {_B}", "TopK": f"{_F} {_I}", "Transpose": f"{_F} {_I} {_B}",
    "Trilu": f"{_F} {_I} {_B}", "Unsqueeze": f"{_F} {_I} {_B}", "Where": f"{_F} {_I} {_B}", "Xor": _B,
}.items()}
# The input whose element type the support matrix lists (Where's input 0 is its BOOL condition).
TYPE_INPUT = {"Where": 1}
TRT_TYPE = {"FLOAT": "FP32", "FLOAT16": "FP16", "BFLOAT16": "BF16", "FLOAT8E4M3FN": "FP8",
            "FLOAT4E2M1": "FP4"}
WHY_TYPE = {"INT8": "a quantized type, reached only through QuantizeLinear/DequantizeLinear",
            "INT4": "a quantized type, reached only through QuantizeLinear/DequantizeLinear",
            "FP8": "a quantized type, reached only through QuantizeLinear/DequantizeLinear",
            "UINT8": "UINT8 is only supported as network input or output"}


def _elem_types(model) -> dict[str, str]:
    import onnx

    types = {}
    for graph in subgraphs(model.graph):
        types.update({v.name: v.type.tensor_type.elem_type for v in (*graph.input, *graph.output, *graph.value_info)})
        types.update({t.name: t.data_type for t in graph.initializer})
    names = {name: onnx.TensorProto.DataType.Name(t) for name, t in types.items() if t}  # 0: not inferred
    return {name: TRT_TYPE.get(n, n) for name, n in names.items()}


def _restriction(node, graph_inputs: set[str], graph_outputs: set[str]) -> str | None:
    """The documented limits of the LLM ops beyond their element types."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Attention":
        optional = dict(zip(("past_key", "past_value", "nonpad_kv_seqlen"), node.input[4:7]))
        used = [name for name, tensor in optional.items() if tensor] + \
               [f"output {i}" for i, tensor in enumerate(node.output[1:], 1) if tensor] + \
               [a for a in ("softcap", "qk_matmul_output_mode") if a in attrs and (attrs[a].f or attrs[a].i)]
        if used:
            return (f"the parser does not import {', '.join(used)}; the TensorRT 11 custom op TRT_Attention "
                    "takes per-row lengths as its kv_lengths input instead")
    if node.op_type == "TensorScatter":
        if attrs.get("mode") and attrs["mode"].s == b"circular":
            return "IKVCacheUpdateLayer only has the linear mode"
        if node.input[0] not in graph_inputs or node.output[0] not in graph_outputs:
            return ("IKVCacheUpdateLayer needs the cache to be a network input and its result a network "
                    "output (one device address, updated in place)")
    return None


def unsupported_ops(onnx_path: Path, target: str = DEFAULT_TARGET) -> list[str]:
    """One line per (op, reason) the TensorRT `target` parser rejects in the export, with a count."""
    import onnx

    if target not in TARGETS:
        raise ManifestError(f"unknown TensorRT target {target!r}; known targets: {', '.join(TARGETS)}")
    if not Path(onnx_path).is_file():
        raise ManifestError(f"{onnx_path} is missing; run `python -m export` first")
    # Types come from shape inference; the weights are not needed for that.
    model = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_path), load_external_data=False))
    types = _elem_types(model)
    graph_inputs = {v.name for v in model.graph.input}
    graph_outputs = {v.name for v in model.graph.output}
    problems: Counter = Counter()
    for node in all_nodes(model.graph):
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            problems[op, f"custom domain {node.domain}: needs a TensorRT plugin"] += 1
        elif op not in TYPES:
            problems[op, "not in kvforge's table of parser-supported ops (onnx-tensorrt docs/operators.md)"] += 1
        elif TARGETS.index(ADDED_IN.get(op, TARGETS[0])) > TARGETS.index(target):
            problems[op, f"not imported by the TensorRT {target} parser (added in {ADDED_IN[op]})"] += 1
        else:
            typed = node.input[TYPE_INPUT.get(op, 0)] if node.input else node.output[0]
            bad = [t for t in (types.get(typed), types.get(node.output[0]) if op == "Cast" else None)
                   if t and t not in TYPES[op]]
            if bad:
                why = WHY_TYPE.get(bad[0], f"supported: {', '.join(sorted(TYPES[op]))}")
                if op == "TensorScatter":
                    why += ("; IKVCacheUpdateLayer keeps fp32/fp16/bf16 caches only, "
                            "so this cache is not updated in place")
                problems[op, f"{bad[0]} is not imported ({why})"] += 1
            elif reason := _restriction(node, graph_inputs, graph_outputs):
                problems[op, reason] += 1
    return [f"{op} x{count}: {reason}" for (op, reason), count in sorted(problems.items())]
