"""Tiny Hugging Face checkpoints of every family kvforge exports (FAMILIES, and the mixture-of-experts
ones: MOE_FAMILIES), saved by transformers with random weights, and their fp32 exports: session
fixtures (registered in conftest.py) that tests/test_families.py and tests/test_family_weights.py
share, and tests/test_moe.py and tests/test_deepseek_moe.py, so each checkpoint is made and each
export traced once per run."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest


VOCAB = 4096  # models/stdlib-llama's tokenizer
ORIGINAL = 32  # original_max_position_embeddings: the generation runs past it
PROMPT_TOKENS, NEW_TOKENS = 28, 44  # positions 0..71: prompts and generations longer than the windows
EXPORT_CONTEXT = 256  # the checkpoints' max_position_embeddings: Llama 3.1's chat (121 tokens) and its answer
PROMPT = np.random.default_rng(0).integers(3, VOCAB, PROMPT_TOKENS).tolist()  # every checkpoint's
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # Llama 3.1's scaling with a small original length (at theta 10000 and head_dim 16 one frequency
    # is kept, one smoothed, the rest divided by the factor); sharded, beside a consolidated.safetensors;
    # an instruct checkpoint (INSTRUCT)
    "llama3.1": ("Llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL})),
    # Qwen2.5's YaRN (cos/sin x its mscale), biases, tied embeddings; a window that does not apply
    # (use_sliding_window false), shorter than the generation
    "qwen2-yarn": ("Qwen2", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": ORIGINAL},
                                 tie_word_embeddings=True, sliding_window=24, use_sliding_window=False)),
    # q/k RMSNorm per head, an explicit head_dim unlike hidden / heads, linear scaling
    "qwen3-linear": ("Qwen3", dict(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 2.0})),
    # layer 1 applies no RoPE; untied (random tied embeddings loop on 4 tokens here; qwen2-yarn ties)
    "smollm3": ("SmolLM3", dict(no_rope_layers=[1, 0], tie_word_embeddings=False)),
    # sliding windows shorter than the prompt, not multiples of 16: Mistral's on every layer,
    # Qwen2's on the layers from max_window_layers
    "mistral-window": ("Mistral", dict(sliding_window=21)),
    "qwen2-window": ("Qwen2", dict(sliding_window=25, use_sliding_window=True, max_window_layers=1)),
    # attention and final softcaps that bite, a query_pre_attn_scalar unlike head_dim; layer 0 slides
    "gemma2": ("Gemma2", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=22, attn_logit_softcapping=2.0,
                              final_logit_softcapping=6.0)),
    # q/k norms, local (theta 10,000) and global (1e6, linear x2) RoPE as 5.24 saves them; layer 1 slides
    "gemma3": ("Gemma3Text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=23,
                                  layer_types=["full_attention", "sliding_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                      "rope_theta": 1e6},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # fused qkv_proj / gate_up_proj, RoPE on half of each head, a window on every layer
    "phi3": ("Phi3", dict(partial_rotary_factor=0.5, sliding_window=26)),
    # LongRoPE as Phi-3.5-mini's config has it (original length top level, factors in rope_scaling,
    # the attention factor from max_position_embeddings / original): the prompt fits the original
    # length and the generation passes it (transformers recomputes its cache there)
    "phi3.5-longrope": ("Phi3", dict(original_max_position_embeddings=ORIGINAL, rope_scaling={
        "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 1.5, 2.5, 4.0, 7.0, 12.0, 20.0, 32.0]})),
    # Phi-4-mini's: RoPE on three quarters of each head (6 frequencies), tied embeddings
    "phi4-mini-longrope": ("Phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                                        original_max_position_embeddings=ORIGINAL, rope_scaling={
                                            "rope_type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
                                            "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})),
}

# DeepSeek's MLA dims that all differ (as tests/test_mla.py's), 3 layers: layer 0 dense (intermediate
# 96), layers 1 and 2 sparse over 8 experts of width 24 (unlike every other width)
DEEPSEEK = dict(COMMON, num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1, n_routed_experts=8,
                moe_intermediate_size=24)
# Every expert of every sparse layer is routed to along each one's prompt and generation
# (tests/test_moe.py and tests/test_deepseek_moe.py check it).
MOE_FAMILIES = {
    # every layer sparse, 8 experts of width 32, top-2 renormalized
    "mixtral": ("Mixtral", dict(COMMON, num_experts_per_tok=2, num_local_experts=8, intermediate_size=32)),
    # Qwen3-30B-A3B's routing (norm_topk_prob) and q/k norms; layer 1 dense by mlp_only_layers (its
    # intermediate_size 96 unlike the experts' 24)
    "qwen3-moe": ("Qwen3Moe", dict(COMMON, num_experts_per_tok=2, num_experts=8, moe_intermediate_size=24,
                                   norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1])),
    # Qwen2-MoE's: unnormalized top-k, q/k/v biases, a shared expert behind its sigmoid gate, and
    # decoder_sparse_step 2 (layers 1 and 3 sparse)
    "qwen2-moe": ("Qwen2Moe", dict(COMMON, num_experts_per_tok=2, num_experts=4, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=40, num_hidden_layers=4, decoder_sparse_step=2)),
    # DeepSeek-V2-Lite's routing: softmax top 3 of all experts, not renormalized; a scaling factor
    # that is not 1 and one shared expert
    "deepseek-v2-greedy": ("DeepseekV2", dict(DEEPSEEK, topk_method="greedy", num_experts_per_tok=3,
                                              n_shared_experts=1, routed_scaling_factor=1.5)),
    # DeepSeek-V2's: the top 3 experts of the 2 groups (of 4 pairs) with the highest max score; two
    # shared experts
    "deepseek-v2-group": ("DeepseekV2", dict(DEEPSEEK, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             num_experts_per_tok=3, n_shared_experts=2, routed_scaling_factor=2.0)),
    # DeepSeek-V3's: sigmoid scores, a random e_score_correction_bias choosing the 2 groups (of 4
    # pairs) and the top 2 experts, weights renormalized x 2.5; interleaved rope
    "deepseek-v3": ("DeepseekV3", dict(DEEPSEEK, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
                                       norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True)),
}

STDLIB_LLAMA = Path(__file__).resolve().parents[1] / "models" / "stdlib-llama"  # its tokenizer
TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"  # public templates, byte for byte (README.md there)
# family -> the public chat template its instruct checkpoint ships, and a chat body (as the OpenAI
# API takes it) that checkpoint is asked; every checkpoint's tokenizer puts <s> before every text.
# (Llama 3.1's tool preamble alone outgrows these checkpoints' 256 positions: tests/test_chat_tools.py
# renders tools, tests/test_thinking_models.py serves them on 2,048-position checkpoints.)
INSTRUCT = {
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja",
                 {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paris?"}]}),
    "qwen3-linear": ("Qwen-Qwen3-0.6B.jinja", {"messages": [{"role": "user", "content": "def f(x):"}],
                                               "chat_template_kwargs": {"enable_thinking": False}}),
    "gemma3": ("google-gemma-3-1b-it.jinja",
               {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]}),
}


def hf_config(family: str):
    import transformers

    prefix, overrides = FAMILIES[family]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **overrides})
    config.architectures = [f"{prefix.removesuffix('Text')}ForCausalLM"]
    return config


def moe_hf_config(name: str, **overrides):
    import transformers

    prefix, settings = MOE_FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**{**settings, **overrides})
    config.architectures = [f"{prefix}ForCausalLM"]
    return config


@pytest.fixture(scope="session")
def family_tokenizer_dir(tmp_path_factory):
    """models/stdlib-llama's tokenizer with a post-processor that puts <s> before every text, as
    Llama 3's and Gemma's do."""
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(str(STDLIB_LLAMA / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    directory = tmp_path_factory.mktemp("families-tokenizer")
    tokenizer.save(str(directory / "tokenizer.json"))
    shutil.copy(STDLIB_LLAMA / "tokenizer_config.json", directory / "tokenizer_config.json")
    return directory


class Chat(NamedTuple):
    """An instruct checkpoint's INSTRUCT chat: its prompt as apply_chat_template(tokenize=True) makes
    it, transformers' greedy answer up to the turn end, and that turn end (generation_config.json's)."""
    ids: list[int]
    answer: list[int]
    turn_end: int


class Checkpoint(NamedTuple):
    directory: Path
    prompt: list[int]
    tokens: list[int]  # transformers' greedy tokens after the prompt
    logprobs: list[float]
    chat: Chat | None = None  # an instruct checkpoint's
    model: object = None  # a mixture-of-experts checkpoint's transformers model (whose routers are asked)


class Made(dict):
    """key -> make(key), made on first use: a module that asks for one checkpoint or export pays
    for that one only."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]


