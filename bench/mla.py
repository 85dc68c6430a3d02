"""Section mla: Multi-head Latent Attention (issue 21) - what the latent cache costs and buys.

- bytes: KV bytes per token and the sequences KVManager admits within the KV budget, read from
  the engines themselves (runner.kv_bytes_allocated, KVManager.can_admit) for a model with
  DeepSeek-V3's attention dims and for MHA / GQA Llamas of the same hidden size;
- prefill: one chunk of W tokens onto a cache holding P, absorbed vs decompressed (the two paths
  of export.model.mla.mla_attention, each exported alone) vs the shipped graph (its If picks by
  export.model.mla.decompresses at the chunk's width and key span P + W), at the widths 16..1024;
- decode: tokens/s at 512 / 2K / 4K context, both paths;
- quality: held-out perplexity and greedy agreement of the fp16 and int8 latent against fp32 on a
  small MLA model trained like the default model (export.train --architecture mla; random
  weights give flat logits).

The speed models are seeded random, one layer (what is timed is attention, and a layer's
weights): hidden 2048 instead of V3's 7168 keeps one layer at 0.4 GB; the attention's cost does
not depend on the hidden size. Time on 2 shared cores: ~14 min the first time (5 of them training
the quality model, 4 exporting), ~6 min with the artifacts cached; --quick ~2 min (quality on the
seeded model: a smoke test of the code path, not a measurement).
"""
from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from bench.common import (TRAINED_MODEL, code_digest, finish_figure, held_out_prompts, interleaved_steps, quality_cells,
                          rendered, run_module, say, section_ran, skipped, summary_ms, table, target)

PATHS = ("absorbed", "decompressed")


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_lora_rank: int
    q_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    hidden_size: int
    gqa_heads: int  # the Llamas compared: gqa_heads query heads of head_dim, as MHA and with gqa_kv_heads
    gqa_kv_heads: int
    head_dim: int
    prefill_widths: tuple[int, ...]
    prefill_pasts: tuple[int, ...]
    prefill_rounds: int
    decode_contexts: tuple[int, ...]
    decode_steps: int
    decode_rounds: int
    trained: bool  # quality on the trained MLA model; False (quick): on the seeded speed model, a smoke test
    eval_windows: int | None
    greedy_prompt_tokens: int
    greedy_tokens: int


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(heads=8, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                     hidden_size=128, gqa_heads=4, gqa_kv_heads=2, head_dim=32, prefill_widths=(16, 64),
                     prefill_pasts=(0, 64), prefill_rounds=1, decode_contexts=(64, 128), decode_steps=2,
                     decode_rounds=1, trained=False, eval_windows=2, greedy_prompt_tokens=16, greedy_tokens=8)
    # DeepSeek-V3's attention: 128 heads, latent 512 + rope 64, q LoRA 1536, nope 128, v 128
    return Shape(heads=128, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128, hidden_size=2048, gqa_heads=16, gqa_kv_heads=8, head_dim=128,
                 prefill_widths=(16, 32, 64, 128, 160, 192, 256, 512, 1024), prefill_pasts=(0, 1024),
                 prefill_rounds=3, decode_contexts=(512, 2048, 4096), decode_steps=4, decode_rounds=3,
                 trained=True, eval_windows=None, greedy_prompt_tokens=64, greedy_tokens=128)


# ---------------------------------------------------------------- the models

def mla_config(s: Shape, vocab: int) -> dict:
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 1,
            "hidden_size": s.hidden_size, "intermediate_size": 2 * s.hidden_size, "num_attention_heads": s.heads,
            "num_key_value_heads": s.heads, "kv_lora_rank": s.kv_lora_rank, "q_lora_rank": s.q_lora_rank,
            "qk_nope_head_dim": s.qk_nope_head_dim, "qk_rope_head_dim": s.qk_rope_head_dim,
            "v_head_dim": s.v_head_dim, "rope_interleave": False, "first_k_dense_replace": 1,
            "vocab_size": vocab, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}


