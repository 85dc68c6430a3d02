"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE) as tiny Hugging Face checkpoints
with random weights, saved by transformers 5.24 (per-expert tensors in the files): exported with one
ONNX Runtime MoE node per sparse layer and run by the in-process engine and the runner against
transformers' generate(); int8/int4 engines with QMoE experts and fp32 routers; the config facts
(decoder_sparse_step, mlp_only_layers) and the refusals."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from kvforge.manifest import Manifest, ManifestError, ModelSpec
from tests.families import COMMON, EXPORT_CONTEXT, NEW_TOKENS, PROMPT_TOKENS, VOCAB, greedy_reference

LOGPROB_TOLERANCE = 2e-3
MOE = dict(num_experts_per_tok=2)
CHECKPOINTS = {
    # every layer sparse, 8 experts of width 32, top-2 renormalized
    "mixtral": ("Mixtral", dict(num_local_experts=8, intermediate_size=32)),
    # Qwen3-30B-A3B's routing (norm_topk_prob) and q/k norms; layer 1 dense by mlp_only_layers (its
    # intermediate_size 96 unlike the experts' 24)
    "qwen3-moe": ("Qwen3Moe", dict(num_experts=8, moe_intermediate_size=24, norm_topk_prob=True,
                                   num_hidden_layers=3, mlp_only_layers=[1])),
    # Qwen2-MoE's: unnormalized top-k, q/k/v biases, a shared expert behind its sigmoid gate, and
    # decoder_sparse_step 2 (layers 1 and 3 sparse)
    "qwen2-moe": ("Qwen2Moe", dict(num_experts=6, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                   num_hidden_layers=4, decoder_sparse_step=2)),
}
SPARSE_LAYERS = {"mixtral": (0, 1), "qwen3-moe": (0, 2), "qwen2-moe": (1, 3)}


def hf_config(name: str):
    import transformers

    prefix, overrides = CHECKPOINTS[name]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **MOE, **overrides})
    config.architectures = [f"{prefix}ForCausalLM"]
    return config


def experts_routed(model, tokens: list[int]) -> set[tuple[int, int]]:
    """(layer, expert) pairs transformers' routers pick for these tokens."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([tokens]), output_router_logits=True).router_logits
    k = model.config.num_experts_per_tok
    return {(layer, int(e)) for layer, lg in enumerate(logits) for e in lg.topk(k, dim=-1).indices.flatten()}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory, family_tokenizer_dir):
    """name -> (dir, prompt, transformers' greedy tokens, their log p, the model)."""
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-checkpoints")
    prompt = np.random.default_rng(0).integers(3, VOCAB, PROMPT_TOKENS).tolist()
    made = {}
    for name in CHECKPOINTS:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_config(name)).eval()
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.normal_(1.0, 0.1) if p.dim() == 1 and "norm" in key else p.normal_(0.0, 0.1)
        directory = root / name
        model.save_pretrained(directory)
        for file in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(family_tokenizer_dir / file, directory / file)
        made[name] = (directory, prompt, *greedy_reference(model, prompt), model)
    return made


@pytest.fixture(scope="module")
def moe_exports(tmp_path_factory, moe_checkpoints):
    from export.__main__ import export

    root = tmp_path_factory.mktemp("moe-exports")
    made = {}

    def make(name, layout="inplace"):
        if (name, layout) not in made:
            made[name, layout] = root / f"{name}-{layout}"
            export(str(moe_checkpoints[name][0]), made[name, layout], layout, "fp32", EXPORT_CONTEXT, None)
        return made[name, layout]

    return make


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_moe_generates_what_transformers_generates(moe_exports, moe_checkpoints, name):
    """Greedy, the prompt in one step then decode steps: through LLMEngine (in place) and the runner
    (concat), transformers' tokens and log-probs within LOGPROB_TOLERANCE, every expert of every
    sparse layer routed to along the way."""
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.test_families import runner_greedy

    _, prompt, tokens, logprobs, model = moe_checkpoints[name]
    config = model.config
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    assert len(experts_routed(model, prompt + tokens)) == len(SPARSE_LAYERS[name]) * experts
    with LLMEngine(moe_exports(name), threads=1, prefix_cache=False) as engine:
        result = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True))[0]
    for got in ((result.token_ids, result.logprobs), runner_greedy(moe_exports(name, "concat"), prompt)):
        assert got[0] == tokens
        assert max(abs(a - b) for a, b in zip(got[1], logprobs)) <= LOGPROB_TOLERANCE
    assert len(set(tokens)) > 8  # not a degenerate loop
