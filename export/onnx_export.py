"""Trace the decoder to ONNX with the cache tensors the manifest names, in its layout and dtype."""
from __future__ import annotations

import logging
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxscript.optimizer
import torch

from kvforge.manifest import OPSET, Manifest, ManifestError, TensorSpec
from export.checkpoint import CheckpointWeights
from export.model import CausalLM
from kvforge.onnx_weights import WeightWriter

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "int8": torch.int8,
                "uint8": torch.uint8, "int64": torch.int64, "float8e4m3fn": torch.float8_e4m3fn}
# Sizes of the example inputs; each dim is exported as dynamic, so these only need to differ.
EXAMPLE_SIZES = {"batch": 2, "seq": 3, "tokens": 6, "kept": 4, "past": 5, "total": 8, "capacity": 16, "ring_past": 5}
# An in-place step of the example sizes: row 0 a 3-token chunk at 0, row 1 one decode token at 7
# (tokens 4-5 unused), chunk rows P = 1 over L = 3 positions, decode queries over D = 8; token_slots
# index [3 chunk, 2 decode].
EXAMPLE_STEP = {"positions": [0, 1, 2, 7, 8, 9], "write_positions": [0, 7], "row_tokens": [[0, 1, 2], [3, 0, 0]],
                "attention_extent": [1, 3, 8], "token_slots": [0, 1, 2, 4, 4, 4], "logit_index": [2, 3, 0, 1]}
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


def export_onnx(model: CausalLM, manifest: Manifest, path: Path, weights: CheckpointWeights) -> None:
    """Trace `model` (its parameters need only their shapes: export.checkpoint.skeleton), then write
    the checkpoint's weights beside the graph a decoder layer at a time (write_weights)."""
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
            optimize=False, verbose=False, report=False)
    # The parameters become graph inputs while the graph is optimized, so that nothing reads their
    # (unwritten) values: what the export does to weights (the Concat of q/k/v and gate/up, the
    # Transpose of every Linear) stays as nodes over them, for write_weights to run per layer.
    graph = program.model.graph
    canonical: dict[int, str] = {}  # a tied lm_head is the embedding table: one initializer
    for name, parameter in model.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(parameter), name)
        if first != name and name in graph.initializers and first in graph.initializers:
            ir.convenience.replace_all_uses_with(graph.initializers.pop(name), graph.initializers[first])
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    for name in [name for name in graph.initializers if name in parameters]:
        value = graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)
    unwritten = {parameter.data_ptr() for parameter in model.parameters()}
    for name, value in graph.initializers.items():  # a parameter under a name of the exporter's own
        raw = getattr(value.const_value, "raw", None)
        if isinstance(raw, torch.Tensor) and raw.data_ptr() in unwritten:
            raise ManifestError(f"the exporter names a parameter {name!r}; no checkpoint tensor is known by that name")
    program.optimize()
    # and what else is constant (RoPE tables and the like) folded whatever its size (the optimizer stops at 256K elements)
    onnxscript.optimizer.fold_constants(program.model, input_size_limit=FOLD_LIMIT, output_size_limit=FOLD_LIMIT)
    onnxscript.optimizer.remove_unused_nodes(program.model)
    proto = ir.serde.serialize_model(program.model)
    write_weights(proto, path, weights)
    _name_symbolic_dims(proto, inputs, outputs)
    onnx.save(proto, str(path))


