"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE: tests/families.py's MOE_FAMILIES)
as tiny Hugging Face checkpoints with random weights, saved by transformers 5.24 (per-expert tensors
in the files): exported with one ONNX Runtime MoE node per sparse layer and run by the in-process
engine and the runner against transformers' generate(), and served through Triton beside DeepSeek's
(tests/test_deepseek_moe.py); int8/int4 engines with QMoE experts and fp32 routers; the config facts
(decoder_sparse_step, mlp_only_layers) and the refusals."""
from __future__ import annotations

import shutil

import pytest

from kvforge.manifest import Manifest, ManifestError, ModelSpec
from tests.families import COMMON, NEW_TOKENS, moe_hf_config

LOGPROB_TOLERANCE = 2e-3
SPARSE_LAYERS = {"mixtral": (0, 1), "qwen3-moe": (0, 2), "qwen2-moe": (1, 3)}  # MOE_FAMILIES' softmax top-k ones


def experts_routed(model, tokens: list[int]) -> set[tuple[int, int]]:
    """(layer, expert) pairs transformers' routers pick for these tokens."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return {(layer, int(e)) for layer, lg in enumerate(logits) for e in lg.topk(k, dim=-1).indices.flatten()}


@pytest.mark.parametrize("name", list(SPARSE_LAYERS))
def test_moe_generates_what_transformers_generates(moe_exports, moe_checkpoints, name):
    """Greedy, the prompt in one step then decode steps: through LLMEngine (in place) and the runner
    (concat), transformers' tokens and log-probs within LOGPROB_TOLERANCE, every expert of every
    sparse layer routed to along the way; beside a second prompt packed into the same steps (the MoE
    node sees both rows' tokens at once), which generates what it does alone."""
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.test_families import runner_greedy

    _, prompt, tokens, logprobs = moe_checkpoints[name][:4]
    model = moe_checkpoints[name].model
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert len(experts_routed(model, prompt + tokens)) == len(SPARSE_LAYERS[name]) * experts
    other = prompt[::-1][:17]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    with LLMEngine(moe_exports(name), threads=1, prefix_cache=False) as engine:
        result, beside = engine.generate([prompt, other], params)
        alone = engine.generate([other], params)[0]
    assert beside.token_ids == alone.token_ids
    for got in ((result.token_ids, result.logprobs), runner_greedy(moe_exports(name, "concat"), prompt)):
        assert got[0] == tokens
        assert max(abs(a - b) for a, b in zip(got[1], logprobs)) <= LOGPROB_TOLERANCE
    assert len(set(tokens)) > 8  # not a degenerate loop


def _moe_nodes(path, op: str) -> list:
    import onnx

    model = onnx.load(str(path))
    return [n for n in model.graph.node if (n.domain, n.op_type) == ("com.microsoft", op)], model


def _float_routers(nodes, model) -> list[tuple[int, ...]]:
    """The shape of each MoE/QMoE node's router weight, when it is a float MatMul/Gemm initializer."""
    import onnx

    producer = {out: node for node in model.graph.node for out in node.output}
    weights = {t.name: t for t in model.graph.initializer}
    shapes = []
    for node in nodes:
        router = producer[node.input[1]]
        assert router.op_type in ("MatMul", "Gemm")
        weight = weights[router.input[1]]
        assert weight.data_type == onnx.TensorProto.FLOAT
        shapes.append(tuple(weight.dims))
    return shapes


