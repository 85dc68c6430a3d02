"""Read a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files.

Only JSON and safetensors are read (never pickle), and nothing is fetched from a network.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvforge.manifest import KVDType, ManifestError, ModelSpec
from export.model import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


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
    files = sorted(Path(checkpoint).glob("*.safetensors"))
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
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(checkpoint):
        state.update(load_file(str(path)))
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k for k in model.state_dict() if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    missing = sorted(expected - state.keys())
    if missing:
        raise ManifestError(f"{checkpoint} lacks weights the architecture needs, e.g. {missing[:3]}")
    model.load_state_dict({k: state[k].to(torch.float32) for k in expected}, strict=False)
    return spec, model.eval()


def tokenizer_info(checkpoint: Path) -> dict:
    """Tokenizer files present and the special token ids the runtime needs."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / "tokenizer.json").is_file():
        raise ManifestError(f"{checkpoint} has no tokenizer.json (a fast tokenizer file is required)")
    cfg = read_config(checkpoint)
    eos = cfg.get("eos_token_id")
    return {
        "files": [f for f in TOKENIZER_FILES if (checkpoint / f).is_file()],
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": eos if isinstance(eos, list) else ([eos] if eos is not None else []),
        "pad_token_id": cfg.get("pad_token_id"),
    }
