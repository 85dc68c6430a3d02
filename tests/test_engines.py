"""Engines stage: the ONNX Runtime runners (both layouts, fp32/int8 KV) under continuous
batching, the in-place proof, capacity buckets, the ORT engine build and bad inputs."""
from __future__ import annotations

import json
import shutil
import time
from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnxruntime import OrtValue

from kvforge.manifest import Manifest, ManifestError
from runtime.runners import ort as ort_runner
from runtime.greedy import Greedy
from runtime.runners import open_runner
from runtime.runners.ort import OrtInplaceRunner
from runtime.runners.base import pack_step
from tests.conftest import run_cli

PROMPTS = {"a": [5, 17, 300, 42, 9, 77, 1000], "b": [8, 9], "c": [1200, 3, 4, 5, 6], "d": [33, 34, 35, 36]}


def solo_logits(directory, prompt, steps):
    """Reference: the sequence alone in a fresh runner (one row), greedy."""
    run = Greedy(open_runner(directory), [prompt], steps)
    run.prefill()
    return [run.last[0]] + [run.step()[0] for _ in range(steps - 1)]


def batched_logits(directory, schedule, slots=3):
    """Drive one runner through a schedule of joins and leaves with packed rows.

    schedule: {step: [names joining]}; a sequence leaves after 6 generated tokens. Rows joining
    prefill in the same step as the decode rows (right-padded), as continuous batching does."""
    r = open_runner(directory)
    r.allocate(slots, 64)
    rows: list[dict] = []  # packed: row i is rows[i]
    produced: dict[str, list] = {}
    for step in range(40):
        for name in schedule.get(step, []):
            rows.append({"name": name, "pending": PROMPTS[name], "length": 0})
        if not rows:
            break
        width = max(len(s["pending"]) for s in rows)
        ids = np.zeros((len(rows), width), np.int64)
        for i, s in enumerate(rows):
            ids[i, :len(s["pending"])] = s["pending"]
        num_new = np.array([len(s["pending"]) for s in rows])
        logits = r.step(ids, np.array([s["length"] for s in rows]), num_new)
        for i, s in enumerate(rows):
            last = logits[i, num_new[i] - 1]
            produced.setdefault(s["name"], []).append(last)
            s["length"] += num_new[i]
            s["pending"] = [int(last.argmax())]
        for i in reversed(range(len(rows))):
            if len(produced[rows[i]["name"]]) == 6:  # leaves; the last row moves into its slot
                last_row = len(rows) - 1
                if i != last_row:
                    r.move(last_row, i, rows[last_row]["length"])
                rows[i] = rows[last_row]
                rows.pop()
    return produced


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_continuous_batching_matches_solo_runs(exports, dtype):
    directory = exports("inplace", dtype)
    produced = batched_logits(directory, {0: ["a", "b"], 2: ["c"], 7: ["d"]})
    assert set(produced) == set(PROMPTS)
    for name, logits in produced.items():
        reference = solo_logits(directory, PROMPTS[name], len(logits))
        diff = max(float(np.abs(a - b).max()) for a, b in zip(logits, reference))
        assert diff < 1e-4, (name, diff)


def _step_logging_inplace_warnings(directory, capfd, alias: bool):
    r = open_runner(directory)
    r.allocate(2, 64)
    opts = ort_runner.session_options(1)
    opts.log_severity_level = 1  # TensorScatter warns when it has to copy the buffer
    r.session = ort.InferenceSession(str(directory / "model.onnx"), opts)
    pointers = r.data_pointers()
    if alias:
        for step in range(20):
            r.step(np.array([[7, 8, 9], [10, 11, 12]]), np.array([3 * step, 3 * step]), np.array([3, 3]))
        return r, pointers, capfd.readouterr().err
    binding = r.session.io_binding()  # control: present bound to a different buffer
    for name, value in pack_step(np.array([[7], [8]]), np.array([0, 0]), np.array([1, 1]), np.array([[0], [0]])).items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("logits")
    for past, present in r.pairs:
        binding.bind_ortvalue_input(past, OrtValue.ortvalue_from_numpy(r.buffers[past]))
        binding.bind_ortvalue_output(present, OrtValue.ortvalue_from_numpy(r.buffers[past].copy()))
    r.session.run_with_iobinding(binding)
    return r, pointers, capfd.readouterr().err


