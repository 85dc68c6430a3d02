"""Section 5, serving: the same closed-loop load through the real Triton server (gRPC streaming,
clients.api.LLMClient) and in-process (runtime.llm_engine.LLMEngine, same engine, same limits):
TTFT p50/p99, inter-token latency, aggregate tokens/s and CPU per token by process at each
concurrency level, and Triton's overhead on the server side (CPU per token, inter-token p50) with
the tokens/s it costs beside it. Beside them, aiperf measures the OpenAI-compatible
API on the same server (bench/aiperf_openai.py), comparable with other servers' figures.

Each of `c` client threads sends its requests back to back, every request the same fixed prompt
length and max_tokens (greedy); a level's tokens/s is all tokens received over its wall time.
"""
from __future__ import annotations

import multiprocessing
import os
import queue
import resource
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import describe, Params, panels, rendered, run_module, say, section_ran, skipped, table, target

# enough requests per level for a p99 without letting concurrency 64 dominate the run time
REQUESTS_PER_STREAM = 2
MIN_REQUESTS, MAX_REQUESTS = 8, 64


def prompt_texts(engine_dir: Path, tokens: int, count: int) -> list[str]:
    """`count` held-out source snippets of exactly `tokens` tokens each (re-encoding checked)."""
    from tokenizers import Tokenizer

    from export.train import split_corpus

    tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
    texts = []
    for source in split_corpus()[1]:
        ids = tokenizer.encode(source).ids
        for start in range(0, len(ids) - tokens, 997):
            text = tokenizer.decode(ids[start:start + tokens])
            if len(tokenizer.encode(text).ids) == tokens:
                texts.append(text)
                break
        if len(texts) == count:
            return texts
    raise RuntimeError(f"could not cut {count} prompts of {tokens} tokens from the held-out text")


percentiles = partial(describe, scale=1e3, digits=3, stats=("p50", "p99", "mean", "samples"))  # seconds -> ms


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


SERVER_PARTS = ("launcher", "tritonserver", "llm_model", "other_models")


