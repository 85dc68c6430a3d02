"""DeepSeek-V2/V3 mixture-of-experts layers (Multi-head Latent Attention, dense layers before
first_k_dense_replace, shared experts): tiny Hugging Face checkpoints with random weights
(tests/families.py's MOE_FAMILIES), saved by transformers 5.24 (per-expert tensors in the files),
exported with DeepSeek's routing in standard ops in front of one ONNX Runtime MoE node per sparse
layer, run by the in-process engine (in place) and the runner (concat) against transformers'
generate() (tests/test_moe.py serves them through Triton); an int4 engine; the config facts and
the refusals."""
from __future__ import annotations

import pytest

from kvforge.manifest import Manifest, ManifestError, ModelSpec
from tests.families import MOE_FAMILIES, NEW_TOKENS, moe_hf_config

LOGPROB_TOLERANCE = 2e-3
SPARSE_LAYERS = (1, 2)
# Each routing exported once (an MLA export costs 15-20 s here; the layout changes the attention's
# cache, not the routing): V2 greedy in the concat layout through the runner, the others in place
# through LLMEngine (and through Triton: tests/test_moe.py)
LAYOUTS = {"deepseek-v2-greedy": "concat", "deepseek-v2-group": "inplace", "deepseek-v3": "inplace"}


def choices(model, tokens: list[int]) -> list:
    """The experts transformers' router of each sparse layer picks for these tokens: [tokens, k] each."""
    import torch

    picked = []
    hooks = [model.model.layers[i].mlp.gate.register_forward_hook(lambda module, args, out: picked.append(out[2]))
             for i in SPARSE_LAYERS]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for hook in hooks:
        hook.remove()
    return picked


def routed(model, tokens: list[int]) -> set[tuple[int, int]]:
    """(layer, expert) pairs transformers' routers pick for these tokens."""
    return {(layer, int(e)) for layer, chosen in zip(SPARSE_LAYERS, choices(model, tokens)) for e in chosen.flatten()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_deepseek_moe_generates_what_transformers_generates(moe_exports, moe_checkpoints, name):
    """Greedy, the prompt in one step then decode steps, through LLMEngine (in place) or the runner
    (concat): transformers' tokens and log-probs within LOGPROB_TOLERANCE, every expert of every
    sparse layer routed to along the way; one MoE node per sparse layer, the dense layer an MLP."""
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.test_families import runner_greedy

    directory, prompt, tokens, logprobs = moe_checkpoints[name][:4]
    model = moe_checkpoints[name].model
    assert len(routed(model, prompt + tokens)) == len(SPARSE_LAYERS) * 8
    _eager_twin_matches(directory, model, prompt + tokens)
    export_dir = moe_exports(name, LAYOUTS[name])
    spec = Manifest.load(export_dir).model
    assert spec.sparse_layers == SPARSE_LAYERS and spec.routing == MOE_FAMILIES[name][1].get("topk_method", "noaux_tc")
    nodes, _ = _nodes(export_dir / "model.onnx", "MoE")
    assert len(nodes) == len(SPARSE_LAYERS)
    if LAYOUTS[name] == "inplace":
        with LLMEngine(export_dir, threads=1, prefix_cache=False) as engine:
            result = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True))[0]
        got = result.token_ids, result.logprobs
    else:
        got = runner_greedy(export_dir, prompt)
    assert got[0] == tokens
    assert max(abs(a - b) for a, b in zip(got[1], logprobs, strict=True)) <= LOGPROB_TOLERANCE
    assert len(set(tokens)) > 8  # not a degenerate loop


def _eager_twin_matches(directory, model, tokens: list[int]) -> None:
    """export.model's DeepseekMoE run eagerly (its routing, then route(): the node's twin) gives
    transformers' logits at every position."""
    import torch

    from export.checkpoint import load_model
    from kvforge.manifest import KV_DTYPES

    spec, ours = load_model(directory, "concat", KV_DTYPES["fp32"])
    ids = torch.tensor([tokens])
    empty = [torch.zeros(1, 1, 0, spec.head_dim)] * spec.num_layers  # one latent per layer
    with torch.no_grad():
        got = ours(ids, torch.ones_like(ids), torch.arange(len(tokens))[None], *empty)[0]
        torch.testing.assert_close(got, model(ids).logits, atol=1e-4, rtol=0)


def test_v3_bias_chooses_experts(moe_checkpoints):
    """The checkpoint's e_score_correction_bias changes which experts transformers routes to (so the
    parity above covers it)."""
    import torch

    _, prompt, tokens = moe_checkpoints["deepseek-v3"][:3]
    model = moe_checkpoints["deepseek-v3"].model
    biased = [c.sort(dim=-1).values for c in choices(model, prompt + tokens)]
    biases = [model.model.layers[i].mlp.gate.e_score_correction_bias for i in SPARSE_LAYERS]
    saved = [bias.clone() for bias in biases]
    with torch.no_grad():
        for bias in biases:
            bias.zero_()
        unbiased = [c.sort(dim=-1).values for c in choices(model, prompt + tokens)]
        for bias, value in zip(biases, saved):
            bias.copy_(value)
    assert any(not torch.equal(a, b) for a, b in zip(biased, unbiased))


def _nodes(path, op: str):
    import onnx

    model = onnx.load(str(path))
    return [n for n in model.graph.node if (n.domain, n.op_type) == ("com.microsoft", op)], model


