"""Decode at long context (issue 41, item 4): batch-1 decode tokens/s and the bytes each step
reads at 8K-128K cached tokens for fp32, int8 and int4 KV on the long-llama preset (16 KiB of
fp32 KV a token), where ONNX Runtime spends such a step (its profiler's kernel time by op), and
llama.cpp's llama-bench -d at the same depths (flash attention on, f16 and q8_0 KV) on the same
checkpoint converted to GGUF f32; and an MLA model of the same size (LONG_MLA: DeepSeek-V3's
attention at long-llama's width, its latent 9 KiB a token in fp32), fp32 and int8 latent.

    python -m bench.long_decode [--model long-llama] [--tokens 8192,32768,65536,131000]
        [--kv-dtypes fp32,int8,int4] [--mla-dtypes fp32,int8] [--peer-max-tokens 32768]
        [--no-llama-cpp] [--out F]

kvforge steps from a cache filled in place (a step's time does not depend on the values; the
pages are written first, so every step reads memory the process holds rather than the kernel's
shared zero page). llama-bench prefills its depth before it decodes, minutes at 64K on 2 cores,
so the peer runs up to --peer-max-tokens. Bytes per step: the engine's weights a step reads
(bench.roofline's count) plus the context's KV in its dtype (the manifest's bytes per token, scales
included). Writes results/long_decode.json and .png and prints the table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from bench.common import ROOT, Artifacts, decode_steps, figure, say, table, write_json
from bench.cpu_peers import PeerUnavailable, llama_bench, llama_cpp
from bench.prefill import kernel_events, profile, seconds_by_op
from bench.roofline import step_weight_bytes
from kvforge.manifest import Manifest

DEFAULT_TOKENS = (8192, 32768, 65536, 131000)
STEPS = 16  # timed decode steps per point, after one untimed
PROFILED_STEPS = 4
LLAMA_CPP_KV_TYPES = ("f16", "q8_0")
# DeepSeek-V3's attention (latent 512 + rope 64 a layer, yarn to 128K from 4,096 as V3 extends its
# context) on long-llama's 4 layers, width and 8 heads, dense MLPs: random weights, like the presets
LONG_MLA = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "num_hidden_layers": 4,
            "first_k_dense_replace": 4, "hidden_size": 512, "intermediate_size": 1376, "num_attention_heads": 8,
            "num_key_value_heads": 8, "kv_lora_rank": 512, "q_lora_rank": 256, "qk_nope_head_dim": 64,
            "qk_rope_head_dim": 64, "v_head_dim": 64, "rope_interleave": False, "vocab_size": 4096,
            "max_position_embeddings": 131072, "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
            "bos_token_id": 1, "eos_token_id": 2}


def filled(runner, step: int) -> None:
    """decode_steps' observer: before the untimed first step, write every KV page once."""
    if step == 0:
        for buffer in runner.kv_arrays.values():
            buffer.fill(1)


def kvforge_points(export_dir: Path, contexts: list[int], threads: int) -> list[dict]:
    from runtime.runners import open_runner

    manifest = Manifest.load(export_dir)
    weights = step_weight_bytes(export_dir / manifest.onnx_file, 1)["weight_bytes_per_step"]
    runner = open_runner(export_dir, threads)
    points = []
    for context in contexts:
        steps = decode_steps(runner, 1, context, STEPS, observe=filled)
        median = statistics.median(steps)
        kv = context * manifest.kv_bytes_per_token
        points.append({"context": context, "median_ms": 1e3 * median, "tokens_per_s": 1 / median,
                       "weight_bytes_per_step": weights, "kv_bytes_per_step": kv,
                       "gb_per_s": (weights + kv) / median / 1e9})
        say(f"kvforge {manifest.kv_dtype} KV at {context:,}: {1e3 * median:.1f} ms a step, "
            f"{kv / 2**20:,.0f} MiB of KV, {points[-1]['gb_per_s']:.1f} GB/s")
    return points


def kernel_split(export_dir: Path, context: int, threads: int) -> dict:
    """Kernel seconds by op over PROFILED_STEPS decode steps at `context`, as shares of their sum."""
    from runtime.runners import open_runner

    runner = open_runner(export_dir, threads)
    with tempfile.TemporaryDirectory() as tmp:
        profile(runner, export_dir, threads, Path(tmp))
        decode_steps(runner, 1, context, PROFILED_STEPS, observe=filled)
        _, nodes = kernel_events(runner, PROFILED_STEPS)
    by_op = seconds_by_op(nodes)
    total = sum(by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:6]
    return {"context": context, "kernel_ms_per_step": 1e3 * total / PROFILED_STEPS,
            "percent_by_op": {op: round(100 * s / total, 1) for op, s in top}}