def llama_config(s: Shape, vocab: int, kv_heads: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": s.gqa_heads * s.head_dim, "intermediate_size": 2 * s.hidden_size,
            "num_attention_heads": s.gqa_heads, "num_key_value_heads": kv_heads, "head_dim": s.head_dim,
            "vocab_size": vocab, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2}


def random_checkpoint(directory: Path, config: dict) -> Path:
    """A Hugging Face checkpoint directory with seeded random weights and the default model's tokenizer."""
    from safetensors.torch import save_file

    from export.presets import random_weights
    from kvforge.cli import atomic_directory
    from kvforge.manifest import ModelSpec

    if (directory / "config.json").is_file() and json.loads((directory / "config.json").read_text()) == config:
        return directory
    with atomic_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(random_weights(ModelSpec.from_hf_config(config), 0.02), str(tmp / "model.safetensors"))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TRAINED_MODEL / name, tmp / name)
    return directory


def path_export(artifacts, checkpoint: Path, path: str) -> Path:
    """The fp32 in-place export with its graph traced again with MLA attention always taking `path`
    (MLAAttention.path): the If's two branches, each alone."""
    from export.checkpoint import load_model
    from export.onnx_export import export_onnx
    from kvforge.manifest import Manifest

    source = artifacts.export(str(checkpoint), "inplace", "fp32")
    out = artifacts.root / "exports" / f"{checkpoint.name}-{path}"

    def make():
        say(f"mla: exporting {checkpoint.name} with every step {path}")
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(source, out, ignore=shutil.ignore_patterns("model.onnx*", artifacts.STAMP))
        manifest = Manifest.load(out)
        _, model = load_model(checkpoint, "inplace", manifest.kv)
        for layer in model.model.layers:
            layer.self_attn.path = path
        export_onnx(model, manifest, out / manifest.onnx_file)

    return artifacts._cached(out, {"export": json.loads((source / artifacts.STAMP).read_text()), "path": path}, make)


def trained_mla(artifacts) -> Path:
    """The small MLA model trained like the default one (export.train --architecture mla)."""
    out = artifacts.root / "checkpoints" / "stdlib-mla"

    def make():
        say("mla: training the small MLA model (export.train --architecture mla)")
        run_module("export.train", "--architecture", "mla", "--out", str(out))

    return artifacts._cached(out, {"code": code_digest("export")}, make)


# ---------------------------------------------------------------- measurements

