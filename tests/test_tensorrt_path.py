"""The TensorRT path where TensorRT and a GPU are missing: one-line refusals, the version check,
the ONNX a GPU build would parse (weights cast, capacity pinned), and the offline op check on
real exports. Nothing here runs TensorRT."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from engines import trt_ops
from engines.tensorrt_build import build, cast_weights, prepare_onnx, profile_shapes
from kvforge.manifest import Manifest, ManifestError, kv_pairs
from kvforge.tensorrt_host import check_engine_match, missing_requirement, read_plan
from runtime.runners import open_runner
from runtime.runners.ort import OrtInplaceRunner
from runtime.runners.trt import TensorRTRunner
from tests.conftest import run_cli

MISSING = missing_requirement()
without_tensorrt = pytest.mark.skipif(MISSING is None, reason="TensorRT and a CUDA GPU are present")
RUNNING = {"tensorrt_version": "10.15.1.29", "compute_capability": "8.9", "gpu_name": "NVIDIA L4"}


@without_tensorrt
def test_build_and_runner_refuse_with_one_line(exports, tmp_path):
    assert "\n" not in MISSING and any(w in MISSING for w in ("TensorRT", "CUDA GPU", "cuda-python"))
    export_dir = exports("inplace", "fp32")
    manifest = Manifest.load(export_dir)
    with pytest.raises(ManifestError) as refused:
        build(export_dir, tmp_path / "trt", manifest)
    assert str(refused.value) == f"cannot build a TensorRT engine: {MISSING}"
    assert not (tmp_path / "trt").exists()
    with pytest.raises(ManifestError, match="^cannot run the TensorRT engine: "):
        TensorRTRunner(manifest, tmp_path / "model.plan")
    engine = tmp_path / "engine"  # an engine directory whose manifest names a plan
    shutil.copytree(export_dir, engine)
    data = json.loads((engine / "manifest.json").read_text())
    data["engine"] = {"backend": "tensorrt", "file": "model.plan", **RUNNING}
    (engine / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="^cannot run the TensorRT engine: "):
        open_runner(engine)


@pytest.mark.parametrize("dtype, backend", [("int8", "tensorrt"), ("fp8", "tensorrt"), ("fp8", "auto")])
def test_quantized_caches_are_refused_where_they_cannot_run(exports, tmp_path, dtype, backend):
    """Before any TensorRT check: the cache dtype itself has no engine on that backend."""
    result = run_cli("engines", "build", str(exports("inplace", dtype)), "--backend", backend,
                     "--out", str(tmp_path / "engine"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "KVCacheUpdate takes float32/float16/bfloat16 caches only" in result.stderr
    assert f"{dtype} KV cache" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "engine").exists()


def test_version_or_gpu_mismatch_names_both_sides():
    check_engine_match(dict(RUNNING), RUNNING)
    with pytest.raises(ManifestError, match=r"with TensorRT 10\.14\.1\.48 .* host has TensorRT 10\.15\.1\.29"):
        check_engine_match({**RUNNING, "tensorrt_version": "10.14.1.48"}, RUNNING)
    with pytest.raises(ManifestError, match=r"capability 9\.0 .* capability 8\.9; rebuild"):
        check_engine_match({**RUNNING, "compute_capability": "9.0"}, RUNNING)
    with pytest.raises(ManifestError, match=r"TensorRT \(not recorded\)"):
        check_engine_match({}, RUNNING)


def test_missing_or_empty_plan_is_refused(tmp_path):
    with pytest.raises(ManifestError, match="model.plan is missing; rebuild"):
        read_plan(tmp_path / "model.plan")
    (tmp_path / "model.plan").write_bytes(b"")
    with pytest.raises(ManifestError, match="is empty"):
        read_plan(tmp_path / "model.plan")


def test_fp16_weights_keep_the_cache_in_place_and_the_logits(exports, tmp_path):
    export_dir = exports("inplace", "fp32")
    manifest = Manifest.load(export_dir)
    prepared = tmp_path / "fp16.onnx"
    prepare_onnx(export_dir / "model.onnx", prepared, "fp16", manifest.max_seq_len)
    model = onnx.load(str(prepared), load_external_data=False)
    onnx.checker.check_model(str(prepared))
    io = {v.name: v.type.tensor_type for v in (*model.graph.input, *model.graph.output)}
    for past, present in kv_pairs(manifest.model, manifest.kv_dtype):
        for name in (past, present):
            assert io[name].elem_type == onnx.TensorProto.FLOAT
            assert io[name].shape.dim[2].dim_value == manifest.max_seq_len
    scatters = [n for n in model.graph.node if n.op_type == "TensorScatter"]
    assert scatters and all(n.input[0] in io and n.output[0] in io for n in scatters)
    assert sum(t.data_type == onnx.TensorProto.FLOAT16 for t in model.graph.initializer) >= 2
    # written a tensor at a time beside the graph, none left behind in the export's file
    assert {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"} == {"fp16.onnx.data"}
    # the preparation adds nothing the parser rejects: the only line left is the export's own Attention
    assert trt_ops.unsupported_ops(prepared, "11.0") == trt_ops.unsupported_ops(export_dir / "model.onnx", "11.0")

    ids = np.random.default_rng(0).integers(3, manifest.model.vocab_size, (2, 6))
    logits = []
    for path in (export_dir / "model.onnx", prepared):  # ONNX Runtime CPU runs fp16 MatMul/Gather too
        runner = OrtInplaceRunner(manifest, path, threads=1)
        runner.allocate(2, manifest.max_seq_len)
        logits.append(runner.step(ids, np.zeros(2, np.int64), np.array([6, 4])))
    assert np.abs(logits[0] - logits[1]).max() < 5e-3


def test_bf16_weights_round_to_nearest(exports):
    path = exports("inplace", "fp32") / "model.onnx"
    before = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    model = cast_weights(onnx.load(str(path)), "bf16")
    onnx.checker.check_model(model)
    cast = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.BFLOAT16]
    assert cast
    for tensor in cast:
        decoded = (np.frombuffer(tensor.raw_data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        original = before[tensor.name.removesuffix("/bf16")].ravel()
        assert np.all(np.abs(decoded - original) <= np.abs(original) * 2.0 ** -8)
    with pytest.raises(ManifestError, match="unknown TensorRT precision 'int3'"):
        cast_weights(model, "int3")


def test_profiles_cover_slots_new_tokens_and_the_pinned_capacity(exports):
    manifest = Manifest.load(exports("inplace", "fp32"))
    kvh, hd, cap = manifest.model.num_kv_heads, manifest.model.head_dim, manifest.max_seq_len
    shapes = profile_shapes(manifest, max_slots=4, max_new_tokens=16)
    assert shapes["input_ids"] == ((1,), (4,), (64,))  # packed: tuned for decode, one token per row
    assert shapes["row_tokens"] == ((1, 1), (4, 1), (4, 16))
    assert shapes["write_positions"] == ((1,), (4,), (4,))
    assert shapes["logit_index"] == ((1,), (4,), (64,))  # generation's one per row; scoring all
    assert shapes["attention_extent"] == ((3,), (3,), (3,))
    assert shapes["past_key_values.0.key"] == ((1, kvh, cap, hd), (4, kvh, cap, hd), (4, kvh, cap, hd))
    concat = profile_shapes(Manifest(**{**manifest.__dict__, "kv_layout": "concat"}), 4, 16)
    for corner in range(3):  # the network must be consistent at min, opt and max
        past = concat["past_key_values.0.key"][corner][2]
        assert past + concat["input_ids"][corner][1] == concat["attention_mask"][corner][1]
    assert concat["attention_mask"][2][1] == cap


def test_offline_op_check_on_real_exports(exports, tmp_path):
    inplace = exports("inplace", "fp32") / "model.onnx"
    old = trt_ops.unsupported_ops(inplace, "10.13")
    # per layer (2): the chunk's, and the decode queries' in each branch of the If on the decode span
    assert any(line.startswith("Attention x6: ") and "added in 10.14" in line for line in old)
    assert any(line.startswith("TensorScatter x") and "added in 10.15" in line for line in old)
    # from 10.15 the fp32 in-place export imports whole: TensorScatter in place, Attention with a mask
    assert trt_ops.unsupported_ops(inplace, "10.15") == [] == trt_ops.unsupported_ops(inplace, "11.0")
    int8 = trt_ops.unsupported_ops(exports("inplace", "int8") / "model.onnx", "11.0")
    assert any(line.startswith("TensorScatter x") and "INT8" in line and "not updated in place" in line
               for line in int8)
    assert any(line.startswith("Cast x") and "INT8" in line for line in int8)
    concat = exports("concat", "fp32") / "model.onnx"
    assert trt_ops.unsupported_ops(concat, "10.15") == [] == trt_ops.unsupported_ops(concat, "11.0")
    # the fused norm and rotary ops need the 10.15 parser; the model has 2 layers (5 norms, 4 rotations)
    assert sorted(trt_ops.unsupported_ops(concat, "10.14")) == [
        "RMSNormalization x5: not imported by the TensorRT 10.14 parser (added in 10.15)",
        "RotaryEmbedding x4: not imported by the TensorRT 10.14 parser (added in 10.15)"]
    with pytest.raises(ManifestError, match=r"target '9\.3'; known targets: 10\.13, 10\.14, 10\.15, 11\.0"):
        trt_ops.unsupported_ops(inplace, "9.3")
    with pytest.raises(ManifestError, match="is missing"):
        trt_ops.unsupported_ops(tmp_path / "model.onnx")
