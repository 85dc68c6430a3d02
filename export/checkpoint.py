"""Read a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files.

Only JSON and safetensors are read (never pickle), and nothing is fetched from a network.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open

from kvforge.manifest import GEMMA_LAYER_TYPES, KVDType, ManifestError, ModelSpec
from export.model import CausalLM, rope_rows_to_halves

# Copied into the export (and on into engines): the tokenizer, the chat template (transformers
# >= 4.43 saves it as chat_template.jinja, not in tokenizer_config.json) and generation_config.json.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
INDEX_FILE = "model.safetensors.index.json"


def read_config(checkpoint: Path) -> dict:
    path = Path(checkpoint)
    if not path.exists():
        raise ManifestError(f"model path {path} does not exist (give a preset name or a checkpoint directory)")
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ManifestError(f"{path} has no config.json; is it a Hugging Face checkpoint directory?")
    try:
        return json.loads(config.read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{config} is not valid JSON: {e}") from None


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards model.safetensors.index.json's weight_map
    names when it exists, else model.safetensors, else every *.safetensors. (Mistral's repositories
    keep a consolidated.safetensors, the same weights under other names, beside the shards.)"""
    checkpoint = Path(checkpoint)
    index = checkpoint / INDEX_FILE
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ManifestError(f"{index} has no readable weight_map: {e}") from None
        missing = [name for name in shards if not (checkpoint / name).is_file()]
        if missing:
            raise ManifestError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        return [checkpoint / name for name in shards]
    files = [checkpoint / "model.safetensors"] if (checkpoint / "model.safetensors").is_file() \
        else sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ManifestError(f"{checkpoint} has no *.safetensors weights (pickled .bin files are not loaded)")
    return files


def fingerprint(checkpoint: Path) -> str:
    """sha256 over config.json and the weight files: the identity of the source checkpoint."""
    digest = hashlib.sha256()
    for path in [Path(checkpoint) / "config.json", *weight_files(checkpoint)]:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def load_model(checkpoint: Path, layout: str, kv: KVDType) -> tuple[ModelSpec, CausalLM]:
    spec = ModelSpec.from_hf_config(read_config(checkpoint))
    model = CausalLM(spec, layout, kv)
    expected = {k for k in model.state_dict() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    fused = fused_weights(spec)
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="pt") as f:  # one tensor at a time: MTP layers and the like stay unread
            for key in (expected | fused.keys()).intersection(f.keys()):
                state[key] = f.get_tensor(key).to(torch.float32)
    for key, parts in fused.items():
        if key in state:
            state.update(zip([name for name, _ in parts], state.pop(key).split([rows for _, rows in parts])))
    missing = sorted(expected - state.keys())
    if missing:
        raise ManifestError(f"{checkpoint} lacks weights the architecture needs, e.g. {missing[:3]}")
    if spec.rope_interleave == "pairs-to-halves":
        permute_rope_rows(spec, state)
    if spec.architecture == "MiniCPM3ForCausalLM":
        fold_minicpm3_scales(read_config(checkpoint), spec, state)
    if spec.architecture in GEMMA_LAYER_TYPES:  # Gemma norms scale by (1 + weight): one RMSNormalization
        for key in [k for k in state if k.endswith("norm.weight")]:
            state[key] = 1.0 + state[key]
    model.load_state_dict(state, strict=False)
    return spec, model.eval()


def fused_weights(spec: ModelSpec) -> dict[str, list[tuple[str, int]]]:
    """Phi-3's fused projections -> the modules' own weights and their row counts: qkv_proj holds
    q, k, v and gate_up_proj gate, up, stacked by rows (split at load; the export folds them back
    into one MatMul each, as for every family)."""
    if spec.architecture != "Phi3ForCausalLM":
        return {}
    q, kv, ff = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    fused = {}
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}."
        fused[prefix + "self_attn.qkv_proj.weight"] = [(prefix + f"self_attn.{name}_proj.weight", rows)
                                                       for name, rows in (("q", q), ("k", kv), ("v", kv))]
        fused[prefix + "mlp.gate_up_proj.weight"] = [(prefix + "mlp.gate_proj.weight", ff),
                                                     (prefix + "mlp.up_proj.weight", ff)]
    return fused


def permute_rope_rows(spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
    """DeepSeek-V3 rope_interleave: reorder the rows producing q_pe and k_pe so a half-split
    RotaryEmbedding computes what apply_rotary_pos_emb_interleave computes (export.model)."""
    dr, qk = spec.qk_rope_head_dim, spec.qk_head_dim
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for name, heads, width in (("q_proj.weight", spec.num_heads, qk), ("q_b_proj.weight", spec.num_heads, qk),
                                   ("kv_a_proj_with_mqa.weight", 1, spec.kv_lora_rank + dr),
                                   ("kv_a_proj_with_mqa.bias", 1, spec.kv_lora_rank + dr)):
            if prefix + name in state:
                state[prefix + name] = rope_rows_to_halves(state[prefix + name], heads, width, dr)


# MiniCPM3Config's defaults (transformers), for a config.json that leaves them out
MINICPM3_DEFAULTS = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}


def fold_minicpm3_scales(cfg: dict, spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
    """MiniCPM3 multiplies the embeddings by scale_emb, each residual branch (attention, MLP) by
    scale_depth / sqrt(layers) and divides the final hidden state by hidden_size / dim_model_base
    before lm_head; folded into weights here (o_proj, down_proj, the final norm; the embedding,
    and for tied embeddings the final norm once more, since lm_head then reads the scaled
    embedding), the graph is DeepSeek's. A null scale_depth / dim_model_base means no scaling."""
    value = {k: cfg.get(k, default) for k, default in MINICPM3_DEFAULTS.items()}
    layers = spec.num_layers
    residual = (value["scale_depth"] if value["scale_depth"] is not None else math.sqrt(layers)) / math.sqrt(layers)
    logits_scaling = spec.hidden_size / (value["dim_model_base"] or spec.hidden_size)
    state["model.embed_tokens.weight"] = state["model.embed_tokens.weight"] * value["scale_emb"]
    norm_scale = 1.0 / logits_scaling / (value["scale_emb"] if spec.tie_word_embeddings else 1.0)
    state["model.norm.weight"] = state["model.norm.weight"] * norm_scale
    for i in range(layers):
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            if key in state:
                state[key] = state[key] * residual


def tokenizer_info(checkpoint: Path) -> dict:
    """Tokenizer files present and the special token ids the runtime needs."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "tokenizer.json").is_file():
        raise ManifestError(f"{checkpoint} has no tokenizer.json (a fast tokenizer file is required)")
    cfg = read_config(checkpoint)
    generation = checkpoint / "generation_config.json"
    try:
        generation_cfg = json.loads(generation.read_text()) if generation.is_file() else {}
    except json.JSONDecodeError as e:
        raise ManifestError(f"{generation} is not valid JSON: {e}") from None
    # Instruct checkpoints list their turn-end tokens (<|eot_id|>, <end_of_turn>) in
    # generation_config.json only: each of them ends generation too.
    eos = []
    for value in (cfg.get("eos_token_id"), generation_cfg.get("eos_token_id")):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in eos:
                eos.append(int(token))
    return {
        "files": [f for f in TOKENIZER_FILES if (checkpoint / f).is_file()],
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": eos,
        "pad_token_id": cfg.get("pad_token_id"),
    }
