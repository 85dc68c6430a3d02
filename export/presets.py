"""Built-in presets, materialized as ordinary Hugging Face checkpoint directories.

A preset becomes config.json + model.safetensors (random weights from a fixed seed) + a
byte-level BPE tokenizer trained on the Python standard library's own source (on every
machine, offline). From then on a preset is loaded exactly like a user's checkpoint.
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvforge.cli import atomic_directory
from kvforge.manifest import KV_DTYPES, ModelSpec
from export.model import build_model

PRESETS = {
    # GQA, ~3.4M parameters: fast enough for every test.
    "tiny-llama": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=688, vocab_size=4096, max_position_embeddings=2048),
    # ~124M parameters (hidden 1024, 8 layers, 16 heads, 4 KV heads): the benchmark model.
    "small-llama": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                        intermediate_size=2816, vocab_size=8192, max_position_embeddings=4096),
    # small-llama with a Llama-2-sized 32,000-token vocabulary (~156M parameters): the lm_head is
    # a fifth of the FLOPs per token, as in Llama-2-style models.
    "small-llama-32k": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                            intermediate_size=2816, vocab_size=32000, max_position_embeddings=4096),
    # 131,072 positions with a real 1B model's KV per token (16 KiB in fp32: 4 layers x K and V x 8
    # heads x 64 x 4 B; Llama-3.2-1B's is 64 KiB in fp32, 32 KiB in bf16), so that memory and tier
    # figures at long context mean something; ~17M parameters, few heads (a prefill's attention
    # work grows with layers x heads x head_dim). RoPE as Llama 3.2 reaches 128K: theta 500,000 and
    # llama3 scaling by 32 of an original 4,096. Random weights like every preset: no quality at any
    # length (docs/serving.md#long-context).
    "long-llama": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                       intermediate_size=1376, vocab_size=4096, max_position_embeddings=131072,
                       rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 4096}),
}
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
TOKENIZER_CORPUS_BYTES = 4 << 20
SEED = 0


def stdlib_corpus(max_bytes: int) -> list[str]:
    """The standard library's top-level .py files in sorted order, up to max_bytes: same text everywhere."""
    texts, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(stdlib_corpus(TOKENIZER_CORPUS_BYTES), trainer=trainer)
    return tokenizer


def hf_config(name: str) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "attention_bias": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "torch_dtype": "float32",
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, **PRESETS[name],
    }


# The presets' chat template (frontend/chat_template.py renders it for /v1/chat/completions):
# one "role: content" line per message, then "assistant:" for the answer.
SIMPLE_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                        "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def write_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    tokenizer.save(str(directory / "tokenizer.json"))
    write_tokenizer_config(directory)


def write_tokenizer_config(directory: Path) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "chat_template": SIMPLE_CHAT_TEMPLATE}, indent=2) + "\n")


def random_weights(spec: ModelSpec, std: float) -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = build_model(spec, "concat", KV_DTYPES["fp32"])
    for name, p in model.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(p, std=std) if p.dim() > 1 else torch.nn.init.zeros_(p)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def materialize(name: str, root: Path) -> Path:
    """The preset's checkpoint directory under root, created once."""
    directory = Path(root) / name
    if (directory / "model.safetensors").is_file():
        write_tokenizer_config(directory)  # cheap, and a checkpoint cached by an older kvforge gets the template
        return directory
    config = hf_config(name)
    spec = ModelSpec.from_hf_config(config)
    with atomic_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(train_tokenizer(spec.vocab_size), tmp)
        save_file(random_weights(spec, config["initializer_range"]), str(tmp / "model.safetensors"))
    return directory