def transformers_chat_ids(directory: Path, body: dict) -> list[int]:
    """apply_chat_template's prompt for an OpenAI chat body (chat_template_kwargs as its kwargs)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(directory).apply_chat_template(
        body["messages"], tools=body.get("tools"), add_generation_prompt=True, return_dict=False,
        **body.get("chat_template_kwargs", {})))


def greedy_reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' cached greedy generate(), NEW_TOKENS tokens whatever they are, and each one's log p."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(logits[0].double(), -1)[t]) for logits, t in zip(out.logits, tokens)]
    return tokens, logprobs


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory, family_tokenizer_dir):
    """family -> Checkpoint: dir, prompt, transformers' greedy tokens and their log-probs; the
    INSTRUCT families' with their chat (make_instruct)."""
    import torch
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("families-checkpoints")
    made = {}
    for family in FAMILIES:
        model = random_model(hf_config(family))
        directory = root / family
        if family == "llama3.1":  # shards and their index, and Mistral-style consolidated weights beside them
            save_checkpoint(model, directory, family_tokenizer_dir, max_shard_size="200KB")
            assert (directory / "model.safetensors.index.json").is_file()
            save_file({k: torch.zeros_like(v) for k, v in model.state_dict().items()},
                      str(directory / "consolidated.safetensors"))
        else:
            save_checkpoint(model, directory, family_tokenizer_dir)
        made[family] = Checkpoint(directory, PROMPT, *greedy_reference(model, PROMPT),
                                  chat=make_instruct(directory, model, *INSTRUCT[family]) if family in INSTRUCT else None)
    return made