def llama_cpp_points(artifacts: Artifacts, model: str, contexts: list[int], threads: int) -> dict:
    """kv type -> points from llama-bench -p 0 -n STEPS -d context -fa on; or why it could not run."""
    build = llama_cpp(build_allowed=True)
    gguf = artifacts.gguf(model, "f32", build["source"])
    points = {}
    for kv in LLAMA_CPP_KV_TYPES:
        points[kv] = []
        for context in contexts:
            say(f"llama.cpp {kv} KV at {context:,} (llama-bench prefills the depth first)")
            record = llama_bench(build["binary"], gguf, threads, "-p", "0", "-n", str(STEPS), "-d", str(context),
                                 "-fa", "on", "-ctk", kv, "-ctv", kv)
            points[kv].append({"context": context, "tokens_per_s": record["avg_ts"],
                               "median_ms": 1e3 / record["avg_ts"]})
    return {"points": points, "how": f"llama-bench -t {threads} -r 1 -p 0 -n {STEPS} -d CONTEXT -fa on -ctk KV "
                                     f"-ctv KV, GGUF f32 weights (convert_hf_to_gguf.py)"}


def run(model: str, contexts: list[int], kv_dtypes: list[str], mla_dtypes: list[str], threads: int, peer_max: int,
        peer: bool) -> dict:
    from bench.mla import random_checkpoint

    artifacts = Artifacts(ROOT / "build" / "bench")
    result = {"model": model, "threads": threads, "steps": STEPS, "kvforge": {}, "profile": {}}
    for kv_dtype in kv_dtypes:
        export_dir = artifacts.export(model, "inplace", kv_dtype)
        result["kvforge"][kv_dtype] = kvforge_points(export_dir, contexts, threads)
        if kv_dtype == "fp32":
            result["profile"] = [kernel_split(export_dir, context, threads) for context in contexts]
    if mla_dtypes:
        mla = str(random_checkpoint(artifacts.root / "checkpoints" / "long-mla", LONG_MLA))
        for kv_dtype in mla_dtypes:
            result["kvforge"][f"MLA {kv_dtype}"] = kvforge_points(artifacts.export(mla, "inplace", kv_dtype), contexts,
                                                                  threads)
    if peer:
        try:
            result["llama.cpp"] = llama_cpp_points(artifacts, model, [c for c in contexts if c <= peer_max], threads)
        except PeerUnavailable as e:
            result["llama.cpp"] = {"skipped": str(e)}
    return result


def report(result: dict, out: Path) -> None:
    kvforge, peer = result["kvforge"], result.get("llama.cpp", {}).get("points", {})
    contexts = [p["context"] for p in next(iter(kvforge.values()))]
    header = ["context", *(f"kvforge {d} KV tok/s (KV MiB a step)" for d in kvforge),
              *(f"llama.cpp {kv} KV tok/s" for kv in peer)]
    rows = []
    for i, context in enumerate(contexts):
        by_peer = {kv: {p["context"]: p for p in points} for kv, points in peer.items()}
        rows.append([f"{context:,}", *(f"{points[i]['tokens_per_s']:.1f} ({points[i]['kv_bytes_per_step'] / 2**20:,.0f})"
                                       for points in kvforge.values()),
                     *(f"{by_peer[kv][context]['tokens_per_s']:.1f}" if context in by_peer[kv] else "-" for kv in peer)])
    lines = table(header, rows)
    lines += ["", *table(["context", "kernel ms a step (fp32 KV)", "share by op"],
                         [[f"{p['context']:,}", f"{p['kernel_ms_per_step']:.1f}",
                           ", ".join(f"{op} {share}%" for op, share in p["percent_by_op"].items())]
                          for p in result["profile"]])]
    if "skipped" in result.get("llama.cpp", {}):
        lines.append(f"\nllama.cpp skipped: {result['llama.cpp']['skipped']}")
    print("\n".join(lines))
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dtype, points in kvforge.items():
        ax.plot([p["context"] for p in points], [p["tokens_per_s"] for p in points], marker="o", label=f"kvforge {dtype} KV")
    for kv, points in peer.items():
        ax.plot([p["context"] for p in points], [p["tokens_per_s"] for p in points], marker="s", linestyle="--",
                label=f"llama.cpp {kv} KV")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("cached tokens")
    ax.set_ylabel("decode tokens/s (batch 1)")
    ax.set_title(f"Decode at long context, {result['model']}, {result['threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="long-llama", help="a preset or checkpoint directory (default %(default)s)")
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="cached tokens per point, comma-separated (default %(default)s)")
    parser.add_argument("--kv-dtypes", default="fp32,int8,int4",
                        help="kvforge's KV dtypes on --model; empty: none (default %(default)s)")
    parser.add_argument("--mla-dtypes", default="fp32,int8",
                        help="the MLA model's latent dtypes; empty: no MLA model (default %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--peer-max-tokens", type=int, default=32768,
                        help="llama.cpp's deepest point: llama-bench prefills its depth first (default %(default)s)")
    parser.add_argument("--no-llama-cpp", action="store_true", help="kvforge only")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "long_decode.json")
    args = parser.parse_args()
    contexts = sorted(int(t) for t in args.tokens.split(","))
    kv_dtypes, mla_dtypes = ([d for d in dtypes.split(",") if d] for dtypes in (args.kv_dtypes, args.mla_dtypes))
    result = run(args.model, contexts, kv_dtypes, mla_dtypes, args.threads, args.peer_max_tokens, not args.no_llama_cpp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    report(result, args.out)
    say(f"saved {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
