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

WEIGHT_MODES = ("fp32", "int8", "int4")
WEIGHT_BITS = {"int8": 8, "int4": 4}
# QMoE's block along the input, where the hidden size and the experts' width divide by it (every
# released MoE). Measured (`python -m bench.moe_ops`: one sparse FFN, hidden 1024, 32 experts of 512,
# top 4, 1 and 2 threads): one decode token took 7.5-8.2x (int8) and 10.6x (int4) longer with one
# scale per row than in blocks of 32, about the fp32 node's time, int4's error 1.4-1.5x larger.
EXPERT_BLOCK = 32
# Max abs logit drift of the built engine from its export (prefill + decode on fixed prompts),
# as a fraction of the export's logit range on the same prompts, so one gate fits random and
# trained weights. fp32 only reorders float math; quantized weights change the model on
# purpose, so their gate only catches a broken build (measured on tiny-llama and stdlib-llama:
# int8 1.1-1.5%, int4 7.9-12.5% of the range; on the random checkpoints of tests/families.py,
# int8 1.8-5.5%, int4 14-28%, Gemma 2 and 3 the most, and int4 33% on a random Gemma 3 of
# bench/families.py's quick shape, hence int4's 0.5).
PARITY_TOLERANCE = {"fp32": 1e-4, "int8": 0.1, "int4": 0.5}
PARITY_PROMPT_LENGTHS = (9, 4)
PARITY_DECODE_STEPS = 8
EXTERNAL_INITIALIZER_BYTES = 1024  # an engine built from weights kept beside the graph keeps them beside its own


def quantize_weights(src: Path, dst: Path, weights: str) -> None:
    """int8: dynamic int8 MatMul (about 2x faster decode on CPU); int4: MatMulNBits with
    accuracy_level 4 (int8 compute), the lm_head included (gemms_as_matmuls). Mixture-of-experts
    layers: quantize_experts, their routers left fp32.

    8-bit MatMulNBits is not offered: at accuracy_level 0 it is ~4x slower, and at level 4
    (block 32, symmetric, lm_head included) small-llama's decode steps took 13-23% longer than
    DynamicQuantizeMatMul's (fastest of 120 steps, 5.85 vs 5.05 ms at 128 context, 7.19 vs 5.85 at
    512) and a 1K prefill 1.9-2.0x longer, for half the logit drift (0.087 vs 0.165)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # Gemms as MatMuls here, for both: quantize_dynamic's own rewrite renames them, and the routers
    # are excluded by name.
    model = gemms_as_matmuls(onnx.load(str(src)))
    routers = quantize_experts(model, WEIGHT_BITS[weights])
    if weights == "int8":
        quantize_dynamic(model, str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"],
                         nodes_to_exclude=routers)
        return
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=True, accuracy_level=4,
                                     nodes_to_exclude=routers)
    quantizer.process()
    quantizer.model.save_model_to_file(str(dst), use_external_data_format=False)


def quantize_experts(model, bits: int, block: int | None = EXPERT_BLOCK) -> list[str]:
    """Each com.microsoft MoE node becomes a QMoE over its experts' weights quantized symmetrically to
    `bits` in blocks of `block` along the input (one fp32 scale per row for None, or where a width does
    not divide: QMoE's column-wise form), its default zero point 2^(bits-1) the symmetric offset; int4 at
    accuracy_level 4 (int8 activations), as MatMulNBits here. Returns the names of the nodes that must
    stay fp32: the routers (the MatMul/Gemm feeding a MoE's router_probs: transformers routes in fp32,
    and a quantized router changes which experts run, not only by how much) and Qwen2-MoE's
    shared-expert gate (the projection feeding a Sigmoid directly, one row of hidden_size weights)."""
    from onnx import helper, numpy_helper

    weights = {t.name: t for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    sparse = [node for node in model.graph.node if (node.domain, node.op_type) == ("com.microsoft", "MoE")]
    keep = [producer[node.input[1]].name for node in sparse]
    if sparse:
        keep += [producer[node.input[0]].name for node in model.graph.node if node.op_type == "Sigmoid"
                 and node.input[0] in producer and producer[node.input[0]].op_type in ("MatMul", "Gemm")]
    for node in sparse:
        fc1, fc2 = (numpy_helper.to_array(weights[name]) for name in (node.input[2], node.input[4]))
        blocked = block is not None and fc1.shape[-1] % block == 0 and fc2.shape[-1] % block == 0
        inputs = list(node.input[:2])
        for name, weight in ((node.input[2], fc1), (node.input[4], fc2)):  # [E, N, K]: gate/up interleaved, down
            packed, scales = quantize_blocks(weight, bits, block if blocked else None)
            model.graph.initializer.remove(weights[name])
            model.graph.initializer.extend([numpy_helper.from_array(packed, name + f".int{bits}"),
                                            numpy_helper.from_array(scales, name + ".scales")])
            inputs += [name + f".int{bits}", name + ".scales", ""]  # weights, scales, no bias
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attributes.update(expert_weight_bits=bits, accuracy_level=4 if bits == 4 else 0,
                          **({"block_size": block} if blocked else {}))
        index = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        model.graph.node.insert(index, helper.make_node("QMoE", inputs[:-1], list(node.output), node.name,
                                                        domain="com.microsoft", **attributes))
    return keep


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


def gemms_as_matmuls(model):
    """Each Gemm x @ W^T of a constant W (the exporter writes the untied lm_head so) as a MatMul
    over W^T stored transposed: MatMulNBitsQuantizer skips Gemm, and an fp32 lm_head is a quarter
    of small-llama's int4 decode reads (decode steps 12-19% faster with it quantized)."""
    import numpy as np
    from onnx import helper, numpy_helper

    weights = {i.name: i for i in model.graph.initializer}
    for index, node in enumerate(list(model.graph.node)):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "Gemm" or len(node.input) != 2 or node.input[1] not in weights or \
                (attributes.get("transA", 0), attributes.get("transB", 0), attributes.get("alpha", 1.0)) != (0, 1, 1.0):
            continue
        weight = weights[node.input[1]]
        transposed = numpy_helper.from_array(np.ascontiguousarray(numpy_helper.to_array(weight).T),
                                             weight.name + ".transposed")
        model.graph.initializer.append(transposed)
        model.graph.node.remove(node)
        model.graph.node.insert(index, helper.make_node("MatMul", [node.input[0], transposed.name], list(node.output),
                                                        node.name))
        if not any(weight.name in n.input for n in model.graph.node):
            model.graph.initializer.remove(weight)
    return model


def optimize(src: Path, dst: Path, threads: int) -> None:
    """Apply ORT's graph optimizations once and save the result, so sessions start fast.
    'Extended' keeps the saved graph portable across CPUs; hardware-specific layout
    transforms (level 'all') are re-applied when a session loads it."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(dst)
    if has_external_data(src):
        # otherwise the saved graph points at the export's weights file by its relative name,
        # which the engine directory does not hold
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", dst.name + ".data")
        opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                      str(EXTERNAL_INITIALIZER_BYTES))
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    ort.InferenceSession(str(src), opts, providers=["CPUExecutionProvider"])


def has_external_data(path: Path) -> bool:
    """Whether the ONNX file keeps (some of) its weights in a file beside it (the export does above 1 GiB)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def parity_drift(export_dir: Path, engine_dir: Path) -> tuple[float, float]:
    """(max abs logit difference, logit range of the export) on a fixed prefill (every position,
    as scoring asks) + decode."""
    from runtime.greedy import Greedy
    from runtime.runners import open_runner

    manifest = Manifest.load(export_dir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, manifest.model.vocab_size, n).tolist() for n in PARITY_PROMPT_LENGTHS]
    runs = [Greedy(open_runner(d), prompts, PARITY_DECODE_STEPS) for d in (export_dir, engine_dir)]
    outs = [run.prefill() for run in runs]
    expected, built = (np.concatenate([out[r, :len(p)] for r, p in enumerate(prompts)]) for out in outs)
    drift, low, high = float(np.abs(expected - built).max()), float(expected.min()), float(expected.max())
    for _ in range(PARITY_DECODE_STEPS):
        tokens = runs[0].next_tokens  # both follow the export's tokens
        outs = [run.step(tokens) for run in runs]
        drift = max(drift, float(np.abs(outs[0] - outs[1]).max()))
        low, high = min(low, float(outs[0].min())), max(high, float(outs[0].max()))
    return drift, high - low