def kv_accounting(runner, budget: int, tokens: int) -> dict:
    """Bytes per token of the runner's own buffers, and how many sequences of `tokens` tokens fit
    `budget` bytes: by bytes alone, and as KVManager (the engine's admission) counts them (its rows
    are a power of two at the capacity bucket)."""
    from runtime.kv.manager import KVManager
    from runtime.llm_engine import SamplingParams
    from runtime.sequence import Sequence

    capacity = runner.bucket_for(tokens)
    runner.allocate(1, capacity)
    per_token = runner.kv_bytes_allocated // capacity
    manager = KVManager(runner, slots=1 << 20, kv_cache_bytes=budget, pool=None, namespace=b"")
    running: list = []
    while True:
        seq = Sequence(len(running), [3] * (tokens - 1), SamplingParams(max_tokens=1), print, None, frozenset())
        if not manager.rows.can_admit(seq, running):
            break
        running.append(seq)
    return {"bytes_per_token": int(per_token), "manifest_bytes_per_token": runner.manifest.kv_bytes_per_token,
            "sequences_by_bytes": budget // (int(per_token) * tokens), "sequences_admitted": len(running)}


def prefill_table(runners: dict, s: Shape) -> list[dict]:
    """Seconds of one W-token step onto a cache of P tokens, the graphs taking turns each round, and
    the path the shipped graph's If takes for it."""
    from export.model import decompresses

    spec = runners["absorbed"].manifest.model
    rows = []
    for past in s.prefill_pasts:
        for width in s.prefill_widths:
            ids = np.random.default_rng(width).integers(3, 256, (1, width))
            times: dict = {p: [] for p in runners}
            for _ in range(s.prefill_rounds):
                for path, runner in runners.items():
                    capacity = runner.bucket_for(past + width)
                    runner.allocate_cached(1, past, capacity)
                    began = time.perf_counter()
                    runner.step(ids, np.array([past]), np.array([width]))
                    times[path].append(time.perf_counter() - began)
            row = {"width": width, "past": past, "capacity": capacity,
                   "if_picks": "decompressed" if decompresses(spec, width, past + width) else "absorbed",
                   **{p: summary_ms(t) for p, t in times.items()}}
            row["decompressed_speedup"] = round(row["absorbed"]["median_ms"] / row["decompressed"]["median_ms"], 3)
            say(f"mla prefill: {width} tokens onto {past}: " +
                ", ".join(f"{p} {row[p]['median_ms']:.1f} ms" for p in runners))
            rows.append(row)
    return rows


def decode_table(runners: dict, s: Shape) -> list[dict]:
    rows = []
    for context in s.decode_contexts:
        times = interleaved_steps({p: (r, None) for p, r in runners.items()}, 1, context, s.decode_steps,
                                  s.decode_rounds)
        row = {"context": context}
        for path, t in times.items():
            row[path] = {**summary_ms(t), "tokens_per_s": round(len(t) / sum(t), 2)}
        say(f"mla decode at {context}: " + ", ".join(f"{p} {row[p]['tokens_per_s']:.1f} tokens/s" for p in runners))
        rows.append(row)
    return rows


def quality(artifacts, params, s: Shape, checkpoint: Path) -> dict:
    """fp32 / fp16 / int8 latent on `checkpoint`: perplexity, greedy agreement with fp32."""
    from bench.kv_dtypes import quality as dtype_quality
    from export.train import eval_windows, held_out_tokens
    from kvforge.manifest import MLA_KV_DTYPES
    from runtime.runners import open_runner

    stream = held_out_tokens(checkpoint)
    material = {"windows": eval_windows(stream, s.eval_windows),
                "prompts": held_out_prompts(stream, 8, s.greedy_prompt_tokens)}
    rows, reference = [], None
    for dtype in MLA_KV_DTYPES:  # fp32 first: the reference
        runner = open_runner(artifacts.export(str(checkpoint), "inplace", dtype), params.threads)
        say(f"mla quality: {dtype} latent on the trained MLA model")
        q = dtype_quality(runner, reference, material, s.greedy_tokens)
        reference = reference or q
        rows.append({"kv_dtype": dtype, "bytes_per_token": runner.manifest.kv_bytes_per_token,
                     **{k: v for k, v in q.items() if k != "tokens"}})
    training = json.loads((checkpoint / "training.json").read_text()) if s.trained else {}
    return {"model": checkpoint.name, "trained": s.trained,
            "training": {k: training[k] for k in ("held_out_perplexity", "steps", "parameters", "train_seconds")
                         if k in training},
            "eval": {"windows": int(len(material["windows"])), "greedy_prompts": 8,
                     "greedy_prompt_tokens": s.greedy_prompt_tokens, "greedy_new_tokens": s.greedy_tokens},
            "dtypes": rows}


def run(params, artifacts) -> dict:
    from export.model import decompresses
    from runtime.runners import open_runner

    s = shape(params.quick)
    vocab = json.loads((TRAINED_MODEL / "config.json").read_text())["vocab_size"]
    root = artifacts.root / "checkpoints"
    mla = random_checkpoint(root / f"mla-v3-attention-{s.heads}h", mla_config(s, vocab))
    runners = {p: open_runner(path_export(artifacts, mla, p), params.threads) for p in PATHS}
    shipped = open_runner(artifacts.export(str(mla), "inplace", "fp32"), params.threads)
    spec = shipped.manifest.model

    say("mla: KV bytes and sequences in the budget, from the engines' accounting")
    budget, tokens = params.kv_budget_bytes, params.budget_sequence_tokens
    accounting = []
    for dtype in ("fp16", "int8"):
        accounting.append({"model": "mla", "kv_dtype": dtype, **kv_accounting(
            open_runner(artifacts.export(str(mla), "inplace", dtype), params.threads), budget, tokens)})
    for name, kv_heads in (("mha", s.gqa_heads), ("gqa", s.gqa_kv_heads)):
        llama = random_checkpoint(root / f"llama-{s.gqa_heads}h-{kv_heads}kv", llama_config(s, vocab, kv_heads))
        accounting.append({"model": f"{name}-{kv_heads}", "kv_dtype": "fp16", **kv_accounting(
            open_runner(artifacts.export(str(llama), "inplace", "fp16"), params.threads), budget, tokens)})
    fp16_mla = accounting[0]["bytes_per_token"]
    for row in accounting:
        row["x_mla_fp16"] = round(row["bytes_per_token"] / fp16_mla, 2)

    say(f"mla: prefill, absorbed vs decompressed ({s.prefill_rounds} rounds)")
    prefill = prefill_table({**runners, "shipped": shipped}, s)
    say(f"mla: decode ({s.decode_rounds} rounds)")
    decode = decode_table(runners, s)
    say("mla: latent KV dtypes on " + ("the trained MLA model" if s.trained else "the seeded model (quick)"))
    return {"shape": asdict(s), "model": {k: getattr(spec, k) for k in (
                "num_layers", "hidden_size", "num_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                "qk_rope_head_dim", "v_head_dim")},
            "long_context_crossover": next(w for w in range(1, 1 << 12) if decompresses(spec, w, 1 << 24)),
            "kv_budget_bytes": budget, "sequence_tokens": tokens,
            "accounting": accounting, "prefill": prefill, "decode": decode,
            "quality": quality(artifacts, params, s, trained_mla(artifacts) if s.trained else mla),
            "units": {"bytes_per_token": "bytes (runner.kv_bytes_allocated / capacity)",
                      "sequences_by_bytes": "sequences of sequence_tokens in kv_budget_bytes",
                      "sequences_admitted": "sequences of sequence_tokens KVManager admits in kv_budget_bytes",
                      "median_ms": "ms", "min_ms": "ms", "max_ms": "ms", "tokens_per_s": "tokens/s",
                      "decompressed_speedup": "absorbed time / decompressed time", "perplexity": "exp(nats/token)",
                      "perplexity_vs_fp32_percent": "%"}}


# ---------------------------------------------------------------- report

INT8_BOUND_PERCENT = 1.0  # the bound the other int8 caches meet (bench/kv_dtypes.py)


def targets(results: dict) -> list[dict]:
    section = results.get("mla")
    size_name, size_required = "MLA latent KV ~10x smaller than MHA of the same width", ">= 5x fewer bytes than MHA"
    q_name, q_required = "MLA int8 latent: perplexity within 1% of fp32", f"<= {INT8_BOUND_PERCENT:g}%"
    if not section_ran(section):
        return [skipped(size_name, size_required, "mla section did not run"),
                skipped(q_name, q_required, "mla section did not run")]
    mha, gqa = (next(r for r in section["accounting"] if r["model"].startswith(kind)) for kind in ("mha", "gqa"))
    int8 = next(r for r in section["quality"]["dtypes"] if r["kv_dtype"] == "int8")
    return [target(size_name, size_required, f"{mha['model'].upper()} {mha['x_mla_fp16']:.1f}x, "
                   f"{gqa['model'].upper()} {gqa['x_mla_fp16']:.1f}x the MLA bytes (fp16)", mha["x_mla_fp16"] >= 5,
                   f"{section['model']['num_heads']} heads, latent {section['model']['kv_lora_rank']} + "
                   f"{section['model']['qk_rope_head_dim']}; engines' own buffers"),
            skipped(q_name, q_required, "quick run: quality on seeded random weights says nothing")
            if not section["quality"]["trained"] else
            target(q_name, q_required, f"{int8['perplexity_vs_fp32_percent']:+.2f}%",
                   abs(int8["perplexity_vs_fp32_percent"]) <= INT8_BOUND_PERCENT,
                   f"{int8['bytes_per_token']} vs {section['quality']['dtypes'][0]['bytes_per_token']} bytes/token "
                   "(fp32)")]


def markdown(results: dict) -> list[str]:
    section = results.get("mla")
    if not rendered(section):
        return []
    m = section["model"]
    accounting = [[r["model"], r["kv_dtype"], f"{r['bytes_per_token']:,}", f"{r['x_mla_fp16']:.2f}x",
                   f"{r['sequences_by_bytes']:,}", f"{r['sequences_admitted']:,}"] for r in section["accounting"]]
    prefill = [[r["past"], r["width"], f"{r['absorbed']['median_ms']:.1f}", f"{r['decompressed']['median_ms']:.1f}",
                f"{r['decompressed_speedup']:.2f}x", r["if_picks"], f"{r['shipped']['median_ms']:.1f}"]
               for r in section["prefill"]]
    decode = [[r["context"], f"{r['absorbed']['tokens_per_s']:.1f}", f"{r['decompressed']['tokens_per_s']:.1f}"]
              for r in section["decode"]]
    q = section["quality"]
    return ["## MLA (DeepSeek-V2/V3 latent cache)", "",
            f"One layer with DeepSeek-V3's attention ({m['num_heads']} heads, latent {m['kv_lora_rank']} + rope "
            f"{m['qk_rope_head_dim']}, q LoRA {m['q_lora_rank']}, nope {m['qk_nope_head_dim']}, v {m['v_head_dim']}), "
            f"hidden {m['hidden_size']}, seeded random weights; Llamas of {section['shape']['gqa_heads']} heads x "
            f"{section['shape']['head_dim']} for MHA and GQA-{section['shape']['gqa_kv_heads']}. Bytes from the "
            f"runners' buffers; sequences of {section['sequence_tokens']:,} tokens in "
            f"{section['kv_budget_bytes'] / 2**30:g} GiB, by bytes and as KVManager admits them.",
            "", *table(["model", "KV dtype", "bytes/token/layer", "x MLA fp16", "sequences by bytes",
                        "sequences KVManager admits"], accounting),
            "", "Prefill: one step of W tokens onto P cached ones (ms, median), the path the export's If "
            "takes (fewer multiply-adds at the step's width and key span P + W; over a long context from "
            f"{section['long_context_crossover']} tokens) and the shipped graph's time.", "",
            *table(["P", "W", "absorbed ms", "decompressed ms", "decompressed speedup", "the If picks", "shipped ms"],
                   prefill),
            "", "Decode (batch 1, tokens/s):", "",
            *table(["context", "absorbed", "decompressed"], decode),
            "", (f"Latent KV dtypes on `{q['model']}` (trained {q['training']['steps']} steps, "
                 f"{q['training']['parameters']:,} parameters" if q["trained"] else
                 f"Latent KV dtypes on `{q['model']}` (seeded random weights, a smoke test: flat logits"
                 ) + f"; {q['eval']['windows']} held-out windows):", "",
            *table(["KV dtype", "bytes/token", "perplexity", "vs fp32", "greedy agreement (teacher-forced / free)"],
                   [[r["kv_dtype"], f"{r['bytes_per_token']:,}", *quality_cells(r)] for r in q["dtypes"]])]


def plot(plt, results: dict, out: Path) -> None:
    section = results.get("mla")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(section):
        for color, past in enumerate(section["shape"]["prefill_pasts"]):
            rows = [r for r in section["prefill"] if r["past"] == past]
            for path, style in (("absorbed", "o-"), ("decompressed", "s--"), ("shipped", "x:")):
                left.plot([r["width"] for r in rows], [r[path]["median_ms"] for r in rows], style, color=f"C{color}",
                          label=f"{path}, {past} cached")
        left.set(xscale="log", yscale="log", xlabel="prefill chunk (tokens)", ylabel="step ms (median)",
                 title="MLA prefill: absorbed vs decompressed")
        for path, style in (("absorbed", "o-"), ("decompressed", "s--")):
            right.plot([r["context"] for r in section["decode"]], [r[path]["tokens_per_s"] for r in section["decode"]],
                       style, label=path)
        right.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title="MLA decode, batch 1")
        for ax in (left, right):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, out / "mla.png", section, "mla", [left, right])