def test_moe_graph_and_quantized_engines(moe_exports, moe_checkpoints, tmp_path):
    """One MoE node per sparse layer (Qwen2-MoE's decoder_sparse_step 2: layers 1 and 3), routed by
    an fp32 projection; `engines build --weights int8/int4` makes them QMoE of 8/4-bit experts (in
    blocks of 32 where the widths divide), the routers and shared-expert gates still fp32 MatMuls, the
    dense projections quantized, and the engines' log-probs of the export's greedy tokens stay near
    its own. TensorRT is refused."""
    from engines.__main__ import choose_backend
    from runtime.greedy import followed_logprobs
    from runtime.runners import open_runner
    from tests.conftest import run_cli
    from tests.test_family_weights import logprob_bound

    export_dir = moe_exports("qwen2-moe")
    nodes, model = _moe_nodes(export_dir / "model.onnx", "MoE")
    assert len(nodes) == len(SPARSE_LAYERS["qwen2-moe"])
    assert _float_routers(nodes, model) == [(4, 64)] * 2  # [experts, hidden] (a Gemm with transB)
    attributes = {a.name: a for a in nodes[0].attribute}
    assert (attributes["k"].i, attributes["normalize_routing_weights"].i, attributes["swiglu_fusion"].i) == (2, 0, 1)
    spec = Manifest.load(export_dir).model
    assert (spec.num_experts, spec.experts_per_token, spec.sparse_layers) == (4, 2, (1, 3))
    with pytest.raises(ManifestError, match="mixture-of-experts export .*TensorRT's ONNX parser"):
        choose_backend("tensorrt", Manifest.load(export_dir), export_dir)
    assert choose_backend("auto", Manifest.load(export_dir), export_dir) == "onnxruntime"

    engines = {}
    # Qwen2-MoE's experts (hidden 64, width 32) quantize in blocks of 32; Qwen3-MoE's (width 24) one
    # scale per row
    for name, weights, bits, block in (("qwen2-moe", "int8", 8, 32), ("qwen2-moe", "int4", 4, 32),
                                       ("qwen3-moe", "int4", 4, 0)):
        out = engines.setdefault(name, {})[weights] = tmp_path / f"{name}-{weights}"
        result = run_cli("engines", "build", str(moe_exports(name)), "--weights", weights, "--out", str(out))
        assert result.returncode == 0, result.stderr
        nodes, model = _moe_nodes(out / "model.onnx", "QMoE")
        assert len(nodes) == 2 and not _moe_nodes(out / "model.onnx", "MoE")[0]
        for node in nodes:
            attributes = {a.name: a.i for a in node.attribute}
            assert (attributes["expert_weight_bits"], attributes.get("block_size", 0)) == (bits, block)
        routers = _float_routers(nodes, model)  # fp32, as exported: a Gemm x @ W^T, W [experts, hidden]
        assert routers == [(4 if name == "qwen2-moe" else 8, 64)] * 2
        floats = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "FusedGemm")]
        # the routers (and Qwen2-MoE's two shared-expert gates, Gemm + Sigmoid fused by ONNX Runtime):
        # nothing else stays fp32
        assert len(floats) == (4 if name == "qwen2-moe" else 2)
    prompt = moe_checkpoints["qwen2-moe"].prompt
    built = engines["qwen2-moe"]
    tokens, (reference, *quantized) = followed_logprobs(
        [open_runner(d, threads=1) for d in (export_dir, built["int8"], built["int4"])], prompt, 16)
    for weights, got in zip(built, quantized):  # tests/test_family_weights.py's bound, from the build's gate
        bound = logprob_bound(weights, Manifest.load(built[weights]).engine["parity_logit_range"])
        assert 0 < max(abs(a - b) for a, b in zip(reference, got)) <= bound, weights

def test_moe_config_facts_and_refusals(moe_checkpoints, tmp_path):
    """Sparse layers as transformers chooses them; what is not exported is refused, naming why."""
    from export.checkpoint import load_model
    from kvforge.manifest import KV_DTYPES

    def spec(name, **overrides):
        return ModelSpec.from_hf_config({**moe_hf_config(name).to_dict(), **overrides})

    assert spec("qwen3-moe").sparse_layers == (0, 2) and spec("qwen3-moe").norm_topk_prob
    assert spec("qwen3-moe", mlp_only_layers=[], decoder_sparse_step=3).sparse_layers == (2,)
    hub = {k: v for k, v in moe_hf_config("qwen3-moe").to_dict().items() if k != "num_local_experts"}
    assert ModelSpec.from_hf_config({**hub, "num_experts": 128}).num_experts == 128  # the hub's configs say num_experts
    assert spec("qwen2-moe").shared_expert_intermediate_size == 40 and not spec("qwen2-moe").norm_topk_prob
    assert spec("mixtral").norm_topk_prob and spec("mixtral").expert_intermediate_size == 32
    assert spec("mixtral", sliding_window=24).sliding_layers == (0, 1)  # Mistral's window on every layer
    assert "sandwich_norms" not in ModelSpec.__dataclass_fields__
    with pytest.raises(ManifestError, match="GptOssForCausalLM .*attention sinks.*MXFP4"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["GptOssForCausalLM"]})
    with pytest.raises(ManifestError, match="quantization_config \\(quant_method 'fp8'"):
        spec("qwen3-moe", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ManifestError, match="routing other than softmax top-k.*softmax top-k only"):
        spec("qwen2-moe", scoring_func="sigmoid")
    with pytest.raises(ManifestError, match="num_experts_per_tok=9 must be in 1..8"):
        spec("mixtral", num_experts_per_tok=9)
    with pytest.raises(ManifestError, match="use_sliding_window is not supported for mixture-of-experts"):
        spec("qwen3-moe", use_sliding_window=True, sliding_window=24)
    # a checkpoint without one expert's tensor: named, not a KeyError
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(moe_checkpoints["mixtral"].directory, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.7.w3.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ManifestError, match="lacks weights.*layers.1.block_sparse_moe.experts.7.w3"):
        load_model(broken, "inplace", KV_DTYPES["fp32"])


