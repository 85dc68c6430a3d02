"""Section families (issue 39): each family kvforge exports, on a seeded random checkpoint of a
small realistic shape carrying the family's config quirks (hidden 768, 4 layers, 12 heads of 64,
4 KV heads, 8,192 positions; windows, softcaps, q/k norms, fused projections, LongRoPE as the
family has them):

- export: seconds (`python -m export`, in place, fp32 KV; the manifest's export_seconds) and the
  engine's bytes with fp32, int8 and int4 weights (`python -m engines build --weights`);
- decode tokens/s at batch 1, 128 and 2,048 context, fp32 and int8 weights taking turns;
- quality: max |delta log p| of the fp32 engine's greedy tokens, int8 and int4 against fp32, each
  engine fed the fp32 tokens (runtime.greedy.followed_logprobs). Weights are drawn at 1/sqrt(fan in),
  so activations and logits keep a unit scale layer after layer (a trained model's, not the flat
  logits of a 0.02 init); random weights still say nothing of a trained model's quality;
- KV: bytes of one sequence at 8K and 32K for Gemma-3-1B-shaped and Mistral-7B-shaped configs
  (fp16), windowed (sliding layers hold a ring of window + max_chunk - 1 positions) vs caching
  every position, and the sequences a 4 GiB budget admits either way (the engine's admission
  arithmetic, kvforge.manifest.slot_bytes): arithmetic on the manifest's cache tensors, no run.

--quick: three families (a plain, a hybrid-window and a LongRoPE one) at hidden 64, 2 layers, 512
positions, contexts 32 and 128: a smoke test of the code path, not a measurement.
"""
from __future__ import annotations

import json
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.common import TRAINED_MODEL, finish_figure, interleaved_steps, rendered, say, section_ran, table

