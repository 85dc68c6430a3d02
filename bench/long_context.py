"""Long context (issue 41): peak memory per prompt length, in process, with default settings.

For each length, shortest first, one engine (built as `make build-engines` leaves it: the KV
budget sized to one full max_seq_len sequence, mapped at startup) prefills a prompt of that many
tokens of held-out standard-library text (a long document) and generates one token; the peak
RSS of the process is reset before each (/proc/self/clear_refs) and read after (VmHWM). RSS
does not depend on the machine's speed; the time to first token is printed as seen, not as a
benchmark. With --perplexity, the step model then scores the shortest prompt (log-perplexity
of its tokens: what the model makes of that document).

    python -m bench.long_context EXPORT_DIR [--tokens 4096,16384,32768] [--perplexity]
        [--attention-scores-mib M] [--out F]
    python -m bench.long_context EXPORT_DIR --tiers [--tokens 8192,32768,65536] [--out F]

prints a line per length and saves JSON (default results/long_context.json).

With --tiers, the user's table instead: per length, the time to first token cold, warm from RAM,
from disk on a restarted engine (page cache kept, then dropped when the machine allows) and from
Redis on a second engine (bench.kv_tiers.ttft_by_tier, a real loopback redis-server), as % of cold beside
the user's -91/-96/-96/-94% at 8K/32K/64K/100K; the table is printed and saved with a PNG
(default results/long_context_tiers.json, .png). Not yet a section of `make bench`: a cold 64K
prefill takes minutes here.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, say, table, write_json
from bench.prefix_cache import engine_request, mapped
from export.train import split_corpus
from kvforge.engine_config import DEFAULT_SCORES_BYTES
from kvforge.manifest import Manifest
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.scorer import Scorer

DEFAULT_TOKENS = (4096, 16384)
# The user's TTFT reductions with KV offloaded to shared storage, by context (their material).
USER_REDUCTION_PERCENT = {8192: 91, 32768: 96, 65536: 96, 100000: 94}
TIERS = {"ram": "warm from RAM", "disk_page_cache": "from disk, restarted engine (page cache kept)",
         "disk": "from disk, restarted engine (page cache dropped)", "redis": "from Redis, second engine"}


def status_bytes(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the RSS of now


def document(tokenizer, tokens: int) -> list[int]:
    """The first `tokens` tokens of the held-out standard-library files, end to end."""
    ids: list[int] = []
    for text in split_corpus()[1]:
        ids += tokenizer.encode(text)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens")


def run(engine_dir: Path, lengths: list[int], threads: int | None, perplexity: bool, scores_bytes: int) -> dict:
    began = time.perf_counter()
    with LLMEngine(engine_dir, threads=threads, attention_scores_bytes=scores_bytes) as engine:
        mapped(engine)
        limits, started = engine.limits, status_bytes("VmRSS")
        say(f"engine up: max_seq_len {limits.max_seq_len}, KV {limits.kv_bytes_per_token} B/token, budget "
            f"{limits.kv_cache_bytes >> 20} MiB (reserved {limits.kv_reserved_bytes >> 20} MiB), RSS {started >> 20} MiB")
        rows = []
        for n in lengths:
            prompt = document(engine.tokenizer, n)
            reset_peak()
            t0 = time.perf_counter()
            out, = engine.generate([prompt], SamplingParams(max_tokens=1))
            ttft = time.perf_counter() - t0
            stats = engine.stats()
            rows.append(dict(tokens=n, peak_rss_bytes=status_bytes("VmHWM"), rss_after_bytes=status_bytes("VmRSS"),
                             kv_held_bytes=stats["kv_bytes_held"], host_pool_bytes=stats["kv_host_pool_bytes"],
                             prompt_tokens=out.prompt_tokens, seconds=ttft))
            say(f"{n:>7} tokens: peak RSS {rows[-1]['peak_rss_bytes'] >> 20} MiB (host pool "
                f"{stats['kv_host_pool_bytes'] >> 20} MiB), first token after {ttft:.1f} s")
        prompt = document(engine.tokenizer, lengths[0])
    result = dict(engine_dir=str(engine_dir), max_seq_len=limits.max_seq_len,
                  kv_bytes_per_token=limits.kv_bytes_per_token, kv_cache_bytes=limits.kv_cache_bytes,
                  kv_reserved_bytes=limits.kv_reserved_bytes, attention_scores_bytes=scores_bytes,
                  rss_started_bytes=started, lengths=rows)
    if perplexity:
        logits = Scorer(engine_dir, max_rows=1, threads=threads).score([np.array(prompt, np.int64)])[0][:-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        nll = -float(log_probs[np.arange(len(prompt) - 1), prompt[1:]].mean())
        result["perplexity"] = dict(tokens=len(prompt), value=math.exp(nll))
        say(f"perplexity over the first {len(prompt)} tokens: {math.exp(nll):.1f}")
    result["wall_s"] = time.perf_counter() - began
    return result


def tier_table(engine_dir: Path, lengths: list[int], threads: int | None, scores_bytes: int) -> dict:
    from bench.kv_tiers import ttft_by_tier
    from launcher.harness import free_ports
    from launcher.redis_server import RedisServer
    from runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(engine_dir, Manifest.load(engine_dir))
    corpus = document(tokenizer, max(lengths) + 64)
    warm_up = corpus[-64:]  # after every prompt's end: shares no prefix with them

    def engine(**options) -> LLMEngine:
        e = mapped(LLMEngine(engine_dir, threads=threads, attention_scores_bytes=scores_bytes, **options))
        engine_request(e, warm_up, 2)  # allocations, and a measured prefill rate for the load deadline
        return e

    began, rows = time.perf_counter(), []
    redis_bytes = 2 * max(lengths) * Manifest.load(engine_dir).kv_bytes_per_token
    with tempfile.TemporaryDirectory(prefix="kvforge-long-context-") as disk, \
            RedisServer(free_ports(1)[0], maxmemory=f"{redis_bytes // 2**20 + 256}mb") as redis:
        for n in lengths:
            say(f"{n} tokens: cold, RAM, disk after a restart, Redis on a second engine")
            # a distinct prompt per length: the corpus shifted by one token per length, so no length hits another's blocks
            prompt = corpus[len(lengths) - 1 - lengths.index(n):][:n]
            results, bandwidth, dropped = ttft_by_tier(engine, prompt, disk, redis.url, page_cached_disk=True)
            cold = results["cold"]["ttft_s"]
            row = dict(tokens=n, cold_s=round(cold, 3), page_cache_dropped=dropped,
                       same_text=all(r["text"] == results["cold"]["text"] for r in results.values()),
                       load_gb_per_s={t: round(b / 1e9, 2) for t, b in bandwidth.items()})
            for tier in TIERS:
                row[f"{tier}_s"] = round(results[tier]["ttft_s"], 3)
                row[f"{tier}_cached_tokens"] = results[tier]["cached_tokens"]
                row[f"{tier}_reduction_percent"] = round(100 * (1 - results[tier]["ttft_s"] / cold), 1)
            rows.append(row)
            say(f"{n} tokens: cold {cold:.2f} s; " + ", ".join(
                f"{t} {row[f'{t}_s']:.3f} s ({-row[f'{t}_reduction_percent']:+.1f}%)" for t in TIERS))
    return dict(engine_dir=str(engine_dir), threads=threads, attention_scores_bytes=scores_bytes, rows=rows,
                user_reduction_percent=USER_REDUCTION_PERCENT, wall_s=round(time.perf_counter() - began, 1))


def tier_report(result: dict, out: Path) -> None:
    import matplotlib.pyplot as plt

    header = ["prompt tokens", "cold", *TIERS.values(), "user's reduction",
              "load GB/s (disk page-cached / disk / Redis)", "same text"]
    lines = []
    for r in result["rows"]:
        user = USER_REDUCTION_PERCENT.get(r["tokens"])
        lines.append([f"{r['tokens']:,}", f"{r['cold_s']:.2f} s"] +
                     [f"{r[f'{t}_s']:.3f} s ({-r[f'{t}_reduction_percent']:+.1f}%)" for t in TIERS] +
                     [f"-{user}%" if user else "-",
                      " / ".join(f"{r['load_gb_per_s'].get(t, 0):.2f}" for t in ("disk_page_cache", "disk", "redis")),
                      "yes" if r["same_text"] else "NO"])
    print("\n".join(table(header, lines)))
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [r["tokens"] for r in result["rows"]]
    for tier, label in TIERS.items():
        ax.plot(tokens, [r[f"{tier}_reduction_percent"] for r in result["rows"]], "o-", label=label)
    ax.plot(list(USER_REDUCTION_PERCENT), list(USER_REDUCTION_PERCENT.values()), "k*--", label="the user's (KV offload)")
    ax.set(xscale="log", xlabel="prompt tokens", ylabel="TTFT reduction vs cold (%)",
           title="Time to first token with cached KV, long-llama")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="prompt lengths, comma-separated (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--perplexity", action="store_true")
    parser.add_argument("--attention-scores-mib", type=int, default=DEFAULT_SCORES_BYTES >> 20,
                        help="the engine's scores budget (default %(default)s)")
    parser.add_argument("--tiers", action="store_true", help="the TTFT table by tier instead of peak RSS")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default results/long_context.json, with --tiers results/long_context_tiers.json)")
    args = parser.parse_args()
    lengths = sorted(int(t) for t in args.tokens.split(","))
    out = args.out or ROOT / "results" / ("long_context_tiers.json" if args.tiers else "long_context.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tiers:
        result = tier_table(args.engine_dir, lengths, args.threads, args.attention_scores_mib << 20)
        write_json(out, result)
        tier_report(result, out)
    else:
        write_json(out, run(args.engine_dir, lengths, args.threads, args.perplexity, args.attention_scores_mib << 20))
    say(f"saved {out}")


if __name__ == "__main__":
    main()
