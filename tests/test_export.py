"""Export stage: every layout x KV dtype on tiny-llama, other architectures from real HF
checkpoint directories, the manifest contract, KV-size arithmetic and bad inputs."""
from __future__ import annotations

import json
import shutil

import onnx
import pytest

from kvforge.manifest import (FORMAT_VERSION, LAYOUT_DTYPES, Manifest, ManifestError, ModelSpec, kv_bytes,
                              kv_bytes_per_token)
from export.verify import verify
from tests.conftest import ROOT, run_cli

RUNNABLE = [(layout, dtype) for layout, dtypes in LAYOUT_DTYPES.items() for dtype in dtypes if dtype != "fp8"]


@pytest.mark.parametrize("layout,dtype", RUNNABLE)
def test_export_matches_pytorch(exports, layout, dtype):
    report = verify(exports(layout, dtype), steps=32)
    assert report.passed, report
    if dtype == "fp32":
        assert report.max_abs_diff <= 1e-4 and report.greedy_agreement == 1.0
    else:
        assert report.max_abs_diff > 0  # the quantized cache really is quantized


def test_fp8_is_emitted_as_qdq_and_refused_where_it_cannot_run(exports):
    directory = exports("inplace", "fp8")
    model = onnx.load(str(directory / "model.onnx"))
    onnx.checker.check_model(model)
    ops = {n.op_type for n in model.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "TensorScatter"} <= ops
    manifest = Manifest.load(directory)
    assert manifest.kv.runs_on == ()
    assert "KVCacheUpdate takes float32/float16/bfloat16 caches only" in manifest.kv.note
    assert json.loads((directory / "manifest.json").read_text())["kv"]["storage"] == "float8e4m3fn"
    result = run_cli("export.verify", str(directory))
    assert result.returncode != 0
    assert "cannot run on ONNX Runtime" in result.stderr and "Traceback" not in result.stderr


def test_verify_cli_prints_parity(exports):
    result = run_cli("export.verify", str(exports("concat", "fp32")))
    assert result.returncode == 0, result.stderr
    assert "max abs logit diff" in result.stdout and "PASS" in result.stdout


def test_inplace_graph_uses_tensorscatter_and_attention(exports):
    model = onnx.load(str(exports("inplace", "fp32") / "model.onnx"))
    ops = [n.op_type for n in model.graph.node]
    # 2 layers: K and V written per layer; per layer a chunk Attention and an If whose branches are the
    # decode Attention over the decode span and over the whole buffer (InplaceStep)
    assert ops.count("TensorScatter") == 2 * 2 and ops.count("Attention") == 2 and ops.count("If") == 2
    for node in (n for n in model.graph.node if n.op_type == "If"):
        assert [[n.op_type for n in branch.g.node].count("Attention") for branch in node.attribute] == [1, 1]
    # each attention's key span is one Slice of the buffer: chained Slices would copy rows at full capacity
    producers = {out: n for n in model.graph.node for out in n.output}
    slices = [n for n in model.graph.node if n.op_type == "Slice"]
    assert not [n for n in slices if n.input[0] in producers and producers[n.input[0]].op_type == "Slice"]
    assert model.opset_import[0].version == 24
    dims = [d.dim_param for d in model.graph.input[7].type.tensor_type.shape.dim]  # after logit_index
    assert dims[0] == "batch" and dims[2] == "capacity"


