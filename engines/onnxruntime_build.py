"""Build an ONNX Runtime engine from an export: optional weight quantization, graph
optimizations applied offline and saved, threads chosen for this host, and a parity gate
against the export it came from."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from kvforge.manifest import MODEL_FILE, Manifest, ManifestError
from kvforge.onnx_weights import INLINE_BYTES, WeightWriter, read_weight

WEIGHT_MODES = ("fp32", "fp16", "int8", "int4")
WEIGHT_BITS = {"int8": 8, "int4": 4}
# QMoE's block along the input, where the hidden size and the experts' width divide by it (every
# released MoE). Measured (`python -m bench.moe_ops`: one sparse FFN, hidden 1024, 32 experts of 512,
# top 4, 1 and 2 threads): one decode token took 7.5-8.2x (int8) and 10.6x (int4) longer with one
# scale per row than in blocks of 32, about the fp32 node's time, int4's error 1.4-1.5x larger.
EXPERT_BLOCK = 32
# ONNX Runtime 1.32's CPU provider registers MatMul and Gemm for float and double only: float16
# weights run through the Casts its optimizer inserts (matmul_replacement), bfloat16 not at all.
BF16_REFUSAL = ("ONNX Runtime's CPU provider has no bfloat16 MatMul; use fp16, int8 or int4, or the TensorRT "
                "backend for bf16 (--backend tensorrt --precision bf16)")
# Max abs logit drift of the built engine from its export (prefill + decode on fixed prompts),
# as a fraction of the export's logit range on the same prompts, so one gate fits random and
# trained weights. fp32 only reorders float math; quantized weights change the model on
# purpose, so their gate only catches a broken build (measured on tiny-llama and stdlib-llama:
# int8 1.1-1.5%, int4 7.9-12.5% of the range; on the random checkpoints of tests/families.py,
# int8 1.8-5.5%, int4 14-28%, Gemma 2 and 3 the most, and int4 33% on a random Gemma 3 of
# bench/families.py's quick shape, hence int4's 0.5). fp16 rounds each weight to 11 significant
# bits (measured by building fp16 engines: tiny-llama 0.024%, small-llama 0.043%, the random checkpoints
# of tests/families.py 0.031-0.088%, Gemma 2 and 3 the most; 0 on stdlib-llama, saved as float16),
# so its gate is 11x the largest and still under int8's drift.
PARITY_TOLERANCE = {"fp32": 1e-4, "fp16": 0.01, "int8": 0.1, "int4": 0.5}
PARITY_PROMPT_LENGTHS = (9, 4)
PARITY_DECODE_STEPS = 8


class EngineWeights:
    """The initializers of a model being rewritten: read where they are (in the graph, or mapped
    from the export's data file), new ones written to the engine's data file as they are made, so
    a build holds one tensor (and its quantized form) at a time. writer None: new ones stay in the
    graph (an in-memory model, bench.moe_ops)."""

    def __init__(self, model, source_dir: Path | None = None, writer: WeightWriter | None = None):
        self.model, self.source_dir, self.writer = model, source_dir, writer
        self.tensors = {t.name: t for t in model.graph.initializer}
        self.written: set[str] = set()

    def array(self, name: str) -> np.ndarray:
        return read_weight(self.source_dir, self.tensors[name])

    def put(self, name: str, array: np.ndarray) -> None:
        from onnx import numpy_helper

        array = np.require(array, requirements="C")  # (ascontiguousarray makes a scalar 1-D)
        tensor = self.writer.add(name, array) if self.writer else numpy_helper.from_array(array, name)
        self.model.graph.initializer.append(tensor)
        self.tensors[name] = tensor
        self.written.add(name)

    def finish(self) -> None:
        """Drop the initializers no node reads any more; copy the export's others into the engine's file."""
        from kvforge.onnx_graphs import all_nodes

        used = {name for node in all_nodes(self.model.graph) for name in node.input}
        for tensor in list(self.model.graph.initializer):
            if tensor.name not in used:
                self.model.graph.initializer.remove(tensor)
            elif self.writer and tensor.name not in self.written:
                array = np.array(self.array(tensor.name))
                self.model.graph.initializer.remove(tensor)
                self.model.graph.initializer.append(self.writer.add(tensor.name, array))


def quantize_weights(src: Path, dst: Path, weights: str) -> None:
    """fp16: each projection's weight stored float16, its MatMul between Casts (half the engine
    file; ONNX Runtime's CPU provider widens the weights to fp32 when it loads them, so memory and
    speed stay fp32's: docs/export-and-engines.md); int8: DynamicQuantizeMatMul,
    int8 weights with one scale per output column (about 2x faster decode on CPU); int4: MatMulNBits
    in blocks of 32 at accuracy_level 4 (int8 compute). Every projection is converted, the lm_head
    included; the embedding table stays fp32 (a Gather reads a few rows of it per step, so its bytes
    cost a decode step nothing). Mixture-of-experts layers: the routers stay fp32; the experts become
    QMoE for int8/int4 (quantize_experts) and stay in the fp32 MoE node for fp16. One tensor at a
    time (EngineWeights): a 7-8B export builds in a few GiB.

    8-bit MatMulNBits is not offered: at accuracy_level 0 it is ~4x slower, and at level 4
    (block 32, symmetric, lm_head included) small-llama's decode steps took 13-23% longer than
    DynamicQuantizeMatMul's (fastest of 120 steps, 5.85 vs 5.05 ms at 128 context, 7.19 vs 5.85 at
    512) and a 1K prefill 1.9-2.0x longer, for half the logit drift (0.087 vs 0.165)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    with WeightWriter(dst) as writer:
        store = EngineWeights(model, src.parent, writer)
        keep = set(routing_projections(model))
        if weights in WEIGHT_BITS:
            quantize_experts(model, WEIGHT_BITS[weights], EXPERT_BLOCK, store)
        quantize_matmuls(model, weights, keep, store)
        store.finish()
    onnx.save(model, str(dst))