def write_weights(proto: onnx.ModelProto, path: Path, weights: CheckpointWeights) -> None:
    """Replace the weight inputs and the nodes computing only from them with initializers in
    path's data file (where the graph's other large constants go too), computed one group of
    export.checkpoint.CheckpointWeights at a time: the
    process holds about one decoder layer's weights twice (as read, as transformed), whatever
    the model's size. Every consumer then sees MatMul(x, W) with W one initializer: the weight
    quantizer, TensorRT's weight cast and the op check."""
    graph = proto.graph
    group_of = {name: i for i, names in enumerate(weights.groups()) for name in names}
    sources = [value.name for value in graph.input if value.name in group_of]
    constants = {t.name: t for t in graph.initializer}
    derived, transforms = set(sources), []
    for node in graph.node:  # in topological order
        names = [name for name in node.input if name]
        if any(name in derived for name in names) and all(name in derived or name in constants for name in names):
            transforms.append(node)
            derived.update(node.output)
    transform_ids = {id(node) for node in transforms}
    kept = [node for node in graph.node if id(node) not in transform_ids]
    used = {name for node in kept for name in node.input} | \
        {name for node in kept for name in _subgraph_inputs(node)} | {value.name for value in graph.output}
    producer = {out: node for node in transforms for out in node.output}
    wanted: dict[int, list[str]] = {}  # group -> the values the graph reads, in graph order
    for name in [n for n in sources + [o for t in transforms for o in t.output] if n in used]:
        wanted.setdefault(max(group_of[s] for s in _weight_sources(name, producer, group_of)), []).append(name)
    with WeightWriter(path) as writer:
        for index, tensor in enumerate(graph.initializer):  # the folded constants (RoPE tables and the like)
            graph.initializer[index].CopyFrom(writer.add(tensor.name, onnx.numpy_helper.to_array(tensor)))
        for group in sorted(wanted):
            names = wanted[group]
            needed = sorted({s for name in names for s in _weight_sources(name, producer, group_of)})
            feeds = {name: tensor.numpy() for name, tensor in weights.read(needed).items()}
            values = _evaluate(names, feeds, producer, constants)
            graph.initializer.extend(writer.add(name, values[name]) for name in names)
            del feeds, values
    del graph.node[:]
    graph.node.extend(kept)
    remaining = [value for value in graph.input if value.name not in group_of]
    del graph.input[:]
    graph.input.extend(remaining)


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names the node's subgraphs (If branches) read from the enclosing graph."""
    from kvforge.onnx_graphs import all_nodes

    names = set()
    for attribute in node.attribute:
        for sub in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
            names.update(name for inner in all_nodes(sub) for name in inner.input)
    return names


def _weight_sources(name: str, producer: dict, group_of: dict) -> set[str]:
    if name in group_of:
        return {name}
    return set().union(*(_weight_sources(i, producer, group_of) for i in producer[name].input if i in group_of
                         or i in producer))


def _evaluate(names: list[str], feeds: dict, producer: dict, constants: dict) -> dict:
    """The values `names` from the weights in feeds, by the export's own nodes (numpy reference ops)."""
    from onnx.reference import ReferenceEvaluator

    nodes, seen = [], set()

    def visit(name: str) -> None:
        node = producer.get(name)
        if node is None or id(node) in seen:
            return
        seen.add(id(node))
        for i in node.input:
            visit(i)
        nodes.append(node)

    computed = [name for name in names if name in producer]
    for name in computed:
        visit(name)
    if not computed:
        return feeds
    used = {i for node in nodes for i in node.input}
    graph = onnx.helper.make_graph(
        nodes, "weights", [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in feeds],
        [onnx.helper.make_value_info(n, onnx.TypeProto()) for n in computed],
        [constants[n] for n in used if n in constants])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", OPSET)])
    return {**feeds, **dict(zip(computed, ReferenceEvaluator(model).run(computed, feeds)))}


def _name_symbolic_dims(proto: onnx.ModelProto, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """Give graph I/O the manifest's dim names (the exporter invents s0, s1, ...)."""
    specs = {t.name: t for t in inputs + outputs}
    for value in list(proto.graph.input) + list(proto.graph.output):
        spec = specs[value.name]
        for dim, want in zip(value.type.tensor_type.shape.dim, spec.shape):
            if isinstance(want, str):
                dim.ClearField("dim_value")
                dim.dim_param = want
