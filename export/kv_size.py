"""python -m export.kv_size --model PRESET_OR_DIR_OR_CONFIG_JSON --context N [--batch B] [--kv-dtype D]

Exact KV-cache bytes per token and in total, from the model's config alone (no weights loaded).
Without --kv-dtype every dtype is listed, so the effect of quantization is one table; with
--kv-heads the same model is shown with another KV head count (GQA/MQA).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from kvforge.cli import fail_cleanly
from kvforge.manifest import KV_DTYPES, ManifestError, ModelSpec, kv_bytes, kv_bytes_per_token


def load_spec(model: str) -> ModelSpec:
    from export.presets import PRESETS, hf_config

    if model in PRESETS:
        return ModelSpec.from_hf_config(hf_config(model))
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise ManifestError(f"{model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json or checkpoint dir")
    try:
        return ModelSpec.from_hf_config(json.loads(config.read_text()))
    except json.JSONDecodeError as e:
        raise ManifestError(f"{config} is not valid JSON: {e}") from None


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.4g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(spec: ModelSpec, context: int, batch: int, dtypes: list[str]) -> list[dict]:
    return [{"kv_dtype": d, "bytes_per_token": kv_bytes_per_token(spec, d),
             "total_bytes": kv_bytes(spec, d, context, batch)} for d in dtypes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.kv_size", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--context", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), help="one dtype (default: all)")
    parser.add_argument("--kv-heads", type=int, help="override the KV head count to see GQA/MQA")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.context <= 0 or args.batch <= 0:
        raise ManifestError("--context and --batch must be positive")
    spec = load_spec(args.model)
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


if __name__ == "__main__":
    sys.exit(fail_cleanly(main))