def build(export_dir: Path, out_dir: Path, manifest: Manifest, weights: str = "fp32",
          threads: int | None = None, progress=None) -> dict:
    """Write the engine into out_dir (a fresh directory) and return the manifest's engine section."""
    import onnxruntime as ort

    if weights not in WEIGHT_MODES:
        raise ManifestError(f"unknown weight mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
    threads = threads or os.cpu_count() or 1
    started = time.perf_counter()
    source = export_dir / manifest.onnx_file
    if weights != "fp32":
        with progress(f"quantizing weights to {weights}"):
            quantize_weights(source, out_dir / "quantized.onnx", weights)
            source = out_dir / "quantized.onnx"
    with progress(f"applying ONNX Runtime graph optimizations ({threads} threads)"):
        optimize(source, out_dir / MODEL_FILE, threads)
    (out_dir / "quantized.onnx").unlink(missing_ok=True)
    for name in manifest.tokenizer.get("files", []):
        shutil.copy2(export_dir / name, out_dir / name)
    engine = {"backend": "onnxruntime", "file": MODEL_FILE, "onnxruntime_version": ort.__version__,
              "graph_optimization": "extended (saved) + all (at load)", "weights": weights, "threads": threads,
              "size_bytes": sum(f.stat().st_size for f in out_dir.iterdir() if f.suffix in (".onnx", ".data"))}
    Manifest(**{**manifest.__dict__, "engine": engine}).save(out_dir)
    with progress("parity gate: engine vs export logits"):
        drift, logit_range = parity_drift(export_dir, out_dir)
    tolerance = PARITY_TOLERANCE[weights] * logit_range
    if not drift <= tolerance:
        raise ManifestError(f"parity gate failed: engine logits drift {drift:.3g} from the export, over the "
                            f"{tolerance:.3g} allowed for {weights} weights ({PARITY_TOLERANCE[weights]:g} "
                            f"of the logit range {logit_range:.3g})")
    engine.update(parity_max_abs_diff=drift, parity_tolerance=tolerance, parity_logit_range=logit_range,
                  build_seconds=round(time.perf_counter() - started, 2))
    return engine