def test_inplace_updates_the_bound_buffers_without_copies(exports, capfd):
    directory = exports("inplace", "fp32")
    r, pointers, log = _step_logging_inplace_warnings(directory, capfd, alias=True)
    assert r.data_pointers() == pointers
    key = r.buffers["past_key_values.0.key"]
    assert np.abs(key[:, :, :60]).sum() > 0 and np.abs(key[:, :, 60:]).sum() == 0  # 20 steps x 3 tokens
    assert "in-place optimization not activated" not in log
    _, _, control = _step_logging_inplace_warnings(directory, capfd, alias=False)
    assert "in-place optimization not activated" in control  # the check above can fail


def test_capacity_growth_and_shrink_keep_the_cache(exports):
    directory = exports("inplace", "int8")
    prompt = PROMPTS["a"]
    reference = solo_logits(directory, prompt, 71)
    r = open_runner(directory)
    r.allocate(1, r.bucket_for(len(prompt)))
    assert r.capacity == 64
    logits = [r.step(np.array([prompt]), np.array([0]), np.array([len(prompt)]))[0, -1]]
    length = len(prompt)
    for _ in range(69):
        if length + 1 > r.capacity:
            before = r.kv_bytes_allocated
            r.resize(r.bucket_for(length + 1), rows=1)
            assert r.capacity == 80 and r.kv_bytes_allocated == before * 80 // 64  # the next bucket
        logits.append(r.step(np.array([[logits[-1].argmax()]]), np.array([length]), np.array([1]))[0, 0])
        length += 1
    assert max(float(np.abs(a - b).max()) for a, b in zip(logits, reference)) < 1e-4
    r.resize(256, rows=1)
    r.resize(128, rows=1)  # shrinking back keeps the 76 cached tokens: the 77th step sees all of them
    again = r.step(np.array([[logits[-1].argmax()]]), np.array([length]), np.array([1]))[0, 0]
    assert float(np.abs(again - reference[70]).max()) < 1e-4
    with pytest.raises(ValueError, match="resize first"):
        r.step(np.zeros((1, 60), np.int64), np.array([length]), np.array([60]))


def test_ort_engine_build_records_and_gates(exports, tmp_path):
    export_dir = exports("inplace", "fp32")
    out = tmp_path / "engine"
    began = time.monotonic()
    result = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--out", str(out))
    wall = time.monotonic() - began
    assert result.returncode == 0, result.stderr
    engine = Manifest.load(out).engine
    assert engine["backend"] == "onnxruntime" and engine["onnxruntime_version"] == ort.__version__
    assert engine["parity_max_abs_diff"] <= engine["parity_tolerance"] == pytest.approx(1e-4 * engine["parity_logit_range"])
    assert engine["parity_logit_range"] > 0
    assert engine["size_bytes"] == sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".onnx", ".data")) > 0
    assert 0 < engine["build_seconds"] <= wall and engine["threads"] >= 1  # it timed the build, inside the command
    assert "parity drift" in result.stderr
    quantized = tmp_path / "engine-int8"
    result = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", "int8",
                     "--out", str(quantized))
    assert result.returncode == 0, result.stderr
    assert Manifest.load(quantized).engine["size_bytes"] < engine["size_bytes"] / 2
    assert isinstance(open_runner(quantized), OrtInplaceRunner)
    # every projection is quantized, the packed q/k/v and gate/up ones included; a tied lm_head
    # (the quantizer skips it) would be the one float MatMul left
    ops = Counter(n.op_type for n in onnx.load(str(quantized / "model.onnx")).graph.node)
    model = Manifest.load(export_dir).model
    assert ops["DynamicQuantizeMatMul"] == 4 * model.num_layers + (not model.tie_word_embeddings)
    assert ops["MatMul"] == int(model.tie_word_embeddings)
    # int4: MatMulNBits skips Gemm, so the untied lm_head (a Gemm x @ W^T) becomes a MatMul first
    int4 = tmp_path / "engine-int4"
    result = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", "int4",
                     "--out", str(int4))
    assert result.returncode == 0, result.stderr
    ops = Counter(n.op_type for n in onnx.load(str(int4 / "model.onnx")).graph.node)
    assert ops["MatMulNBits"] == 4 * model.num_layers + (not model.tie_word_embeddings) and ops["Gemm"] == 0