def quantize_matmuls(model, weights: str, keep: set[str], store: EngineWeights) -> None:
    """Each MatMul x @ W (and Gemm x @ W^T: the untied lm_head's) of a constant 2-D W, in any
    subgraph, but the nodes named in keep, becomes matmul_replacement's nodes for `weights` over W's
    converted form (convert_matrix; a Gemm's W^T, so every mode sees W as [K, N])."""
    from onnx import helper

    from kvforge.onnx_graphs import subgraphs

    converted: dict[str, list[str]] = {}  # a weight read by several nodes is converted once
    for graph in subgraphs(model.graph):
        for index in reversed(range(len(graph.node))):  # backwards: a replacement may be several nodes
            node = graph.node[index]
            attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            gemm = node.op_type == "Gemm" and len(node.input) == 2 and \
                (attributes.get("transA", 0), attributes.get("transB", 0), attributes.get("alpha", 1.0)) == (0, 1, 1.0)
            weight = node.input[1] if len(node.input) > 1 else ""
            if not (node.op_type == "MatMul" or gemm) or node.name in keep or weight not in store.tensors \
                    or len(store.tensors[weight].dims) != 2:
                continue
            key = weight + (".transposed" if gemm else "")
            if key not in converted:
                w = store.array(weight)
                converted[key] = convert_matrix(store, key, w.T if gemm else w, weights)
            k, n = store.tensors[weight].dims[::-1] if gemm else store.tensors[weight].dims
            del graph.node[index]
            for offset, new in enumerate(matmul_replacement(node, converted[key], k, n, weights)):
                graph.node.insert(index + offset, new)


