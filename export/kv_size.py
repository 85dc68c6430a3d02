"""python -m export.kv_size --model PRESET_OR_DIR_OR_CONFIG_JSON --context N [--batch B] [--kv-dtype D] [--max-chunk C]

Exact KV-cache bytes per token and in total, from the model's config alone (no weights loaded).
Without --kv-dtype every dtype is listed, so the effect of quantization is one table; with
--kv-heads the same model is shown with another KV head count (GQA/MQA).
An MLA model (DeepSeek-V2/V3) is shown beside what its attention would cache without the latent:
"mha", its heads' decompressed K (qk_nope + qk_rope wide) and V (v_head_dim wide), and "gqa-N", a
GQA of the same layers and hidden size with N = --kv-heads (default 8) KV heads of v_head_dim
(DeepSeek-V3: 128, the head_dim Llama-style models of its width use).
With --max-chunk a model with sliding windows is sized as its export with that --max-chunk holds
it: each sliding layer a ring of window + max_chunk - 1 positions (kvforge.manifest.ring_tokens),
beside what caching every position would take ("full"); --kv-budget-mib adds how many sequences
of --context tokens each admits in that budget (the engine's admission arithmetic: slot_bytes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvforge.cli import fail_cleanly
from kvforge.manifest import (KV_DTYPES, MLA_KV_DTYPES, ManifestError, ModelSpec, cache_tensors,
                              check_attention_dtype, kv_bytes, kv_bytes_per_token, ring_tokens, slot_bytes)

MLA_COMPARISON_KV_HEADS = 8


def load_spec(model: str) -> ModelSpec:
    from export.presets import PRESETS, hf_config

    if model in PRESETS:
        return ModelSpec.from_hf_config(hf_config(model))
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ManifestError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json or checkpoint dir")
    try:
        return ModelSpec.from_hf_config(json.loads(config.read_text()), cache_only=True)
    except json.JSONDecodeError as e:
        raise ManifestError(f"{config} is not valid JSON: {e}") from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(spec: ModelSpec, context: int, batch: int, dtypes: list[str]) -> list[dict]:
    return [{"attention": spec.attention if spec.attention == "mla" else f"gqa-{spec.num_kv_heads}"
             if spec.num_kv_heads < spec.num_heads else "mha",
             "kv_dtype": d, "bytes_per_token": kv_bytes_per_token(spec, d),
             "total_bytes": kv_bytes(spec, d, context, batch)} for d in dtypes]


def windowed_table(spec: ModelSpec, context: int, batch: int, dtypes: list[str], max_chunk: int,
                   budget: int | None) -> list[dict]:
    """Bytes of `batch` sequences of `context` tokens with rings (windowed) and without (full), and
    how many such sequences a budget of bytes admits either way."""
    rows = []
    for d in dtypes:
        windowed = slot_bytes(cache_tensors(spec, d, context, max_chunk), context)
        full = slot_bytes(cache_tensors(spec, d, context), context)
        row = {"kv_dtype": d, "windowed_bytes": windowed * batch, "full_bytes": full * batch,
               "x_smaller": round(full / windowed, 2)}
        if budget is not None:
            row.update(windowed_sequences=budget // windowed, full_sequences=budget // full)
        rows.append(row)
    return rows


def mla_comparisons(spec: ModelSpec, kv_heads: int) -> list[tuple[str, ModelSpec]]:
    """The MLA model, its attention decompressed (every head's K and V), and a GQA of its size."""
    base = dataclasses.replace(spec, attention="mha", rope_scaling=None, rope_interleave="halves")
    # K is qk_head_dim wide and V v_head_dim: two tensors of the mean width count the same bytes
    mha = dataclasses.replace(base, num_kv_heads=spec.num_heads, head_dim=(spec.qk_head_dim + spec.v_head_dim) / 2)
    gqa = dataclasses.replace(base, num_kv_heads=kv_heads, head_dim=spec.v_head_dim)
    return [("mla", spec), ("mha", mha), (f"gqa-{kv_heads}", gqa)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.kv_size", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), help="one dtype (default: all)")
    parser.add_argument("--kv-heads", type=int, help="override the KV head count to see GQA/MQA")
    parser.add_argument("--max-chunk", type=int, help="size sliding layers as rings of window + this - 1 positions")
    parser.add_argument("--kv-budget-mib", type=int, help="with --max-chunk: sequences admitted in this KV budget")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.context <= 0 or args.batch <= 0:
        raise ManifestError("--context and --batch must be positive")
    spec = load_spec(args.model)
    if args.max_chunk is not None:
        return windowed_main(spec, args)
    if spec.attention == "mla":
        return mla_main(spec, args)
    if args.kv_heads is not None:
        if args.kv_heads <= 0 or spec.num_heads % args.kv_heads:
            raise ManifestError(f"--kv-heads must divide the {spec.num_heads} attention heads")
        spec = dataclasses.replace(spec, num_kv_heads=args.kv_heads)
    rows = table(spec, args.context, args.batch, [args.kv_dtype] if args.kv_dtype else list(KV_DTYPES))
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "context": args.context, "batch": args.batch,
                          "rows": rows}, indent=2))
        return 0
    print(f"{spec.architecture}: {spec.num_layers} layers x {spec.num_kv_heads} KV heads x head_dim "
          f"{spec.head_dim}; {args.batch} x {args.context} tokens")
    print(f"{'kv dtype':<9}{'bytes/token':>14}{'per token':>12}{'total':>14}")
    for row in rows:
        print(f"{row['kv_dtype']:<9}{row['bytes_per_token']:>14,}{human(row['bytes_per_token']):>12}"
              f"{human(row['total_bytes']):>14}")
    return 0