def test_fp16_engine_halves_the_projections_and_refuses_bf16(exports, tmp_path):
    """--weights fp16: every projection's weight is stored float16 in the saved engine (the
    optimizer's graph, not only the build's), the data file shrinks by half the export's projection
    bytes, the weights were rounded (drift > 0) within the gate, and the engine generates near the
    export. bf16 is refused for ONNX Runtime, naming why and what to use."""
    from engines.onnxruntime_build import BF16_REFUSAL, PARITY_TOLERANCE
    from kvforge.onnx_graphs import all_nodes

    export_dir, out = exports("inplace", "fp32"), tmp_path / "engine-fp16"
    result = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", "fp16",
                     "--out", str(out))
    assert result.returncode == 0, result.stderr
    engine, model = Manifest.load(out).engine, Manifest.load(export_dir).model
    assert engine["weights"] == "fp16"
    assert 0 < engine["parity_max_abs_diff"] <= engine["parity_tolerance"] == \
        pytest.approx(PARITY_TOLERANCE["fp16"] * engine["parity_logit_range"])
    exported = onnx.load(str(export_dir / "model.onnx"), load_external_data=False)
    sizes = {t.name: int(np.prod(t.dims)) for t in exported.graph.initializer if len(t.dims) == 2}
    projections = {n.input[1] for n in all_nodes(exported.graph) if n.op_type in ("MatMul", "Gemm") and n.input[1] in sizes}
    halves = {t.name: int(np.prod(t.dims)) for t in onnx.load(str(out / "model.onnx"), load_external_data=False).graph.initializer
              if t.data_type == onnx.TensorProto.FLOAT16}
    assert len(projections) == len(halves) == 4 * model.num_layers + (not model.tie_word_embeddings)
    assert sum(halves.values()) == sum(sizes[name] for name in projections)  # each converted whole, once
    saved = 2 * sum(halves.values())  # 4 bytes each in the export, 2 in the engine
    assert (out / "model.onnx.data").stat().st_size == pytest.approx(
        (export_dir / "model.onnx.data").stat().st_size - saved, rel=0.02)
    built, reference = (solo_logits(d, PROMPTS["a"], 6) for d in (out, export_dir))
    assert max(float(np.abs(a - b).max()) for a, b in zip(built, reference)) <= engine["parity_tolerance"]
    refused = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", "bf16",
                      "--out", str(tmp_path / "bf16"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and not (tmp_path / "bf16").exists()
    assert BF16_REFUSAL in refused.stderr and "no bfloat16 MatMul" in BF16_REFUSAL


def test_an_engine_holds_its_own_weights(exports, tmp_path):
    """An export keeps its weights in model.onnx.data (kvforge.onnx_weights): the built engine
    writes its own weights file and loads with the export gone."""
    export_dir = tmp_path / "export"
    shutil.copytree(exports("inplace", "fp32"), export_dir)
    assert (export_dir / "model.onnx.data").stat().st_size > (export_dir / "model.onnx").stat().st_size
    out = tmp_path / "engine"
    result = run_cli("engines", "build", str(export_dir), "--backend", "onnxruntime", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "model.onnx.data").stat().st_size > (out / "model.onnx").stat().st_size
    shutil.rmtree(export_dir)
    built, exported = (solo_logits(d, PROMPTS["a"], 4) for d in (out, exports("inplace", "fp32")))
    np.testing.assert_allclose(built, exported, atol=1e-3)


def test_tensorrt_backend_refused_and_auto_falls_back(exports, tmp_path):
    export_dir = exports("inplace", "fp32")
    refused = run_cli("engines", "build", str(export_dir), "--backend", "tensorrt", "--out", str(tmp_path / "trt"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "cannot build a TensorRT engine" in refused.stderr and not (tmp_path / "trt").exists()
    auto = run_cli("engines", "build", str(export_dir), "--backend", "auto", "--out", str(tmp_path / "auto"))
    assert auto.returncode == 0, auto.stderr
    assert "building the ONNX Runtime engine" in auto.stderr
    assert Manifest.load(tmp_path / "auto").engine["backend"] == "onnxruntime"


def test_offline_tensorrt_op_check(exports):
    export_dir = exports("inplace", "fp32")
    old = run_cli("engines", "check", str(export_dir), "--target", "tensorrt", "--tensorrt-version", "10.13")
    assert old.returncode == 1 and "TensorScatter" in old.stdout and "Attention" in old.stdout
    unknown = run_cli("engines", "check", str(export_dir), "--tensorrt-version", "0.1")
    assert unknown.returncode == 2 and "error:" in unknown.stderr


def test_engine_bad_inputs(exports, tmp_path):
    missing = run_cli("engines", "build", str(tmp_path), "--backend", "onnxruntime", "--out", str(tmp_path / "e"))
    assert missing.returncode == 2 and "no manifest.json" in missing.stderr
    engine = tmp_path / "engine"
    shutil.copytree(exports("inplace", "fp32"), engine)
    (engine / "model.onnx").write_bytes(b"definitely not protobuf")
    with pytest.raises(ManifestError, match="cannot load engine"):
        open_runner(engine)
    data = json.loads((engine / "manifest.json").read_text())
    data["engine"] = {"backend": "onnxruntime", "file": "model.onnx", "onnxruntime_version": "0.0.1"}
    (engine / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=rf"0\.0\.1.*{ort.__version__}"):
        open_runner(engine)


def test_idle_threads_spin_as_configured_and_bad_settings_are_refused(monkeypatch, tmp_path):
    from kvforge.engine_config import DEFAULT_SPIN_US, MAX_SPIN_US, variable
    from launcher.tritonserver import free_ports
    from tests.test_hardening import refusal

    def entries(spin: str | None) -> tuple[str, str | None]:
        if spin is None:
            monkeypatch.delenv(variable("spin_us"), raising=False)
        else:
            monkeypatch.setenv(variable("spin_us"), spin)
        opts = ort_runner.session_options(1)
        allow = opts.get_session_config_entry("session.intra_op.allow_spinning")
        try:
            return allow, opts.get_session_config_entry("session.intra_op.spin_duration_us")
        except RuntimeError as e:  # ORT raises this when the entry was never set
            assert "does not have configuration with key" in str(e), e
            return allow, None

    assert entries("0") == ("0", None)
    assert entries("250") == ("1", "250")
    assert entries(None) == entries(str(DEFAULT_SPIN_US))
    monkeypatch.setenv(variable("spin_us"), "lots")
    with pytest.raises(ValueError, match="KVFORGE_SPIN_US must be a whole number"):
        ort_runner.session_options(1)
    ports = sum((["--" + f, str(p)] for f, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])
    for bad in ("-1", str(MAX_SPIN_US + 1)):
        assert f"--spin-us must be in 0..{MAX_SPIN_US}" in refusal("--repo", str(tmp_path), *ports,
                                                                            "--spin-us", bad)
