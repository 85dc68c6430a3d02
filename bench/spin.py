"""Section spin (issue 23): how long ONNX Runtime's idle intra-op threads spin for their next
operator before they sleep ($KVFORGE_SPIN_US, `python -m launcher --spin-us`, `make serve SPIN_US=`).

Spinning pays where a wake-up per operator is what a step waits on, and costs where other
processes need the cores the spinning thread holds. So each policy is measured both ways: decode
steps in process (fp32 and int8 weights, batch 1, no other work), and served through the launcher
with the clients on the same cores: kvforge's gRPC client (tokens/s and inter-token p50), and,
where it is installed, aiperf through the OpenAI-compatible API, whose worker processes are the
heaviest client here. One server per policy, all up at once, and the policies take turns in every
round, so drift on a shared host hits them alike. Time budget: ~12 min full, ~1 min --quick.
"""
from __future__ import annotations

import os
import statistics
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench.common import Params, finish_figure, rendered, run_module, say, section_ran, table
from kvforge.engine_config import variable
from runtime.runners.ort import DEFAULT_SPIN_US

POLICIES_US = (0, 100, 1000)


def shape(quick: bool) -> dict:
    if quick:
        return dict(policies=(0, 100), weights=("fp32",), rounds=1, steps=8, grpc=(1,), aiperf=())
    return dict(policies=POLICIES_US, weights=("fp32", "int8"), rounds=4, steps=40, grpc=(1, 16), aiperf=(1, 4))


def with_spin(spin_us: int, make):
    """make() with $KVFORGE_SPIN_US set as a served engine's process has it (sessions read it when made)."""
    name = variable("spin_us")
    before = os.environ.get(name)
    os.environ[name] = str(spin_us)
    try:
        return make()
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def step_figures(seconds: list[float]) -> dict:
    return {"fastest_ms": round(min(seconds) * 1e3, 3), "p10_ms": round(float(np.percentile(seconds, 10)) * 1e3, 3),
            "median_ms": round(statistics.median(seconds) * 1e3, 3),
            "tokens_per_s": round(1 / statistics.median(seconds), 2), "steps": len(seconds)}


def in_process(params: Params, artifacts, s: dict) -> dict:
    from bench.common import decode_steps
    from runtime.runners import open_runner

    export = artifacts.export(params.model, "inplace", "fp32")
    engines = {w: artifacts.engine(export, w, params.threads) for w in s["weights"]}
    runners = {(w, p): with_spin(p, lambda: open_runner(engines[w], params.threads))
               for w in s["weights"] for p in s["policies"]}
    context = params.contexts[0]
    for runner in runners.values():
        decode_steps(runner, 1, context, s["steps"])  # warm-up
    times: dict = {key: [] for key in runners}
    for r in range(s["rounds"]):
        say(f"spin: in-process decode steps, round {r + 1} of {s['rounds']}")
        for key, runner in runners.items():
            times[key] += decode_steps(runner, 1, context, s["steps"])
    return {w: {str(p): step_figures(times[w, p]) for p in s["policies"]} for w in s["weights"]}


def served(params: Params, artifacts, s: dict) -> dict:
    from bench import aiperf_openai
    from bench.serving import level, prompt_texts, requests_for, summarize, triton_level, triton_sender
    from clients.api import LLMClient
    from launcher.harness import TritonServer, free_ports

    engine_dir = artifacts.engine(artifacts.export(params.model, "inplace", "fp32"), "fp32", params.threads)
    repo = artifacts.root / "spin" / "model_repository"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    prompts = prompt_texts(engine_dir, params.serving_prompt_tokens, 8)
    use_aiperf = bool(s["aiperf"]) and aiperf_openai.aiperf_command().is_file()
    runs: dict = {(p, c): [] for p in s["policies"] for c in s["grpc"]}
    aiperf: dict = {(p, c): [] for p in s["policies"] for c in (s["aiperf"] if use_aiperf else ())}
    with ExitStack() as stack:
        servers, senders = {}, {}
        for p in s["policies"]:
            http, grpc, metrics, openai = free_ports(4)
            servers[p] = stack.enter_context(TritonServer(
                repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai,
                log_dir=artifacts.root / "spin" / f"logs-{p}", extra_args=["--spin-us", str(p)]))
            senders[p] = triton_sender(LLMClient(servers[p].grpc_url))
            level(max(s["grpc"]), prompts, 8, senders[p])  # warm-up: the first run after a start is slower
        for r in range(s["rounds"]):
            for p in s["policies"]:
                for c in s["grpc"]:
                    say(f"spin: round {r + 1}, --spin-us {p}, gRPC concurrency {c}")
                    runs[p, c].append(triton_level(servers[p], c, prompts, params.serving_new_tokens, senders[p]))
                for c in (s["aiperf"] if use_aiperf else ()):
                    say(f"spin: round {r + 1}, --spin-us {p}, aiperf completions concurrency {c}")
                    base = servers[p].openai_url.removesuffix("/v1")
                    aiperf[p, c].append(aiperf_openai.one_level(
                        base, engine_dir, "completions", c, requests_for(c), params.serving_prompt_tokens,
                        params.serving_new_tokens, artifacts.root / "spin" / f"aiperf-{p}-{c}-{r}"))

    def grpc_figures(p: int, c: int) -> dict:
        summary = summarize(c, params.serving_new_tokens, runs[p, c])
        return {"tokens_per_s": summary["tokens_per_s"], "tokens_per_s_by_run": summary["tokens_per_s_by_run"],
                "inter_token_p50_ms": summary["inter_token_ms"]["p50"], "errors": summary["errors"]}

    def aiperf_figures(p: int, c: int) -> dict:
        levels = aiperf[p, c]
        failed = [lv["error"] for lv in levels if "error" in lv]
        if failed:
            return {"error": failed[0]}
        rates = [lv["output_tokens_per_s"] for lv in levels]
        return {"output_tokens_per_s": round(statistics.median(rates), 2), "output_tokens_per_s_by_run": rates,
                "inter_token_p50_ms": round(statistics.median(lv["inter_token_ms"]["p50"] for lv in levels), 3)}

    return {"grpc": {str(c): {str(p): grpc_figures(p, c) for p in s["policies"]} for c in s["grpc"]},
            "aiperf": ({str(c): {str(p): aiperf_figures(p, c) for p in s["policies"]} for c in s["aiperf"]}
                       if use_aiperf else {"skipped": "aiperf is not installed (make bench installs it)"
                                           if s["aiperf"] else "not run in --quick"})}