@pytest.mark.parametrize("name", ["deepseek-v2-group", "deepseek-v3"])
def test_routers_stay_fp32(moe_exports, name):
    """The build's keep list finds each router behind the routing ops (V2: softmax, TopK,
    ScatterElements; V3 through its sigmoid too): the projections to the 8 experts, one per sparse layer."""
    import onnx

    from engines.onnxruntime_build import routing_projections

    model = onnx.load(str(moe_exports(name) / "model.onnx"))
    weights = {t.name: tuple(t.dims) for t in model.graph.initializer}
    nodes = {n.name: n for n in model.graph.node}
    keep = set(routing_projections(model))
    assert sorted(weights[nodes[k].input[1]] for k in keep) in ([(8, 64)] * 2, [(64, 8)] * 2)


def test_v2_int4_engine(moe_exports, moe_checkpoints, tmp_path):
    """`engines build --weights int4`: QMoE experts, the routers (behind the routing ops) still fp32
    MatMuls, every other projection quantized; it generates, its log-probs of the export's greedy
    tokens near the export's own (tests/test_family_weights.py's bound)."""
    import onnx

    from runtime.greedy import followed_logprobs
    from runtime.runners import open_runner
    from tests.conftest import run_cli
    from tests.test_family_weights import logprob_bound

    export_dir, out = moe_exports("deepseek-v2-group"), tmp_path / "int4"
    result = run_cli("engines", "build", str(export_dir), "--weights", "int4", "--out", str(out))
    assert result.returncode == 0, result.stderr
    nodes, model = _nodes(out / "model.onnx", "QMoE")
    assert len(nodes) == len(SPARSE_LAYERS) and not _nodes(out / "model.onnx", "MoE")[0]
    weights = {t.name: t for t in model.graph.initializer}
    floats = [weights[i] for n in model.graph.node if n.op_type in ("MatMul", "Gemm", "FusedGemm")
              for i in n.input if i in weights and len(weights[i].dims) == 2]
    assert sorted(tuple(w.dims) for w in floats) in ([(8, 64)] * 2, [(64, 8)] * 2)  # the routers alone
    assert all(w.data_type == onnx.TensorProto.FLOAT for w in floats)
    prompt = moe_checkpoints["deepseek-v2-group"].prompt
    tokens, (reference, got) = followed_logprobs([open_runner(d, threads=1) for d in (export_dir, out)], prompt, 16)
    assert len(tokens) == 16
    bound = logprob_bound("int4", Manifest.load(out).engine["parity_logit_range"])
    assert 0 < max(abs(a - b) for a, b in zip(reference, got)) <= bound


def test_deepseek_moe_config_facts_and_refusals():
    """Config facts as transformers 5.24 reads them (its defaults for keys left out); what the export
    does not compute is refused, naming why."""
    def spec(name, drop=(), **overrides):
        config = {k: v for k, v in moe_hf_config(name).to_dict().items() if k not in drop}
        return ModelSpec.from_hf_config({**config, **overrides})

    v2 = spec("deepseek-v2-group")
    assert (v2.routing, v2.expert_groups, v2.expert_groups_per_token, v2.experts_per_token) == \
        ("group_limited_greedy", 4, 2, 3)
    assert (v2.shared_expert_intermediate_size, v2.routed_scaling_factor, v2.norm_topk_prob) == (48, 2.0, False)
    assert not spec("deepseek-v2-greedy", norm_topk_prob=True).norm_topk_prob  # DeepseekV2TopkRouter does not read it
    assert spec("deepseek-v2-greedy", drop=("topk_method",)).routing == "greedy"  # DeepseekV2Config's default
    v3 = spec("deepseek-v3", scoring_func="sigmoid", topk_method="noaux_tc")  # the hub's keys, not read by 5.24
    assert (v3.routing, v3.norm_topk_prob, v3.routed_scaling_factor, v3.sparse_layers) == \
        ("noaux_tc", True, 2.5, (1, 2))
    assert spec("deepseek-v3", drop=("routed_scaling_factor",)).routed_scaling_factor == 2.5
    assert spec("deepseek-v3", first_k_dense_replace=3).num_experts == 0  # every layer dense
    assert spec("deepseek-v3", n_routed_experts=None).sparse_layers == ()
    refusals = {
        ("deepseek-v2-greedy", "topk_method", "noaux_tc"): "topk_method 'noaux_tc' is not exported.*greedy or "
                                                           "group_limited_greedy.*softmax top-k only",
        ("deepseek-v2-group", "n_group", None): "group_limited_greedy routing needs n_group dividing n_routed_experts=8",
        ("deepseek-v2-group", "n_group", 3): "n_group dividing",
        ("deepseek-v3", "topk_group", 5): "topk_group in 1..n_group",
        ("deepseek-v3", "n_group", 8): "groups are scored by their top two experts.*1 expert per group",
        ("deepseek-v3", "num_experts_per_tok", 5): "num_experts_per_tok=5 is more than the topk_group=2 groups of 2",
        ("deepseek-v2-group", "num_experts_per_tok", 9): "num_experts_per_tok=9 must be in 1..8",
    }
    for (name, key, value), message in refusals.items():
        with pytest.raises(ManifestError, match=message):
            spec(name, **{key: value})
    with pytest.raises(ManifestError, match="quantization_config \\(quant_method 'fp8'"):
        spec("deepseek-v3", quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    cache_only = ModelSpec.from_hf_config({**moe_hf_config("deepseek-v3").to_dict(), "n_group": 3}, cache_only=True)
    assert cache_only.attention == "mla"
    with pytest.raises(ManifestError, match="unknown MoE routing 'sigmoid'"):
        ModelSpec(**{**spec("deepseek-v3").__dict__, "routing": "sigmoid"})