# Served beside Qwen2-MoE (the llm model): DeepSeek's in-place exports of tests/test_deepseek_moe.py
# (MLA, routing ops in front of the MoE node), and the other softmax top-k families
SERVED = ("mixtral", "qwen3-moe", "deepseek-v2-group", "deepseek-v3")


@pytest.fixture(scope="module")
def moe_server(moe_exports, tmp_path_factory):
    """One tritonserver (and its front) for every served MoE export, two KV slots each: the
    Qwen2-MoE export (shared expert, dense and sparse layers) as `llm`, the SERVED ones by name."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    repo = tmp_path_factory.mktemp("moe-served")
    write_repository(moe_exports("qwen2-moe"), repo, slots=2)
    for name in SERVED:
        assert write_repository(moe_exports(name), repo, name=name, slots=2) == [name]
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai_port) as server:
        yield server


@pytest.mark.parametrize("model", ["llm", *SERVED])
def test_moe_served_through_triton(moe_server, moe_checkpoints, model):
    """Over the front's /v2 generate, each served MoE export gives transformers' greedy tokens and
    log-probs within LOGPROB_TOLERANCE."""
    from tests.test_families import served_greedy

    _, prompt, tokens, logprobs = moe_checkpoints["qwen2-moe" if model == "llm" else model][:4]
    got, got_logprobs = served_greedy(moe_server, model, prompt)
    assert got == tokens
    assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) <= LOGPROB_TOLERANCE


def test_moe_under_the_prefix_cache_tiers_speculation_and_disaggregation(moe_exports, moe_checkpoints, tmp_path, patient):
    """MoE changes the MLP only: the engine's KV features run over it unchanged. Transformers' greedy
    tokens from a prefix hit in RAM, from the disk tier on a restarted engine, with prompt-lookup
    drafts verified by the MoE model, and from a prefill worker's hand-off."""
    from runtime.disaggregation import Disaggregation
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.waiting import wait_for

    _, prompt, tokens = moe_checkpoints["qwen2-moe"][:3]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLMEngine(moe_exports("qwen2-moe"), threads=1, kv_disk_dir=tmp_path) as engine:
        cold, = engine.generate([prompt], params)
        warm, = engine.generate([prompt], params)
        wait_for(lambda: engine.stats()["tiers"]["disk"]["written_blocks"] > 0
                 and engine.stats()["tier_write_queue_blocks"] == 0, "the prompt's blocks written to disk")
    with LLMEngine(moe_exports("qwen2-moe"), threads=1, kv_disk_dir=tmp_path, speculative="ngram") as restarted:
        from_disk, = restarted.generate([prompt], params)
        stats = restarted.stats()
    with LLMEngine(moe_exports("qwen2-moe"), threads=1,
                   disaggregation=Disaggregation(threads=1, threshold_tokens=0)) as disaggregated:
        wait_for(lambda: disaggregated.pd.up, "the prefill worker to start", 120.0)
        handed_over, = disaggregated.generate([prompt], params)
        handoffs = disaggregated.stats()["pd_handoffs"]
    assert cold.token_ids == warm.token_ids == from_disk.token_ids == handed_over.token_ids == tokens
    assert cold.cached_tokens == 0 and min(warm.cached_tokens, from_disk.cached_tokens, handed_over.cached_tokens) >= 16
    assert stats["tiers"]["disk"]["hit_blocks"] > 0 and stats["spec_verify_rows"] > 0 and handoffs == 1
