"""Read a local Hugging Face checkpoint directory: config.json, *.safetensors, tokenizer files.

Only JSON and safetensors are read (never pickle), and nothing is fetched from a network.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

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


class CheckpointWeights:
    """A checkpoint's tensors as `model`'s parameters compute with them (float32, fused rows split,
    experts stacked, the family's adapt_weights applied), read a few at a time: exporting holds
    one layer's weights, never the model's. Every needed tensor is checked present up front."""

    def __init__(self, checkpoint: Path, model: CausalLM, config: dict):
        self.checkpoint, self.model, self.config = Path(checkpoint), model, config
        # a tied lm_head is the embedding table under another name (the exporter may use either)
        self.alias = {"lm_head.weight": "model.embed_tokens.weight"} if model.spec.tie_word_embeddings else {}
        self.expected = list(model.state_dict())
        self.stacked, self.fused = model.stacked_weights(), model.fused_weights()
        self.split = {name: key for key, parts in self.fused.items() for name, _ in parts}
        self.file_of: dict[str, Path] = {}
        for path in weight_files(checkpoint):
            with safe_open(str(path), framework="pt") as f:  # the header only
                self.file_of.update((key, path) for key in f.keys())
        needed = {key for name in self.expected for key in self.sources(name)}
        missing = sorted(needed - self.file_of.keys())
        if missing:
            raise ManifestError(f"{checkpoint} lacks weights the architecture needs, e.g. {missing[:3]}")

    def sources(self, name: str) -> list[str]:
        """The checkpoint tensors parameter `name` is made of."""
        name = self.alias.get(name, name)
        parts = self.stacked.get(name)
        if parts is not None:
            return [parts] if isinstance(parts, str) else [k for expert in parts for k in expert]
        if name in self.split:
            return [self.split[name]]
        return [name]

    def groups(self) -> list[list[str]]:
        """The parameters in read order, a decoder layer's together (what adapt_weights rewrites
        together never spans two layers), every other tensor on its own."""
        layers: dict[str, list[str]] = {}
        for name in self.expected:
            head = name.split(".")
            key = ".".join(head[:3]) if head[:2] == ["model", "layers"] else name
            layers.setdefault(key, []).append(name)
        return list(layers.values())

    def read(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Parameter name -> float32 tensor, for `names`."""
        keys = sorted({key for name in names for key in self.sources(name)})
        raw: dict[str, torch.Tensor] = {}
        for path in sorted({self.file_of[key] for key in keys}):
            with safe_open(str(path), framework="pt") as f:
                for key in keys:
                    if self.file_of[key] == path:
                        raw[key] = f.get_tensor(key).to(torch.float32)
        state: dict[str, torch.Tensor] = {}
        for key, parts in self.fused.items():
            if key in raw:
                state.update(zip([name for name, _ in parts], raw.pop(key).split([rows for _, rows in parts])))
        for name in {self.alias.get(name, name) for name in names}:
            parts = self.stacked.get(name)
            if parts is not None:
                state[name] = raw.pop(parts) if isinstance(parts, str) else \
                    torch.stack([torch.cat([raw.pop(k) for k in expert]) for expert in parts])
        state.update(raw)
        # the family's: DeepSeek-V3's rotary rows, MiniCPM3's scales, Gemma's norms (each per tensor)
        self.model.adapt_weights(state, self.config)
        return {name: state[self.alias.get(name, name)] for name in names}


def skeleton(spec: ModelSpec, layout: str, kv: KVDType) -> CausalLM:
    """The model with its parameters allocated but never written (no page of them is touched, so
    they cost no memory): what tracing needs, since the graph depends on shapes only. Buffers
    (the static KV scales) start at one, as a built model's do."""
    with torch.device("meta"):
        model = build_model(spec, layout, kv)
    allocated: dict[int, nn.Parameter] = {}  # by the meta parameter: a tied lm_head stays the embedding table
    for module in model.modules():
        for name, parameter in module._parameters.items():
            if parameter is not None:
                if id(parameter) not in allocated:
                    allocated[id(parameter)] = nn.Parameter(torch.empty(parameter.shape), requires_grad=False)
                module._parameters[name] = allocated[id(parameter)]
        for name, buffer in module._buffers.items():
            module._buffers[name] = torch.ones(buffer.shape)
    return model.eval()


def load_model(checkpoint: Path, layout: str, kv: KVDType) -> tuple[ModelSpec, CausalLM]:
    """The model with all of the checkpoint's weights in memory (calibration and tests)."""
    config = read_config(checkpoint)
    spec = ModelSpec.from_hf_config(config)
    model = skeleton(spec, layout, kv)
    weights = CheckpointWeights(checkpoint, model, config)
    for names in weights.groups():
        model.load_state_dict(weights.read(names), strict=False)
    return spec, model


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