WEIGHTS = ("fp32", "int8", "int4")
TIMED_WEIGHTS = ("fp32", "int8")
KV_DTYPE, MAX_CHUNK, KV_BUDGET = "fp16", 512, 4 << 30
KV_CONTEXTS = (8192, 32768)
# Real shapes of the two windowed layouts: Gemma 3 1B (22 of 26 layers slide over 512, one KV head
# of 256) and Mistral 7B v0.1 (every layer slides over 4,096, 8 KV heads of 128).
KV_CONFIGS = {
    "gemma3-1b": {"architectures": ["Gemma3ForCausalLM"], "hidden_size": 1152, "num_hidden_layers": 26,
                  "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "intermediate_size": 6912,
                  "sliding_window": 512, "vocab_size": 262144, "max_position_embeddings": 32768},
    "mistral-7b": {"architectures": ["MistralForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                   "sliding_window": 4096, "vocab_size": 32000, "max_position_embeddings": 32768},
}


@dataclass(frozen=True)
class Shape:
    families: tuple[str, ...]
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    positions: int
    window: int  # the windowed families' sliding window (Gemma 2/3, Mistral, Qwen2, Phi-3)
    original: int  # original_max_position_embeddings of llama3 / yarn / longrope
    contexts: tuple[int, ...]
    timed_steps: int
    rounds: int
    prompt_tokens: int
    quality_tokens: int


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(families=("llama3.1", "gemma3", "phi3.5-longrope"), hidden_size=64, layers=2, heads=4,
                     kv_heads=2, head_dim=16, intermediate_size=96, positions=512, window=40, original=128,
                     contexts=(32, 128), timed_steps=2, rounds=1, prompt_tokens=16, quality_tokens=8)
    return Shape(families=tuple(FAMILIES), hidden_size=768, layers=4, heads=12, kv_heads=4, head_dim=64,
                 intermediate_size=2048, positions=8192, window=1024, original=2048, contexts=(128, 2048),
                 timed_steps=8, rounds=3, prompt_tokens=128, quality_tokens=64)


def longrope(s: Shape, rotary_dim: int) -> dict:
    """Phi-3.5-style factors over rotary_dim / 2 frequencies: short near 1, long growing to 32."""
    n = rotary_dim // 2
    return {"rope_type": "longrope", "short_factor": [1.0 + i / n for i in range(n)],
            "long_factor": [float(32 ** (i / (n - 1))) for i in range(n)]}


# family -> (transformers config class prefix, its quirks as a function of the shape)
FAMILIES = {
    "llama3.1": ("Llama", lambda s: dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                       "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": s.original})),
    "qwen2.5-yarn": ("Qwen2", lambda s: dict(rope_scaling={"rope_type": "yarn", "factor": s.positions / s.original,
                                                           "original_max_position_embeddings": s.original},
                                             tie_word_embeddings=True)),
    "qwen3": ("Qwen3", lambda s: dict(head_dim=2 * s.head_dim)),
    "smollm3": ("SmolLM3", lambda s: dict(tie_word_embeddings=False)),
    "mistral-window": ("Mistral", lambda s: dict(sliding_window=s.window)),
    "qwen2-window": ("Qwen2", lambda s: dict(sliding_window=s.window, use_sliding_window=True,
                                             max_window_layers=s.layers // 2)),
    "gemma2": ("Gemma2", lambda s: dict(head_dim=s.head_dim, query_pre_attn_scalar=s.head_dim,
                                        sliding_window=s.window)),
    "gemma3": ("Gemma3Text", lambda s: dict(head_dim=s.head_dim, query_pre_attn_scalar=s.head_dim,
                                            sliding_window=s.window // 2,
                                            layer_types=["sliding_attention"] * (s.layers - 1) + ["full_attention"])),
    "phi3": ("Phi3", lambda s: dict(sliding_window=s.window - 1)),
    "phi3.5-longrope": ("Phi3", lambda s: dict(original_max_position_embeddings=s.original,
                                               rope_scaling=longrope(s, s.head_dim))),
    "phi4-mini-longrope": ("Phi3", lambda s: dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                                                  original_max_position_embeddings=s.original,
                                                  rope_scaling=longrope(s, s.head_dim * 3 // 4))),
}


def hf_config(family: str, s: Shape):
    import transformers

    prefix, quirks = FAMILIES[family]
    vocab = json.loads((TRAINED_MODEL / "config.json").read_text())["vocab_size"]
    config = getattr(transformers, f"{prefix}Config")(
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, num_hidden_layers=s.layers,
        num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, vocab_size=vocab,
        max_position_embeddings=s.positions, bos_token_id=1, eos_token_id=2, pad_token_id=0, **quirks(s))
    config.architectures = [f"{prefix.removesuffix('Text')}ForCausalLM"]
    return config


def checkpoint(root: Path, family: str, s: Shape) -> Path:
    """The family's checkpoint saved by transformers, seeded random weights at 1/sqrt(fan in) (norm
    weights near 1), the default model's tokenizer; made again only when its config changes."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvforge.cli import atomic_directory

    config = hf_config(family, s)
    directory = root / f"{family}-{s.hidden_size}x{s.layers}"
    if (directory / "config.json").is_file() and \
            json.loads((directory / "config.json").read_text()) == json.loads(config.to_json_string()):
        return directory
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 and "norm" in name else p.normal_(0.0, p.shape[-1] ** -0.5)
    with atomic_directory(directory) as tmp:
        model.save_pretrained(tmp)
        (tmp / "config.json").write_text(config.to_json_string())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TRAINED_MODEL / name, tmp / name)
    return directory


def family_row(family: str, params, artifacts, s: Shape) -> dict:
    from kvforge.manifest import Manifest
    from runtime.greedy import followed_logprobs
    from runtime.runners import open_runner

    ckpt = checkpoint(artifacts.root / "checkpoints", family, s)
    export_dir = artifacts.export(str(ckpt), "inplace", "fp32")
    exported = Manifest.load(export_dir)
    engines = {w: artifacts.engine(export_dir, w, params.threads) for w in WEIGHTS}
    runners = {w: open_runner(d, params.threads) for w, d in engines.items()}
    say(f"families: {family} decode, {' and '.join(TIMED_WEIGHTS)} weights taking turns")
    decode = []
    for context in s.contexts:
        times = interleaved_steps({w: (runners[w], None) for w in TIMED_WEIGHTS}, 1, context, s.timed_steps, s.rounds)
        decode.append({"context": context, **{w: round(1 / statistics.median(t), 2) for w, t in times.items()}})
    prompt = np.random.default_rng(0).integers(3, exported.model.vocab_size, s.prompt_tokens).tolist()
    tokens, logprobs = followed_logprobs([runners[w] for w in WEIGHTS], prompt, s.quality_tokens)
    quality = {w: round(max(abs(a - b) for a, b in zip(lp, logprobs[0])), 4)
               for w, lp in zip(WEIGHTS[1:], logprobs[1:])}
    spec = exported.model
    return {"family": family, "architecture": spec.architecture, "parameters": parameters(ckpt),
            "sliding_layers": list(spec.sliding_layers), "sliding_window": spec.sliding_window,
            "export_s": exported.versions["export_seconds"],
            "engine_bytes": {w: Manifest.load(d).engine["size_bytes"] for w, d in engines.items()},
            "decode_tokens_per_s": decode, "max_abs_delta_logp": quality,
            "distinct_greedy_tokens": len(set(tokens))}


def parameters(directory: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), "np") as f:
            total += sum(int(np.prod(f.get_slice(key).get_shape())) for key in f.keys())
    return total


def kv_rows() -> list[dict]:
    """One sequence's KV bytes, windowed vs full, and the sequences KV_BUDGET admits, per config and context."""
    from export.kv_size import windowed_table
    from kvforge.manifest import ModelSpec

    rows = []
    for name, config in KV_CONFIGS.items():
        spec = ModelSpec.from_hf_config(config, cache_only=True)
        for context in KV_CONTEXTS:
            (row,) = windowed_table(spec, context, 1, [KV_DTYPE], MAX_CHUNK, KV_BUDGET)
            rows.append({"config": name, "context": context, "window": spec.sliding_window,
                         "sliding_layers": len(spec.sliding_layers), "layers": spec.num_layers, **row})
    return rows


def run(params, artifacts) -> dict:
    s = shape(params.quick)
    families = []
    for family in s.families:
        say(f"families: {family}")
        families.append(family_row(family, params, artifacts, s))
    return {"shape": asdict(s), "families": families, "kv": kv_rows(), "kv_dtype": KV_DTYPE, "max_chunk": MAX_CHUNK,
            "kv_budget_bytes": KV_BUDGET,
            "units": {"export_s": "s", "engine_bytes": "bytes",
                      "decode_tokens_per_s": "tokens/s (batch 1, median step)",
                      "max_abs_delta_logp": "nats (max over the fp32 greedy tokens)",
                      "windowed_bytes": "bytes (one sequence)", "full_bytes": "bytes (one sequence)",
                      "windowed_sequences": "sequences in kv_budget_bytes",
                      "full_sequences": "sequences in kv_budget_bytes"}}


# ---------------------------------------------------------------- report

def targets(results: dict) -> list[dict]:
    return []


def markdown(results: dict) -> list[str]:
    section = results.get("families")
    if not rendered(section):
        return []
    s = section["shape"]
    contexts = s["contexts"]
    rows = [[r["family"], f"{r['parameters'] / 1e6:.1f}M", f"{r['export_s']:.0f}",
             " / ".join(f"{r['engine_bytes'][w] / 2**20:.1f}" for w in WEIGHTS),
             *(" / ".join(f"{d[w]:.1f}" for w in TIMED_WEIGHTS) for d in r["decode_tokens_per_s"]),
             " / ".join(f"{r['max_abs_delta_logp'][w]:.3f}" for w in WEIGHTS[1:])] for r in section["families"]]
    kv = [[r["config"], f"{r['sliding_layers']} of {r['layers']} over {r['window']:,}", f"{r['context']:,}",
           f"{r['windowed_bytes'] / 2**20:,.0f}", f"{r['full_bytes'] / 2**20:,.0f}", f"{r['x_smaller']:.2f}x",
           f"{r['windowed_sequences']:,}", f"{r['full_sequences']:,}"] for r in section["kv"]]
    return ["## Families (issue 39)", "",
            f"Seeded random checkpoints, hidden {s['hidden_size']}, {s['layers']} layers, {s['heads']} heads of "
            f"{s['head_dim']}, {s['kv_heads']} KV heads, {s['positions']:,} positions, each family's quirks; in-place "
            f"fp32 exports (`python -m export`), ONNX Runtime engines (`python -m engines build --weights`). Decode: "
            f"batch 1, fp32 / int8 weights taking turns; quality: max |delta log p| of the fp32 engine's "
            f"{s['quality_tokens']} greedy tokens after a {s['prompt_tokens']}-token prompt, every engine fed "
            "them.", "",
            *table(["family", "parameters", "export s", "engine MiB fp32 / int8 / int4",
                    *(f"decode tokens/s at {c:,} (fp32 / int8)" for c in contexts),
                    "max abs delta log p (int8 / int4)"], rows),
            "", f"KV of one sequence ({section['kv_dtype']}, max_chunk {section['max_chunk']}): sliding layers "
            "holding a ring vs every position, and the sequences a "
            f"{section['kv_budget_bytes'] / 2**30:g} GiB budget admits (kvforge.manifest.slot_bytes).", "",
            *table(["config", "sliding layers", "context", "windowed MiB", "full MiB", "smaller",
                    "sequences windowed", "sequences full"], kv)]


def plot(plt, results: dict, out: Path) -> None:
    section = results.get("families")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if section_ran(section):
        names = [r["family"] for r in section["families"]]
        x = np.arange(len(names))
        bars = [(c, w) for c in section["shape"]["contexts"] for w in TIMED_WEIGHTS]
        width = 0.8 / len(bars)
        for i, (context, w) in enumerate(bars):
            left.bar(x + i * width, [next(d[w] for d in r["decode_tokens_per_s"] if d["context"] == context)
                                     for r in section["families"]], width, label=f"{w} at {context:,}")
        left.set_xticks(x + 0.4 - width / 2, names, rotation=45, ha="right", fontsize=7)
        left.set(ylabel="decode tokens/s (batch 1)", title="Decode per family")
        for i, config in enumerate(KV_CONFIGS):
            rows = [r for r in section["kv"] if r["config"] == config]
            for kind, style in (("windowed", "o-"), ("full", "s--")):
                right.plot([r["context"] for r in rows], [r[f"{kind}_bytes"] / 2**20 for r in rows], style,
                           color=f"C{i}", label=f"{config} {kind}")
        right.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="KV MiB per sequence",
                  title="Sliding layers: ring vs every position")
        for ax in (left, right):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, out / "families.png", section, "families", [left, right])
