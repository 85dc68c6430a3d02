"""Build a TensorRT plan from an export with the TensorRT Python API (GPU hosts only).

Written from the TensorRT 10.15 / 11.0 documentation and never run in this project's CI, which
has neither TensorRT nor a GPU: there build() refuses with one line. What runs everywhere is the
ONNX preparation (weight precision, pinned cache capacity) and the profile arithmetic.

- Strongly typed network (required from TensorRT 11, opt-in flag on 10.x): the ONNX types decide
  each layer's precision, so fp16/bf16 is applied to the ONNX before parsing, not by builder flags
  (NVIDIA documents ModelOpt AutoCast for this; it installs from NVIDIA's own index).
  Only the weights of MatMul and Gather (and those ops) go to low precision; norms, rotary and the
  KV cache keep the exported types (the cache must stay the exact network input to be updated in place).
- The inplace cache capacity is pinned to manifest.max_seq_len: the KVCacheUpdate operator needs
  the cache as a network input with a static sequence dimension, so one plan cannot hold capacity
  buckets as profiles, and one plan per bucket would hold every weight once per bucket.
- Only fp32/fp16 caches are built (manifest runs_on): KVCacheUpdate takes float32/float16/bfloat16
  caches only, so an int8/fp8 cache cannot be updated in place (TensorRT docs, operators/KVCacheUpdate).
- One optimization profile: batch 1..max_slots, new tokens 1..max_new_tokens (tuned for decode,
  seq 1), logit positions 1..max_new_tokens (tuned for generation's one per row); concat also past and total, with past + seq = total at min, opt and max so the network
  is consistent at the shapes TensorRT plans for; that caps the concat past at
  max_seq_len - max_new_tokens.
- A persisted timing cache (loaded when present, saved after) makes rebuilds fast.
Before building, engines/trt_ops.py lists what the running parser is documented to reject (an
fp32/fp16 export imports whole from 10.15, whose parser added RMSNormalization, RotaryEmbedding
and TensorScatter).
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

from engines import trt_ops
from engines.onnxruntime_build import EngineWeights
from kvforge.cli import progress as cli_progress
from kvforge.manifest import Manifest, ManifestError
from kvforge.onnx_weights import WeightWriter, save_graph
from kvforge.tensorrt_host import capturing_logger, missing_requirement, platform

PLAN_FILE = "model.plan"
PRECISIONS = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}
WEIGHT_INPUT = {"MatMul": 1, "Gather": 0}  # the input that holds the weight in each op
DEFAULT_SLOTS = 8
DEFAULT_NEW_TOKENS = 512
TIMING_CACHE_DIR = Path("build/tensorrt")  # a cache only serves the TensorRT version and GPU that wrote it


def cast_weights(model: onnx.ModelProto, precision: str, store: EngineWeights | None = None) -> onnx.ModelProto:
    """Store fp32 weights used only as MatMul/Gather weights in `precision` (rounded to nearest even,
    as ml_dtypes casts) and run those ops in it: Cast the activation in, Cast the result back to
    fp32. Everything else keeps its type. store: where the weights are read and written, a tensor
    at a time (prepare_onnx); None: a model held in memory whole."""
    if precision not in PRECISIONS:
        raise ManifestError(f"unknown TensorRT precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    store = store or EngineWeights(model)
    graph, low = model.graph, PRECISIONS[precision]
    uses: dict[str, list] = {}
    for node in graph.node:
        for slot, name in enumerate(node.input):
            uses.setdefault(name, []).append(WEIGHT_INPUT.get(node.op_type) == slot)
    weights = {t.name: f"{t.name}/{precision}" for t in graph.initializer
               if precision != "fp32" and t.data_type == TensorProto.FLOAT and all(uses.get(t.name, [False]))}
    dtype = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16}.get(precision)
    for name, converted in weights.items():
        array = store.array(name)
        store.put(converted, (np.clip(array, -65504, 65504) if precision == "fp16" else array).astype(dtype))
    for value in list(graph.value_info):  # the exporter also types the initializers there
        if value.name in weights:
            graph.value_info.remove(value)
    nodes, cast = [], set()
    for node in graph.node:
        slot = WEIGHT_INPUT.get(node.op_type)
        if slot is not None and node.input[slot] in weights:
            node.input[slot] = weights[node.input[slot]]
            if node.op_type == "MatMul":
                activation = node.input[0]
                if activation not in cast:  # q/k/v and gate/up projections share their input
                    cast.add(activation)
                    nodes.append(helper.make_node("Cast", [activation], [f"{activation}/{precision}"], to=low))
                node.input[0] = f"{activation}/{precision}"
            result = node.output[0]
            node.output[0] = f"{result}/{precision}"
            nodes += [node, helper.make_node("Cast", [node.output[0]], [result], to=TensorProto.FLOAT)]
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    store.finish()  # the fp32 originals go; with a writer, every other weight is copied beside the graph
    return model


def prepare_onnx(source: Path, prepared: Path, precision: str, capacity: int | None) -> None:
    """The export at `source` as TensorRT parses it, written to `prepared` and its data file a tensor
    at a time (a 7-8B export is never in memory whole): weights in `precision`, and for the in-place
    layout the cache's capacity pinned."""
    model = onnx.load(str(source), load_external_data=False)
    with WeightWriter(prepared) as writer:
        cast_weights(model, precision, EngineWeights(model, source.parent, writer))
    if capacity is not None:
        pin_capacity(model, capacity)
    save_graph(model, prepared)