def matmul_replacement(node, weight_inputs: list[str], k: int, n: int, weights: str) -> list:
    """The nodes computing node's x @ W from W's converted inputs. int8: com.microsoft
    DynamicQuantizeMatMul (W int8 [K, N], symmetric, a scale per column, no zero point); int4:
    MatMulNBits (W^T in blocks of 32 along K, zero-padded to whole blocks, symmetric: the default
    zero point 8); fp16: a float16 MatMul between Casts, so x and y stay fp32 for the rest of the
    graph, as a provider with a float16 MatMul runs it (the CPU provider has none: its optimizer
    drops the Casts of x and y and casts W to fp32 instead, folded at load)."""
    from onnx import TensorProto, helper

    x, y = node.input[0], node.output[0]
    if weights == "fp16":
        return [helper.make_node("Cast", [x], [y + ".x_fp16"], node.name + ".cast_fp16", to=TensorProto.FLOAT16),
                helper.make_node("MatMul", [y + ".x_fp16", *weight_inputs], [y + ".fp16"], node.name),
                helper.make_node("Cast", [y + ".fp16"], [y], node.name + ".cast_fp32", to=TensorProto.FLOAT)]
    if weights == "int8":
        return [helper.make_node("DynamicQuantizeMatMul", [x, *weight_inputs], [y], node.name, domain="com.microsoft")]
    return [helper.make_node("MatMulNBits", [x, *weight_inputs], [y], node.name, domain="com.microsoft",
                             K=k, N=n, bits=4, block_size=EXPERT_BLOCK, accuracy_level=4)]


