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
from pathlib import Path

import numpy as np

from bench.common import Params, run_module, say

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


def percentiles(values: list[float]) -> dict:
    a = np.asarray(values) * 1e3
    return {"p50": round(float(np.percentile(a, 50)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "mean": round(float(a.mean()), 3), "samples": int(a.size)}


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