def pin_capacity(model: onnx.ModelProto, capacity: int) -> onnx.ModelProto:
    """Make the cache's `capacity` dim static on every graph input and output."""
    for value in (*model.graph.input, *model.graph.output):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param == "capacity":
                dim.dim_value = capacity
    return model


def profile_shapes(manifest: Manifest, max_slots: int = DEFAULT_SLOTS,
                   max_new_tokens: int = DEFAULT_NEW_TOKENS) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shape of every engine input for the single optimization profile."""
    longest, new = manifest.max_seq_len, min(max_new_tokens, manifest.max_seq_len)
    ranges = {"batch": (1, max_slots, max_slots), "seq": (1, 1, new), "kept": (1, max_slots, max_slots * new),
              "tokens": (1, max_slots, max_slots * new), "capacity": (longest,) * 3,
              "past": (0, longest // 2, longest - new), "total": (1, longest // 2 + 1, longest)}
    inputs, _ = manifest.io()
    return {t.name: tuple(tuple(ranges[d][i] if isinstance(d, str) else d for d in t.shape) for i in range(3))
            for t in inputs}


def build(export_dir: Path, out_dir: Path, manifest: Manifest, precision: str = "fp16",
          timing_cache: Path | None = None, progress=cli_progress, max_slots: int = DEFAULT_SLOTS,
          max_new_tokens: int = DEFAULT_NEW_TOKENS) -> dict:
    """Write out_dir/model.plan and return the manifest's engine section. timing_cache defaults to
    build/tensorrt/timing-<TensorRT version>-sm<compute capability>.cache."""
    missing = missing_requirement()
    if missing:
        raise ManifestError(f"cannot build a TensorRT engine: {missing}")
    import tensorrt as trt

    started, host = time.perf_counter(), platform()
    timing_cache = timing_cache or (
        TIMING_CACHE_DIR / f"timing-{host['tensorrt_version']}-sm{host['compute_capability']}.cache")
    target = ".".join(trt.__version__.split(".")[:2])
    if target in trt_ops.TARGETS:  # a hint before the slow part; the parser's own errors are the final word
        for line in trt_ops.unsupported_ops(export_dir / manifest.onnx_file, target):
            print(f"[kvforge] warning: TensorRT {target} may reject {line}", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        with progress(f"preparing the ONNX: {precision} weights, KV cache kept {manifest.kv.storage}"):
            prepared = Path(tmp) / "model.onnx"
            prepare_onnx(export_dir / manifest.onnx_file, prepared, precision,
                         manifest.max_seq_len if manifest.kv_layout == "inplace" else None)
        logger = capturing_logger(trt)
        builder = trt.Builder(logger)
        # required on 10.x, the only mode (flag accepted) on 11.x
        network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(network, logger)
        with progress("parsing the ONNX into a strongly typed network"):
            if not parser.parse_from_file(str(prepared)):
                errors = [str(parser.get_error(i)).replace("\n", " ") for i in range(parser.num_errors)]
                raise ManifestError(f"the TensorRT {trt.__version__} ONNX parser rejected the export: "
                                    + " | ".join(errors or logger.errors))
        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        shapes = profile_shapes(manifest, max_slots, max_new_tokens)
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        if "attention_extent" in shapes:  # Slice bounds (chunk rows, their key span, decode key span): a shape input
            span = manifest.max_seq_len
            profile.set_shape_input("attention_extent", (1, 1, 1), (1, span // 2, span // 2), (max_slots, span, span))
        config.add_optimization_profile(profile)
        cached = timing_cache.read_bytes() if timing_cache.is_file() else b""
        config.set_timing_cache(config.create_timing_cache(cached), False)
        reuse = "reusing the" if cached else "no"
        with progress(f"building the plan ({reuse} timing cache; minutes on large models)"):
            plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise ManifestError("TensorRT could not build the plan: "
                                + (logger.errors[-1] if logger.errors else "no message"))
    (out_dir / PLAN_FILE).write_bytes(plan)
    timing_cache.parent.mkdir(parents=True, exist_ok=True)
    timing_cache.write_bytes(config.get_timing_cache().serialize())
    for name in manifest.tokenizer.get("files", []):
        shutil.copy2(export_dir / name, out_dir / name)
    return {"backend": "tensorrt", "file": PLAN_FILE, **host, "precision": precision,
            "build_flags": ["STRONGLY_TYPED"], "timing_cache": str(timing_cache), "max_batch_size": max_slots,
            "profiles": [{name: {"min": list(s[0]), "opt": list(s[1]), "max": list(s[2])}
                          for name, s in shapes.items()}],
            "build_seconds": round(time.perf_counter() - started, 2), "size_bytes": plan.nbytes}