def run(params: Params, artifacts) -> dict:
    s = shape(params.quick)
    return {"model": params.model, "threads": params.threads, "default_spin_us": DEFAULT_SPIN_US, "shape": s,
            "context": params.contexts[0], "in_process": in_process(params, artifacts, s),
            "served": served(params, artifacts, s),
            "method": "one ONNX Runtime session per policy (session.intra_op.allow_spinning, "
                      "session.intra_op.spin_duration_us), in process: in-place decode steps at batch 1 "
                      "taking turns per round; served: one launcher per policy (--spin-us), all up at once, "
                      "taking turns per round, the clients on the same cores: kvforge's gRPC client (closed loop, "
                      "tokens/s over the rounds' wall time) and aiperf through the OpenAI API (median of rounds)",
            "units": {"fastest_ms": "ms", "p10_ms": "ms", "median_ms": "ms", "tokens_per_s": "tokens/s (all streams)",
                      "inter_token_p50_ms": "ms", "output_tokens_per_s": "tokens/s (all streams)",
                      "default_spin_us": "µs", "context": "tokens"}}


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def targets(results: dict) -> list[dict]:
    return []


def markdown(results: dict) -> list[str]:
    section = results.get("spin")
    if not rendered(section):
        return []
    policies = [str(p) for p in section["shape"]["policies"]]
    lines = ["## Idle threads: spin or sleep", "",
             f"ONNX Runtime's intra-op threads spin up to N µs for their next operator before they sleep "
             f"(`--spin-us N`; default {section['default_spin_us']}). {Path(section['model']).name}, {section['threads']} "
             f"threads; in process: decode steps at batch 1, context {section['context']}; served: one launcher "
             "per policy, the clients on the same cores.", ""]
    rows = [[f"in process, {w} weights, step fastest / p10 / median ms",
             *(f"{f['fastest_ms']:.2f} / {f['p10_ms']:.2f} / {f['median_ms']:.2f}" for f in by.values())]
            for w, by in section["in_process"].items()]
    rows += [[f"gRPC concurrency {c}, tokens/s (inter-token p50 ms)",
              *(f"{f['tokens_per_s']:.1f} ({f['inter_token_p50_ms']:.1f})" for f in by.values())]
             for c, by in section["served"]["grpc"].items()]
    aiperf = section["served"]["aiperf"]
    if "skipped" not in aiperf:
        rows += [[f"aiperf completions concurrency {c}, tokens/s (inter-token p50 ms)",
                  *(f.get("error", "")[:60] or f"{f['output_tokens_per_s']:.1f} ({f['inter_token_p50_ms']:.1f})"
                    for f in by.values())] for c, by in aiperf.items()]
    lines += table(["", *(f"--spin-us {p}" for p in policies)], rows)
    if "skipped" in aiperf:
        lines += ["", f"aiperf: {aiperf['skipped']}."]
    return lines


def plot(plt, results: dict, out) -> None:
    section = results.get("spin")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if section_ran(section):
        policies = [str(p) for p in section["shape"]["policies"]]
        for w, by in section["in_process"].items():
            axes[0].plot(policies, [by[p]["median_ms"] for p in policies], marker="o", label=f"{w} median")
            axes[0].plot(policies, [by[p]["fastest_ms"] for p in policies], marker="x", ls="--", label=f"{w} fastest")
        axes[0].set(xlabel="--spin-us", ylabel="decode step ms (batch 1)", title="in process")
        axes[0].legend(fontsize=8)
        base = {c: by[policies[0]]["tokens_per_s"] for c, by in section["served"]["grpc"].items()}
        for c, by in section["served"]["grpc"].items():
            axes[1].plot(policies, [by[p]["tokens_per_s"] / base[c] for p in policies], marker="o",
                         label=f"gRPC concurrency {c}")
        aiperf = section["served"]["aiperf"]
        for c, by in ({} if "skipped" in aiperf else aiperf).items():
            if all("error" not in by[p] for p in policies):
                axes[1].plot(policies, [by[p]["output_tokens_per_s"] / by[policies[0]]["output_tokens_per_s"]
                                        for p in policies], marker="s", label=f"aiperf concurrency {c}")
        axes[1].axhline(1.0, color="grey", lw=0.8)
        axes[1].set(xlabel="--spin-us", ylabel="tokens/s vs --spin-us 0", title="served, clients on the same cores")
        axes[1].legend(fontsize=8)
    finish_figure(plt, fig, out / "spin.png", section, "spin", list(axes))
