"""Read a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files.

Only JSON and safetensors are read (never pickle), and nothing is fetched from a network.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from kvforge.manifest import KVDType, ManifestError, ModelSpec
from export.model import CausalLM, build_model

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
    config = read_config(checkpoint)
    spec = ModelSpec.from_hf_config(config)
    model = build_model(spec, layout, kv)
    expected = {k for k in model.state_dict() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    fused, stacked = model.fused_weights(), model.stacked_weights()
    sources = {key for parts in stacked.values()
               for key in ([parts] if isinstance(parts, str) else [k for expert in parts for k in expert])}
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="pt") as f:  # one tensor at a time: MTP layers and the like stay unread
            for key in (expected | fused.keys() | sources).intersection(f.keys()):
                state[key] = f.get_tensor(key).to(torch.float32)
    for key, parts in fused.items():
        if key in state:
            state.update(zip([name for name, _ in parts], state.pop(key).split([rows for _, rows in parts])))
    missing = sorted(((expected - stacked.keys()) | sources) - state.keys())
    if missing:
        raise ManifestError(f"{checkpoint} lacks weights the architecture needs, e.g. {missing[:3]}")
    for key, parts in stacked.items():
        state[key] = state.pop(parts) if isinstance(parts, str) else \
            torch.stack([torch.cat([state.pop(k) for k in expert]) for expert in parts])
    model.adapt_weights(state, config)  # the family's: DeepSeek-V3's rotary rows, MiniCPM3's scales, Gemma's norms
    model.load_state_dict(state, strict=False)
    return spec, model.eval()


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