@pytest.fixture(scope="session")
def moe_checkpoints(tmp_path_factory, family_tokenizer_dir):
    """name -> Checkpoint of MOE_FAMILIES[name], with its transformers model, made on first use."""
    import torch

    root = tmp_path_factory.mktemp("moe-checkpoints")

    def make(name):
        model = random_model(moe_hf_config(name))
        with torch.no_grad():  # DeepSeek-V3's bias, which random_model leaves at zero: large enough to change choices
            for buffer_name, buffer in model.named_buffers():
                if buffer_name.endswith("e_score_correction_bias"):
                    buffer.normal_(0.0, 0.2)
        save_checkpoint(model, root / name, family_tokenizer_dir)
        return Checkpoint(root / name, PROMPT, *greedy_reference(model, PROMPT), model=model)

    return Made(make)


def save_checkpoint(model, directory: Path, tokenizer_dir: Path, **save) -> None:
    """A transformers model's save_pretrained(**save), with the families' tokenizer beside it."""
    model.save_pretrained(directory, **save)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)


def random_model(config):
    """transformers' model of a config, seeded: norms N(1, 0.1), every other weight
    N(0, 0.1), so the logits spread over a few units (no near-ties among greedy tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 and "norm" in name else p.normal_(0.0, 0.1)
    return model


def make_instruct(directory: Path, model, template: str, body: dict) -> Chat:
    """Makes `directory` an instruct checkpoint: the public template as chat_template.jinja, and a
    turn end in generation_config.json's eos_token_id beside the config's EOS: the first greedy
    token of the chat's answer, from the 6th on, that is new in it."""
    (directory / "chat_template.jinja").write_text((TEMPLATES / template).read_text())
    ids = transformers_chat_ids(directory, body)
    tokens = greedy_reference(model, ids)[0]
    end = next(i for i in range(5, NEW_TOKENS) if tokens[i] not in tokens[:i])
    assert 2 not in tokens[:end]  # the config's own EOS would end it first
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, tokens[end]]}))
    return Chat(ids, tokens[:end], tokens[end])


def export_maker(checkpoints, root: Path):
    """exports(name, layout, max_chunk) -> the fp32 export of checkpoints[name], made once (what
    `python -m export` runs)."""
    from export.__main__ import export

    def make(key):
        name, layout, max_chunk = key
        out = root / f"{name}-{layout}-{max_chunk}"
        export(str(checkpoints[name].directory), out, layout, "fp32", EXPORT_CONTEXT, max_chunk)
        return out

    made = Made(make)
    return lambda name, layout="inplace", max_chunk=None: made[name, layout, max_chunk]


@pytest.fixture(scope="session")
def family_exports(tmp_path_factory, family_checkpoints):
    """family_exports(family, layout, max_chunk) -> export dir."""
    return export_maker(family_checkpoints, tmp_path_factory.mktemp("families-exports"))


@pytest.fixture(scope="session")
def moe_exports(tmp_path_factory, moe_checkpoints):
    """moe_exports(name, layout) -> export dir."""
    return export_maker(moe_checkpoints, tmp_path_factory.mktemp("moe-exports"))