def _hf_checkpoint(tmp_path, config):
    """Save a real Hugging Face checkpoint directory with random weights and the preset's tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "build" / "checkpoints" / "tiny-llama" / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_from_hf_directories(tmp_path, exports, arch):
    from transformers import MistralConfig, Qwen2Config

    exports()  # makes sure the tiny-llama tokenizer exists
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=4096, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "qwen2":  # attention biases, tied embeddings, GQA
        config = Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, **common)
    else:  # multi-query attention, sliding window beyond the context
        config = MistralConfig(num_key_value_heads=1, sliding_window=4096, **common)
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    checkpoint = _hf_checkpoint(tmp_path / arch, config)
    for layout in ("inplace", "concat"):
        directory = exports(layout, "fp32", model=checkpoint, max_seq_len=128)
        manifest = Manifest.load(directory)
        assert manifest.model.architecture == config.architectures[0]
        assert len(manifest.source["sha256"]) == 64
        report = verify(directory, steps=32)
        assert report.passed and report.max_abs_diff <= 1e-4, report


def test_manifest_round_trip(exports, tmp_path):
    directory = tmp_path / "int8"  # a copy: save() rewrites the manifest other tests read
    shutil.copytree(exports("inplace", "int8"), directory)
    manifest = Manifest.load(directory)
    manifest.save(directory)
    again = Manifest.load(directory)
    assert again == manifest
    data = json.loads((directory / "manifest.json").read_text())
    assert data["format_version"] == FORMAT_VERSION
    assert data["kv"]["bytes_per_token"] == kv_bytes_per_token(manifest.model, "int8")
    names = [t["name"] for t in data["io"]["inputs"]]
    assert names[:3] == ["input_ids", "positions", "write_positions"] and "past_key_values.1.value_scale" in names
    assert {"torch", "onnx", "transformers", "exporter"} <= data["versions"].keys()
    assert data["tokenizer"]["eos_token_ids"] == [2] and "tokenizer.json" in data["tokenizer"]["files"]


def test_int8_static_keeps_only_int8_in_the_cache(exports):
    """The calibrated scales live in the graph: no scale tensors, exactly half of fp16 per token."""
    directory = exports("inplace", "int8-static")
    manifest = Manifest.load(directory)
    assert manifest.kv_bytes_per_token * 2 == kv_bytes_per_token(manifest.model, "fp16")
    model = onnx.load(str(directory / "model.onnx"))
    caches = [i for i in model.graph.input if i.name.startswith("past_key_values.")]
    assert len(caches) == 2 * manifest.model.num_layers
    assert all(i.type.tensor_type.elem_type == onnx.TensorProto.INT8 for i in caches)
    assert manifest.source["kv_calibration"]["tokens"] == 2048


def test_manifest_rejects_newer_format_and_garbage(tmp_path, exports):
    directory = tmp_path / "m"
    shutil.copytree(exports("inplace", "fp32"), directory)
    data = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**data, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(ManifestError, match="newer"):
        Manifest.load(directory)
    (directory / "manifest.json").write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.load(directory)


LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
            "vocab_size": 32000, "max_position_embeddings": 4096}


def test_kv_size_classic_7b_case():
    spec = ModelSpec.from_hf_config(LLAMA_7B)
    assert kv_bytes_per_token(spec, "fp16") == 512 * 1024  # 0.5 MiB per token
    assert kv_bytes(spec, "fp16", 2048) == 1 << 30  # 1 GiB for 2,048 tokens
    gqa = ModelSpec.from_hf_config({**LLAMA_7B, "num_key_value_heads": 8})
    assert kv_bytes_per_token(gqa, "fp16") == 128 * 1024
    # int8/int4 carry one fp16 scale per token and head
    assert kv_bytes_per_token(spec, "int8") == 2 * 32 * 32 * (128 + 2)
    assert kv_bytes_per_token(spec, "int4") == 2 * 32 * 32 * (64 + 2)
    assert kv_bytes_per_token(spec, "int8-static") == 256 * 1024  # calibrated scales live in the graph
    assert kv_bytes_per_token(spec, "fp8") == 256 * 1024


def test_kv_size_cli(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    result = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "2048", "--kv-dtype", "fp16", "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    assert row["bytes_per_token"] == 524288 and row["total_bytes"] == 1 << 30
    table = run_cli("export.kv_size", "--model", str(tmp_path / "config.json"), "--context", "2048",
                    "--kv-heads", "8")
    assert "fp16" in table.stdout and "256 MiB" in table.stdout and "int4" in table.stdout


GEMMA3_1B = {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "intermediate_size": 6912,
             "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
             "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
             "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4}


def test_kv_size_windowed_cli(tmp_path):
    """--max-chunk sizes Gemma 3 1B's 22 sliding layers (of 26) as rings of 512 + 512 - 1 positions:
    the manifest's arithmetic, and the sequences each way admits in a budget; a model without
    windows is refused."""
    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_1B))
    result = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "32768", "--kv-dtype", "fp16",
                     "--max-chunk", "512", "--kv-budget-mib", "4096", "--json")
    assert result.returncode == 0, result.stderr
    row = json.loads(result.stdout)["rows"][0]
    per_token = 2 * 1 * 256 * 2  # K and V, one KV head of 256, fp16: per layer
    assert row["windowed_bytes"] == per_token * (4 * 32768 + 22 * 1023)
    assert row["full_bytes"] == per_token * 26 * 32768
    assert (row["windowed_sequences"], row["full_sequences"]) == ((4 << 30) // row["windowed_bytes"], 4)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_7B))
    refused = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "2048", "--max-chunk", "512")
    assert refused.returncode != 0 and "has no sliding window" in refused.stderr


def _leftovers(parent):
    return [p.name for p in parent.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("case", ["missing path", "unsupported architecture", "max-seq-len zero",
                                  "max-seq-len too long", "unwritable output", "fp8 with concat"])
def test_bad_inputs_fail_cleanly(tmp_path, case):
    out = tmp_path / "out"
    model = "tiny-llama"
    extra: list[str] = []
    if case == "missing path":
        model = str(tmp_path / "nowhere")
    elif case == "unsupported architecture":
        (tmp_path / "gpt2").mkdir()
        (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
        model = str(tmp_path / "gpt2")
    elif case == "max-seq-len zero":
        extra = ["--max-seq-len", "0"]
    elif case == "max-seq-len too long":
        extra = ["--max-seq-len", "999999"]
    elif case == "unwritable output":
        (tmp_path / "a-file").write_text("")
        out = tmp_path / "a-file" / "out"
    elif case == "fp8 with concat":
        extra = ["--kv-layout", "concat", "--kv-dtype", "fp8"]
    result = run_cli("export", "--model", model, "--out", str(out), *extra)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not out.exists() and not _leftovers(tmp_path)
    if case == "unsupported architecture":
        assert "LlamaForCausalLM" in errors[0] and "Qwen2ForCausalLM" in errors[0]


def test_capacity_buckets_step_four_times_per_power_of_two():
    from kvforge.manifest import capacity_bucket

    assert [capacity_bucket(t, 4096) for t in (1, 64, 65, 129, 1025, 2049, 2112, 4000)] == \
        [64, 64, 80, 160, 1280, 2560, 2560, 4096]
    assert capacity_bucket(3000, 3000) == 3000  # capped at the engine's context
    with pytest.raises(ManifestError, match="exceed"):
        capacity_bucket(4097, 4096)