def windowed_main(spec: ModelSpec, args) -> int:
    if args.max_chunk <= 0:
        raise ManifestError("--max-chunk must be positive")
    if spec.sliding_window is None:
        raise ManifestError(f"--max-chunk sizes sliding layers' rings; {spec.architecture} here has no sliding window")
    budget = None if args.kv_budget_mib is None else args.kv_budget_mib << 20
    rows = windowed_table(spec, args.context, args.batch, [args.kv_dtype] if args.kv_dtype else list(KV_DTYPES),
                          args.max_chunk, budget)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "context": args.context, "batch": args.batch,
                          "max_chunk": args.max_chunk, "kv_budget_bytes": budget, "rows": rows}, indent=2))
        return 0
    print(f"{spec.architecture}: {len(spec.sliding_layers)} of {spec.num_layers} layers slide (window "
          f"{spec.sliding_window}, ring {ring_tokens(spec.sliding_window, args.max_chunk)}); {args.batch} x {args.context} tokens")
    admitted = f"{'seqs windowed':>15}{'seqs full':>11}" if budget is not None else ""
    print(f"{'kv dtype':<9}{'windowed':>14}{'full':>14}{'x smaller':>11}{admitted}")
    for row in rows:
        seqs = f"{row['windowed_sequences']:>15,}{row['full_sequences']:>11,}" if budget is not None else ""
        print(f"{row['kv_dtype']:<9}{human(row['windowed_bytes']):>14}{human(row['full_bytes']):>14}"
              f"{row['x_smaller']:>11}{seqs}")
    return 0


def mla_main(spec: ModelSpec, args) -> int:
    kv_heads = args.kv_heads or MLA_COMPARISON_KV_HEADS
    if kv_heads <= 0:
        raise ManifestError("--kv-heads must be positive")
    dtypes = [args.kv_dtype] if args.kv_dtype else list(MLA_KV_DTYPES)
    for d in dtypes:
        check_attention_dtype(spec, d)
    rows = []
    for name, s in mla_comparisons(spec, kv_heads):
        for row in table(s, args.context, args.batch, dtypes):
            rows.append({**row, "attention": name, "bytes_per_token": int(row["bytes_per_token"]),
                         "total_bytes": int(row["total_bytes"])})
    mla_bytes = {r["kv_dtype"]: r["bytes_per_token"] for r in rows if r["attention"] == "mla"}
    for row in rows:
        row["x_mla"] = round(row["bytes_per_token"] / mla_bytes[row["kv_dtype"]], 2)
    if args.json:
        print(json.dumps({"model": dataclasses.asdict(spec), "context": args.context, "batch": args.batch,
                          "rows": rows}, indent=2))
        return 0
    print(f"{spec.architecture}: MLA, {spec.num_layers} layers x latent {spec.kv_lora_rank} + rope "
          f"{spec.qk_rope_head_dim}; mha = {spec.num_heads} heads of K {spec.qk_head_dim} + V {spec.v_head_dim}; "
          f"gqa-{kv_heads} = {kv_heads} KV heads x {spec.v_head_dim}; {args.batch} x {args.context} tokens")
    print(f"{'attention':<10}{'kv dtype':<9}{'bytes/token':>14}{'per token':>12}{'total':>14}{'x mla':>8}")
    for row in rows:
        print(f"{row['attention']:<10}{row['kv_dtype']:<9}{row['bytes_per_token']:>14,}"
              f"{human(row['bytes_per_token']):>12}{human(row['total_bytes']):>14}{row['x_mla']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(fail_cleanly(main))