def server_cpu_seconds(launcher_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the server's process tree, from /proc (Linux), by part:
    the launcher (supervisor and HTTP/OpenAI front), tritonserver, the llm model's python stub
    (the engine computes there) and the other models' stubs."""
    tick, parents, seconds, parts = os.sysconf("SC_CLK_TCK"), {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:  # exited meanwhile
            continue
        pid, fields = int(entry), stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
        parents[pid], seconds[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        parts[pid] = ("llm_model" if b"/llm/1/model.py" in command else "other_models" if b"backend_stub" in command
                      else "tritonserver" if b"bin/tritonserver" in command else "launcher")
    totals, tree = dict.fromkeys(SERVER_PARTS, 0.0), [launcher_pid] if launcher_pid in seconds else []
    while tree:
        pid = tree.pop()
        totals[parts[pid]] += seconds[pid]
        tree += [child for child, parent in parents.items() if parent == pid]
    return totals


def requests_for(concurrency: int) -> int:
    return max(MIN_REQUESTS, min(MAX_REQUESTS, REQUESTS_PER_STREAM * concurrency))


def level(concurrency: int, prompts: list[str], max_tokens: int, one_request, total: int | None = None) -> dict:
    """One closed-loop run: `concurrency` threads each send their share of `total` requests
    (default: by concurrency) back to back, cycling through prompts.
    one_request(prompt, max_tokens) -> list of (seconds since send, tokens in that delta).
    Returns the raw arrivals, errors and wall time; `summarize` turns runs into figures."""
    total = total or requests_for(concurrency)
    jobs: queue.Queue = queue.Queue()
    for i in range(total):
        jobs.put(prompts[i % len(prompts)])
    records, errors, lock = [], [], threading.Lock()
    client_threads_cpu = []

    def worker():
        started = time.thread_time()
        while True:
            try:
                prompt = jobs.get_nowait()
            except queue.Empty:
                with lock:
                    client_threads_cpu.append(time.thread_time() - started)
                return
            try:
                arrivals = one_request(prompt, max_tokens)
            except Exception as e:  # recorded: a failed request must be visible in the results
                with lock:
                    errors.append(str(e)[:200])
                continue
            with lock:
                records.append(arrivals)

    began, cpu = time.perf_counter(), own_cpu_seconds()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": total, "records": records, "errors": errors, "wall_s": time.perf_counter() - began,
            "cpu_s": {"this_process": own_cpu_seconds() - cpu, "client_threads": sum(client_threads_cpu)}}


def triton_level(server, concurrency: int, prompts: list[str], max_tokens: int, one_request) -> dict:
    """level() through Triton, with the CPU the server's processes used meanwhile; the client is
    this whole process (tritonclient's gRPC threads included)."""
    before = server_cpu_seconds(server.process.pid)
    run = level(concurrency, prompts, max_tokens, one_request)
    after = server_cpu_seconds(server.process.pid)
    run["cpu_s"] = {"client": run["cpu_s"]["this_process"], **{part: after[part] - before[part] for part in after}}
    return run


def summarize(concurrency: int, max_tokens: int, runs: list[dict]) -> dict:
    """Figures over all runs of a level: tokens/s = all tokens / all wall time."""
    records = [a for run in runs for a in run["records"]]
    ttft, gaps, tokens = [], [], 0
    for arrivals in records:
        timed = [(t, n) for t, n in arrivals if n]
        tokens += sum(n for _, n in timed)
        if timed:
            ttft.append(timed[0][0])
        for (t0, _), (t1, n) in zip(timed, timed[1:]):
            gaps += [(t1 - t0) / n] * n  # a delta carrying n tokens spreads its gap over them
    wall = sum(run["wall_s"] for run in runs)
    cpu = {part: sum(run["cpu_s"][part] for run in runs) for part in runs[0]["cpu_s"]}
    return {"concurrency": concurrency, "runs": len(runs), "requests": sum(run["requests"] for run in runs),
            "completed": len(records), "errors": [e for run in runs for e in run["errors"]][:5], "tokens": tokens,
            "full_length_requests": sum(sum(n for _, n in a) == max_tokens for a in records),
            "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "tokens_per_s_by_run": [round(sum(n for a in run["records"] for _, n in a) / run["wall_s"], 2)
                                    for run in runs],
            "ttft_ms": percentiles(ttft), "inter_token_ms": percentiles(gaps or [0.0]),
            "cpu_ms_per_token": {part: round(1e3 * s / max(tokens, 1), 3) for part, s in cpu.items()}}


def pair_overhead(triton: dict, in_process: dict) -> dict:
    """Triton's overhead in one pair of summaries, in % (see "method")."""
    server_cpu = sum(triton["cpu_ms_per_token"][part] for part in SERVER_PARTS)
    return {"server_cpu": 100 * (server_cpu / in_process["cpu_ms_per_token"]["engine"] - 1),
            "inter_token_p50": 100 * (triton["inter_token_ms"]["p50"] / in_process["inter_token_ms"]["p50"] - 1),
            "tokens_per_s": 100 * (1 - triton["tokens_per_s"] / in_process["tokens_per_s"])}


def overhead_of(concurrency: int, max_tokens: int, triton_runs: list[dict], in_process_runs: list[dict]) -> dict:
    """Each Triton run against the in-process run beside it (they take turns), then the median over
    the pairs: the machine's speed drifts by 10-20% between runs, which pooling every run would
    leave in the ratio, while the two halves of a pair run a few seconds apart."""
    pairs = [pair_overhead(summarize(concurrency, max_tokens, [t]), summarize(concurrency, max_tokens, [i]))
             for t, i in zip(triton_runs, in_process_runs)]
    return {**{key: round(float(np.median([p[key] for p in pairs])), 2) for key in pairs[0]},
            "by_pair": {key: [round(p[key], 2) for p in pairs] for key in pairs[0]}}


def triton_sender(client):
    def one_request(prompt: str, max_tokens: int):
        return [(d.time, len(d.token_ids)) for d in client.stream(prompt, max_tokens=max_tokens)]
    return one_request


def engine_sender(engine):
    from runtime.llm_engine import SamplingParams

    def one_request(prompt: str, max_tokens: int):
        outputs: queue.Queue = queue.Queue()
        began = time.perf_counter()
        engine.submit(prompt, SamplingParams(max_tokens=max_tokens),
                      lambda out: outputs.put((time.perf_counter() - began, out)))
        arrivals = []
        while True:
            t, out = outputs.get(timeout=300)
            if out.error:
                raise RuntimeError(out.error)
            arrivals.append((t, len(out.token_ids)))
            if out.finished:
                return arrivals
    return one_request


# The in-process engine lives in a child process of its own, as the Triton server's does, so
# neither shares a process (GIL, leftover sessions, torch threads) with the benchmark itself.
_ENGINE_SENDER = None


def _start_engine(engine_dir: str, slots: int, kv_cache_bytes: int, threads: int, warm_prompt: str) -> None:
    global _ENGINE_SENDER
    from runtime.llm_engine import LLMEngine

    engine = LLMEngine(engine_dir, slots=slots, kv_cache_bytes=kv_cache_bytes, threads=threads)
    _ENGINE_SENDER = engine_sender(engine)
    _ENGINE_SENDER(warm_prompt, 2)  # warm-up: first-step allocations


def _in_process_level(concurrency: int, prompts: list[str], max_tokens: int) -> dict:
    run = level(concurrency, prompts, max_tokens, _ENGINE_SENDER)
    cpu = run["cpu_s"]
    run["cpu_s"] = {"client": cpu["client_threads"], "engine": cpu["this_process"] - cpu["client_threads"]}
    return run


def run(params: Params, artifacts) -> dict:
    from clients.api import LLMClient
    from kvforge.manifest import Manifest
    from kvforge.limits import DEFAULT_KV_CACHE_BYTES, Limits
    from launcher.harness import TritonServer, free_ports

    engine_dir = artifacts.engine(artifacts.export(params.model, "inplace", "fp32"), "fp32", params.threads)
    repo = artifacts.root / "model_repository"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    limits = Limits.from_manifest(Manifest.load(engine_dir), kv_cache_bytes=DEFAULT_KV_CACHE_BYTES)
    prompts = prompt_texts(engine_dir, params.serving_prompt_tokens, 8)
    http, grpc, metrics = free_ports(3)
    triton, in_process, overhead = [], [], {}
    # Both stay up and take turns run by run, so load from elsewhere on the machine hits both
    # alike; the idle one only waits on a condition variable.
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as server, \
            multiprocessing.get_context("spawn").Pool(
                1, initializer=_start_engine,
                initargs=(str(engine_dir), limits.slots, DEFAULT_KV_CACHE_BYTES, params.threads, prompts[0])) as local:
        send_triton = triton_sender(LLMClient(server.grpc_url))
        # warm-up at the top concurrency: the first run after a start pays for allocations and the
        # kernels of new batch shapes (it ran ~15% slower than the next ones)
        say("serving: warm-up")
        level(max(params.concurrency), prompts, 8, send_triton)
        local.apply(_in_process_level, (max(params.concurrency), prompts, 8))
        for c in params.concurrency:
            runs: dict[str, list[dict]] = {"triton": [], "in-process": []}
            for _ in range(params.layout_rounds):
                say(f"serving: triton, concurrency {c}")
                runs["triton"].append(triton_level(server, c, prompts, params.serving_new_tokens, send_triton))
                say(f"serving: in-process, concurrency {c}")
                runs["in-process"].append(local.apply(_in_process_level, (c, prompts, params.serving_new_tokens)))
            triton.append(summarize(c, params.serving_new_tokens, runs["triton"]))
            in_process.append(summarize(c, params.serving_new_tokens, runs["in-process"]))
            overhead[str(c)] = overhead_of(c, params.serving_new_tokens, runs["triton"], runs["in-process"])
        from bench import aiperf_openai

        # quick mode (the test suite) checks the aiperf path at one level; the full run sweeps them all
        levels = params.concurrency[:1] if params.quick else params.concurrency
        aiperf = aiperf_openai.run(server, repo, engine_dir, levels, requests_for, params.serving_prompt_tokens,
                                   params.serving_new_tokens, artifacts.root / "aiperf", say)
    return {
        "model": params.model, "engine": str(engine_dir), "prompt_tokens": params.serving_prompt_tokens,
        "new_tokens": params.serving_new_tokens, "greedy": True, "slots": limits.slots,
        "kv_cache_bytes": DEFAULT_KV_CACHE_BYTES, "protocol": "gRPC stream_infer (decoupled llm model)",
        "triton": triton, "in_process": in_process, "overhead": overhead, "aiperf_openai": aiperf,
        "method": "closed loop: c threads each send requests back to back; tokens/s = tokens received / "
                  "wall time over the level's runs; Triton (its own server process, gRPC clients here) and "
                  "in-process (LLMEngine and its client threads in one child process) take turns run by run. "
                  "Overhead, server side, per pair of runs side by side (a Triton run and the in-process run "
                  "after it), the median over the pairs (by_pair lists each): server_cpu = the server's CPU "
                  "per token (launcher, tritonserver, every model's stub, the engine included) over the "
                  "in-process engine's, minus 1; inter_token_p50 = Triton's p50 gap between tokens over "
                  "in-process, minus 1; beside them tokens_per_s = 1 - Triton tokens/s over in-process, which "
                  "the client's CPU on the same cores also lowers. Before the levels, both run one untimed "
                  "level at the top concurrency",
        "units": {"ttft_ms": "ms", "inter_token_ms": "ms", "tokens_per_s": "tokens/s (all streams)",
                  "cpu_ms_per_token": "CPU ms (user + system) per token received, by process: triton = the "
                                      "benchmark's client process and the server's parts; in-process = the "
                                      "client threads and the rest of the one process (the engine)",
                  "overhead": "%",
                  "tokens_per_s_by_run": "tokens/s (all streams)",
                  "wall_s": "s", "kv_cache_bytes": "bytes",
                  "aiperf_openai": "ttft_ms / inter_token_ms / request_latency_ms in ms (p50, p99, avg); "
                                   "output_tokens_per_s in tokens/s (all streams)"},
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def serving_targets(serving: dict) -> list[dict]:
    names = ("Aggregate tokens/s at concurrency 16 >= 4x concurrency 1 (Triton)", "Triton overhead vs in-process")
    if not section_ran(serving):
        return [skipped(names[0], ">= 4x", "serving section did not run"),
                skipped(names[1], "<= 10%", "serving section did not run")]
    by_c = {r["concurrency"]: r for r in serving["triton"]}
    rows = []
    if 16 in by_c and 1 in by_c:
        ratio = by_c[16]["tokens_per_s"] / by_c[1]["tokens_per_s"]
        rows.append(target(names[0], ">= 4x", f"{ratio:.2f}x", ratio >= 4, f"{ratio / 4:.2f}x the target"))
    else:
        rows.append(skipped(names[0], ">= 4x", "concurrency 16 not measured in this run (quick)"))
    overhead = serving["overhead"]
    worst = max(max(o["server_cpu"], o["inter_token_p50"]) for o in overhead.values())

    def spread(o: dict, key: str) -> str:
        return f"{o[key]:+.1f}% (pairs {min(o['by_pair'][key]):+.1f}..{max(o['by_pair'][key]):+.1f})"

    rows.append(target(names[1], "server CPU per token and inter-token p50 <= +10% at every concurrency "
                                 "(median over pairs of runs side by side)",
                       "; ".join(f"c{c}: CPU {spread(o, 'server_cpu')}, inter-token {spread(o, 'inter_token_p50')}"
                                 for c, o in overhead.items()), worst <= 10,
                       "tokens/s " + ", ".join(f"c{c} {-o['tokens_per_s']:+.1f}%" for c, o in overhead.items())
                       + " vs in-process. " + cpu_note(serving["triton"])))
    return rows


def cpu_note(triton_rows: list[dict]) -> str:
    """Beside the server-side target: the client's CPU, which shares the cores with the engine."""
    return ("Client process (tritonclient gRPC) CPU per token: "
            + ", ".join(f"c{r['concurrency']} {r['cpu_ms_per_token']['client']:.2f} ms" for r in triton_rows)
            + "; tritonserver: " + ", ".join(f"{r['cpu_ms_per_token']['tritonserver']:.2f}" for r in triton_rows) + " ms")


def plot_serving(plt, serving: dict, path: Path) -> None:
    def draw(left, right):
        for color, mode in enumerate(("triton", "in_process")):
            rows = serving[mode]
            c = [r["concurrency"] for r in rows]
            kw = {"color": f"C{color}"}
            left.plot(c, [r["ttft_ms"]["p50"] for r in rows], "o-", label=f"TTFT p50 ({mode})", **kw)
            left.plot(c, [r["ttft_ms"]["p99"] for r in rows], "o:", label=f"TTFT p99 ({mode})", **kw)
            left.plot(c, [r["inter_token_ms"]["p50"] for r in rows], "s--", label=f"inter-token p50 ({mode})", **kw)
            right.plot(c, [r["tokens_per_s"] for r in rows], "o-", label=mode, **kw)
        left.set(xlabel="concurrent streams", ylabel="latency (ms)", yscale="log", title="Latency vs concurrency")
        right.set(xlabel="concurrent streams", ylabel="aggregate tokens/s", title="Throughput vs concurrency")

    panels(plt, path, serving, "serving", draw)


def section_markdown(serving: dict) -> list[str]:
    def cpu(r: dict) -> str:
        return ", ".join(f"{part} {ms:.2f}" for part, ms in r["cpu_ms_per_token"].items() if ms or part == "client")

    rows = [[mode, r["concurrency"], f"{r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p99']:.1f}",
             f"{r['inter_token_ms']['p50']:.2f} / {r['inter_token_ms']['p99']:.2f}", f"{r['tokens_per_s']:.1f}", cpu(r)]
            for mode in ("triton", "in_process") for r in serving[mode]]
    overhead = [[c, f"{o['server_cpu']:+.1f}", f"{o['inter_token_p50']:+.1f}", f"{-o['tokens_per_s']:+.1f}"]
                for c, o in serving["overhead"].items()]
    return [f"## 5. Serving ({serving['prompt_tokens']}-token prompts, {serving['new_tokens']} new tokens, "
            f"{serving['slots']} slots)", "",
            *table(["mode", "concurrency", "TTFT p50 / p99 (ms)", "inter-token p50 / p99 (ms)", "tokens/s",
                     "CPU ms per token, by process"], rows), "",
            "Triton vs in-process, %, median over pairs of runs side by side (server CPU per token and "
            "inter-token p50 are the target; tokens/s also pays for the client's CPU on the same cores):", "",
            *table(["concurrency", "server CPU per token", "inter-token p50", "tokens/s"], overhead),
            *aiperf_markdown(serving.get("aiperf_openai"))]


def aiperf_markdown(aiperf: dict | None) -> list[str]:
    if not aiperf:
        return []
    if "skipped" in aiperf:
        return ["", f"OpenAI-compatible API (aiperf): skipped, {aiperf['skipped']}."]
    rows = [[endpoint, r["concurrency"], "error: " + r["error"].strip().splitlines()[-1], "", "", ""]
            if "error" in r else
            [endpoint, r["concurrency"], f"{r['ttft_ms']['p50']:.1f} / {r['ttft_ms']['p99']:.1f}",
             f"{r['inter_token_ms']['p50']:.2f} / {r['inter_token_ms']['p99']:.2f}", f"{r['output_tokens_per_s']:.1f}",
             r["requests"]]
            for endpoint in ("chat", "completions") for r in aiperf.get(endpoint, [])]
    return ["", f"OpenAI-compatible API measured by {aiperf['tool']}:", "",
            *table(["endpoint", "concurrency", "TTFT p50 / p99 (ms)", "inter-token p50 / p99 (ms)",
                     "output tokens/s", "requests"], rows)]


def targets(results: dict) -> list[dict]:
    return serving_targets(results.get("serving"))


def markdown(results: dict) -> list[str]:
    return section_markdown(results["serving"]) if rendered(results.get("serving")) else []


def plot(plt, results: dict, out: Path) -> None:
    plot_serving(plt, results.get("serving"), out / "serving.png")