def convert_matrix(store: EngineWeights, name: str, w: np.ndarray, weights: str) -> list[str]:
    """W [K, N] as matmul_replacement's weight inputs, put in the store; returns their names."""
    if weights == "fp16":
        top = float(np.abs(w).max(initial=0))
        if not top <= np.finfo(np.float16).max:
            raise ManifestError(f"fp16 weights: {name} holds {top:.4g}, beyond float16's largest value "
                                f"{np.finfo(np.float16).max:g}; build with fp32, int8 or int4 weights")
        store.put(name + ".fp16", w.astype(np.float16))
        return [name + ".fp16"]
    if weights == "int8":
        scale = np.abs(w).max(axis=0) / 127
        scale[scale == 0] = 1.0
        store.put(name + ".int8", np.clip(np.round(w / scale), -127, 127).astype(np.int8))
        store.put(name + ".scale", scale.astype(np.float32))
        return [name + ".int8", name + ".scale"]  # no zero point: symmetric
    wt = np.ascontiguousarray(w.T)  # [N, K]: MatMulNBits' blocks run along K for each output
    if wt.shape[1] % EXPERT_BLOCK:
        wt = np.pad(wt, ((0, 0), (0, -wt.shape[1] % EXPERT_BLOCK)))
    packed, scales = quantize_blocks(wt[None], 4, EXPERT_BLOCK)
    store.put(name + ".int4", packed[0].reshape(wt.shape[0], -1, EXPERT_BLOCK // 2))
    store.put(name + ".scales", scales[0].reshape(-1))
    return [name + ".int4", name + ".scales"]


def routing_projections(model) -> list[str]:
    """The names of the projections every weight mode leaves fp32: the routers (the MatMul/Gemm
    nearest upstream of a MoE's router_probs, through DeepSeek's routing ops: transformers routes in
    fp32, and a converted router changes which experts run, not only by how much; DeepSeek-V3's bias
    is an Add, never converted) and Qwen2-MoE's shared-expert gate (the projection feeding a Sigmoid
    directly, one row of hidden_size weights)."""
    producer = {out: node for node in model.graph.node for out in node.output}
    sparse = [node for node in model.graph.node if (node.domain, node.op_type) == ("com.microsoft", "MoE")]
    keep = [name for node in sparse for name in routers(node, producer)]
    if sparse:
        keep += [producer[node.input[0]].name for node in model.graph.node if node.op_type == "Sigmoid"
                 and node.input[0] in producer and producer[node.input[0]].op_type in ("MatMul", "Gemm")]
    return keep


def quantize_experts(model, bits: int, block: int | None = EXPERT_BLOCK, store: EngineWeights | None = None) -> None:
    """Each com.microsoft MoE node becomes a QMoE over its experts' weights quantized symmetrically to
    `bits` in blocks of `block` along the input (one fp32 scale per row for None, or where a width does
    not divide: QMoE's column-wise form), its default zero point 2^(bits-1) the symmetric offset; int4 at
    accuracy_level 4 (int8 activations), as MatMulNBits here. Their routers are routing_projections'.
    store None: an in-memory model (bench.moe_ops)."""
    from onnx import helper

    in_memory = store is None
    store = store or EngineWeights(model)
    sparse = [node for node in model.graph.node if (node.domain, node.op_type) == ("com.microsoft", "MoE")]
    for node in sparse:
        widths = [store.tensors[name].dims[-1] for name in (node.input[2], node.input[4])]
        blocked = block is not None and all(width % block == 0 for width in widths)
        inputs = list(node.input[:2])
        for name in (node.input[2], node.input[4]):  # [E, N, K]: gate/up interleaved, down
            packed, scales = quantize_blocks(store.array(name), bits, block if blocked else None)
            store.put(name + f".int{bits}", packed)
            store.put(name + ".scales", scales)
            inputs += [name + f".int{bits}", name + ".scales", ""]  # weights, scales, no bias
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attributes.update(expert_weight_bits=bits, accuracy_level=4 if bits == 4 else 0,
                          **({"block_size": block} if blocked else {}))
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        model.graph.node.insert(index, helper.make_node("QMoE", inputs[:-1], list(node.output), node.name,
                                                        domain="com.microsoft", **attributes))
    if in_memory:
        store.finish()


def routers(node, producer: dict) -> list[str]:
    """The MatMul/Gemm nodes nearest upstream of a MoE node's router_probs: the projection itself
    for softmax routing, behind DeepSeek's routing ops (TopK, ScatterElements, ...) otherwise. Shapes
    are not followed: they read no values (and lead back through the block's input to attention)."""
    found, seen, pending = [], set(), [node.input[1]]
    while pending:
        step = producer.get(pending.pop())
        if step is None or id(step) in seen or step.op_type == "Shape":
            continue
        seen.add(id(step))
        if step.op_type in ("MatMul", "Gemm"):
            found.append(step.name)
        else:
            pending.extend(step.input)
    return found


def quantize_blocks(weight: np.ndarray, bits: int, block: int | None) -> tuple[np.ndarray, np.ndarray]:
    """[E, N, K] fp32 -> (uint8 [E, N, K * bits / 8] with offset 2^(bits-1), two 4-bit values per byte
    low nibble first; fp32 scales [E, N, K / block], or [E, N] for block None: one per row): symmetric,
    the max |w| of each block at the top level."""
    if bits == 4 and weight.shape[-1] % 2:
        raise ManifestError(f"int4 experts pack two weights per byte: a width of {weight.shape[-1]} is odd")
    top = 2 ** (bits - 1) - 1
    blocks = weight.reshape(*weight.shape[:-1], -1, block or weight.shape[-1])
    scales = np.abs(blocks).max(axis=-1) / top
    scales[scales == 0] = 1.0
    q = (np.clip(np.round(blocks / scales[..., None]), -top - 1, top) + 2 ** (bits - 1)).astype(np.uint8)
    q = q.reshape(weight.shape)
    if bits == 4:
        q = q[..., 0::2] | (q[..., 1::2] << 4)
    scales = scales if block else scales[..., 0]
    return np.ascontiguousarray(q), scales.astype(np.float32)


def optimize(src: Path, dst: Path, threads: int) -> None:
    """Apply ORT's graph optimizations once and save the result, so sessions start fast.
    'Extended' keeps the saved graph portable across CPUs; hardware-specific layout
    transforms (level 'all') are re-applied when a session loads it. The weights go to the
    engine's own data file (the saved graph would otherwise point at the export's)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(dst)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", str(INLINE_BYTES))
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])


def parity_drift(export_dir: Path, engine_dir: Path) -> tuple[float, float]:
    """(max abs logit difference, logit range of the export) on a fixed prefill (every position,
    as scoring asks) + decode, the engine fed the export's greedy tokens. One session at a time:
    a 7-8B build never holds the export's and the engine's weights together."""
    from runtime.greedy import Greedy
    from runtime.runners import open_runner

    manifest = Manifest.load(export_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, manifest.model.vocab_size, n).tolist() for n in PARITY_PROMPT_LENGTHS]

    def run(directory: Path, tokens: list[np.ndarray] | None) -> list[np.ndarray]:
        greedy = Greedy(open_runner(directory), prompts, PARITY_DECODE_STEPS)
        out = greedy.prefill()
        logits = [np.concatenate([out[r, :len(p)] for r, p in enumerate(prompts)])]
        for step in range(PARITY_DECODE_STEPS):
            logits.append(greedy.step(None if tokens is None else tokens[step]))
        return logits

    expected = run(export_dir, None)
    followed = [row.argmax(-1) for row in expected[1:]]  # the export's token after each step
    tokens = [expected[0][np.cumsum(PARITY_PROMPT_LENGTHS) - 1].argmax(-1)] + followed[:-1]
    built = run(engine_dir, tokens)
    drift = max(float(np.abs(a - b).max()) for a, b in zip(expected, built))
    low, high = min(float(a.min()) for a in expected), max(float(a.max()) for a in expected)
    return drift, high - low


def build(export_dir: Path, out_dir: Path, manifest: Manifest, weights: str = "fp32",
          threads: int | None = None, progress=None) -> dict:
    """Write the engine into out_dir (a fresh directory) and return the manifest's engine section.
    The parity gate runs the export and the engine; for an export with a parity slice (a 7-8B
    model: export/__main__.py), the slice and an engine built from it the same way, and says so."""
    if weights == "bf16":
        raise ManifestError(f"bf16 weights: {BF16_REFUSAL}")
    if weights not in WEIGHT_MODES:
        raise ManifestError(f"unknown weight mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    threads = threads or os.cpu_count() or 1
    started = time.perf_counter()
    engine = compile_engine(export_dir, out_dir, manifest, weights, threads, progress)
    gate_export, gate_engine, scope = export_dir, out_dir, "the whole model"
    piece = manifest.source.get("parity_slice")
    if piece:
        gate_export, gate_engine = export_dir / piece["directory"], out_dir / piece["directory"]
        scope = f"the first {piece['layers']} of {manifest.model.num_layers} layers (the export's parity slice)"
        gate_engine.mkdir()
        compile_engine(gate_export, gate_engine, Manifest.load(gate_export), weights, threads, progress)
    with progress(f"parity gate on {scope}: engine vs export logits"):
        drift, logit_range = parity_drift(gate_export, gate_engine)
    if piece:
        shutil.rmtree(gate_engine)
    tolerance = PARITY_TOLERANCE[weights] * logit_range
    if not drift <= tolerance:
        raise ManifestError(f"parity gate failed: engine logits drift {drift:.3g} from the export, over the "
                            f"{tolerance:.3g} allowed for {weights} weights ({PARITY_TOLERANCE[weights]:g} "
                            f"of the logit range {logit_range:.3g}), on {scope}")
    engine.update(parity_max_abs_diff=drift, parity_tolerance=tolerance, parity_logit_range=logit_range,
                  parity_scope=scope, build_seconds=round(time.perf_counter() - started, 2))
    return engine


def compile_engine(export_dir: Path, out_dir: Path, manifest: Manifest, weights: str, threads: int,
                   progress) -> dict:
    """Quantize and optimize the export into out_dir, with its tokenizer and manifest."""
    import onnxruntime as ort

    source = export_dir / manifest.onnx_file
    if weights != "fp32":
        with progress(f"quantizing weights to {weights}, a tensor at a time"):
            quantize_weights(source, out_dir / "quantized.onnx", weights)
            source = out_dir / "quantized.onnx"
    with progress(f"applying ONNX Runtime graph optimizations ({threads} threads)"):
        optimize(source, out_dir / MODEL_FILE, threads)
    for name in ("quantized.onnx", "quantized.onnx.data"):
        (out_dir / name).unlink(missing_ok=True)
    for name in manifest.tokenizer.get("files", []):
        shutil.copy2(export_dir / name, out_dir / name)
    engine = {"backend": "onnxruntime", "file": MODEL_FILE, "onnxruntime_version": ort.__version__,
              "graph_optimization": "extended (saved) + all (at load)", "weights": weights, "threads": threads,
              "size_bytes": sum(f.stat().st_size for f in out_dir.iterdir() if f.suffix in (".onnx", ".data"))}
    Manifest(**{**manifest.__dict__, "engine": engine}).save(out_dir)
    return engine
