"""Section stream_gaps (issue 37): does a stream keep its pace while long prompts arrive, and where
does a gap go when it does not? Through the real server and the OpenAI API, as a user meets it.

One stream decodes (OpenAI completions, streamed, greedy, min_tokens so it never stops early);
after its `warm_tokens`-th token, `long_count` fresh `long_tokens`-token prompts arrive one after
the other (`arrival_gap_s` apart); the client closes the stream `TAIL_EVENTS` events after the
last prompt's first token, or it ends at `stream_tokens` (so however slowly the client's threads
run, the stream is still decoding when the prompts arrive). Per round: the stream's inter-token
latency alone (before the first prompt was sent: p50), while the prompts prefill (p50, p99), the largest gap
of the whole stream, and the prompts' TTFT over their TTFT alone (the same prompts' shape without
the stream, measured first on the same server). Every configuration runs on a fresh server with
$KVFORGE_TOKEN_TRACE=1: each response's engine and send times (triton_models/llm_stream.py) join
the client's arrival times, so the largest gap of each round is split into the engine's step gap,
the sender's delay and the relay's (Triton, the front, the socket). The configurations: the
budget from the ITL target at several targets (the trade-off curve), the fixed budget the target
replaced, and disaggregated serving (1 + 1 threads).
Time budget: ~12 min full (small-llama, 4K context, 10 rounds per configuration), ~2 min --quick.
"""
from __future__ import annotations

import json
import random
import threading
import time

import numpy as np

from bench.common import Params, describe, finish_figure, rendered, run_module, say, section_ran, skipped, \
    table, target
from runtime.scheduler import ITL_TARGET_DECODE_STEPS, PREFILL_BUDGET

# the targets, as multiples of the stream's ITL p50 alone
AGGREGATED = {"p99": 3.0, "max_gap": 5.0, "ttft": 1.6}
DISAGGREGATED = {"p99": 2.0, "max_gap": 3.0}
TAIL_EVENTS = 4  # the stream's events after the prefill: the gap that straddles its end is measured


def shape(quick: bool) -> dict:
    if quick:
        return dict(model=None, rounds=2, stream_tokens=1000, warm_tokens=12, long_tokens=96, long_count=2,
                    arrival_gap_s=0.05, configurations=configurations((ITL_TARGET_DECODE_STEPS,), disaggregated=False))
    return dict(model="small-llama", rounds=10, stream_tokens=160, warm_tokens=16, long_tokens=2000, long_count=2,
                arrival_gap_s=0.05, configurations=configurations((1.15, 1.3, 1.5, 2.0, 3.0), disaggregated=True))


def label(steps: float) -> str:
    return f"target {steps:g} steps" + (" (default)" if steps == ITL_TARGET_DECODE_STEPS else "")


DEFAULT = label(ITL_TARGET_DECODE_STEPS)


def configurations(steps: tuple[float, ...], disaggregated: bool) -> dict[str, list[str]]:
    named = {label(n): ["--itl-target-steps", str(n)] for n in steps}
    named[f"fixed {PREFILL_BUDGET} tokens (before)"] = ["--prefill-budget", str(PREFILL_BUDGET)]
    if disaggregated:
        named["disaggregated"] = ["--disaggregate", "--pd-threshold", "0"]
    return named


class Completion(threading.Thread):
    """One streamed /v1/completions request: the client's arrival time of each event."""

    def __init__(self, url: str, prompt: str, tokens: int, started: threading.Event | None = None, at: int = 0):
        super().__init__(daemon=True)
        self.url, self.prompt, self.tokens, self.started, self.at = url, prompt, tokens, started, at
        self.sent, self.arrivals, self.id, self.error = 0.0, [], None, None
        self.stop_at: int | None = None  # the client closes the stream at this many events (the server cancels it)

    def run(self) -> None:
        import httpx

        body = {"model": "llm", "prompt": self.prompt, "max_tokens": self.tokens, "min_tokens": self.tokens,
                "temperature": 0, "stream": True}
        self.sent = time.perf_counter()
        try:
            with httpx.Client(timeout=600) as client, client.stream("POST", f"{self.url}/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(event["error"].get("message", event))
                    self.arrivals.append(time.perf_counter())
                    self.id = event["id"]
                    if self.started is not None and len(self.arrivals) == self.at:
                        self.started.set()
                    if self.stop_at is not None and len(self.arrivals) >= self.stop_at:
                        break
        except Exception as e:  # noqa: BLE001 - reported with the results, never hidden
            self.error = f"{type(e).__name__}: {e}"
        finally:
            if self.started is not None:
                self.started.set()

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent


def arrive(url: str, prompts: list[str], gap: float) -> list[Completion]:
    longs = []
    for prompt in prompts:
        longs.append(Completion(url, prompt, 1))
        longs[-1].start()
        time.sleep(gap)
    for c in longs:
        c.join()
    return longs


def traces(access_log, ids: list[str], timeout: float = 60.0) -> dict[str, list]:
    """Triton request id -> [engine time, send time, tokens] per response, from the access log,
    once the log holds every id (a closed stream's line is written when the engine has stopped it)."""
    deadline = time.monotonic() + timeout
    while True:
        out = {}
        for line in access_log.read_text().splitlines() if access_log.is_file() else []:
            record = json.loads(line)
            if "trace" in record:
                out[record["request_id"]] = record["trace"]
        if all(i in out for i in ids) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


PARTS = ("engine_ms", "queued_ms", "delivery_ms")


def where(stream: Completion, trace: list | None, gap_index: int) -> dict:
    """The largest gap's parts: the engine's gap between the two outputs, then for the second how
    long it waited in the sender's queue and how much later the client had it from the start of
    its send (the send's round trip to the Triton server, Triton's gRPC, the front, the socket;
    a client may see a response before the send returns, so the send's own end is no boundary)."""
    if trace is None or len(trace) < len(stream.arrivals):  # a closed stream's trace goes on past the client's
        return dict.fromkeys(PARTS)
    engine0, engine1, sending = trace[gap_index - 1][0], *trace[gap_index][:2]
    return dict(zip(PARTS, (round(1e3 * x, 2) for x in (engine1 - engine0, sending - engine1,
                                                         stream.arrivals[gap_index] - sending))))


def one_round(url: str, stream_prompt: str, long_prompts: list[str], s: dict) -> Completion:
    warm = threading.Event()
    stream = Completion(url, stream_prompt, s["stream_tokens"], warm, s["warm_tokens"])
    stream.start()
    warm.wait()
    longs = arrive(url, long_prompts, s["arrival_gap_s"])
    stream.stop_at = len(stream.arrivals) + TAIL_EVENTS
    stream.join()
    errors = [c.error for c in [stream, *longs] if c.error]
    if errors:
        raise RuntimeError(f"stream_gaps: a request failed: {errors[0]}")
    stream.arrived, stream.longs = min(c.sent for c in longs), longs
    return stream


def measure(stream: Completion, alone_ttft: list[float], trace: list | None) -> dict:
    times = np.array(stream.arrivals)
    gaps = np.diff(times)
    before = gaps[times[1:] <= stream.arrived]
    prefilled = max(c.sent + c.ttft for c in stream.longs)
    # up to the stream's first token after the last prompt's first: the gap straddling the end counts too
    released = times[np.searchsorted(times, prefilled)] if prefilled < times[-1] else times[-1]
    during = gaps[(times[1:] > stream.arrived) & (times[1:] <= released)]
    if not len(during):  # a tiny model can prefill both prompts between two of the stream's events
        during = gaps[times[1:] > stream.arrived][:1]
    if not len(before) or not len(during):
        raise RuntimeError(f"stream_gaps: the stream ({len(times)} events) did not decode before and while "
                           "the long prompts prefilled")
    largest = int(np.argmax(gaps)) + 1
    alone = float(np.median(before))
    return {"itl_alone_p50_ms": round(1e3 * alone, 2), "itl_during_p50_ms": round(1e3 * float(np.median(during)), 2),
            "itl_during_p99_ms": round(1e3 * float(np.percentile(during, 99)), 2),
            "max_gap_ms": round(1e3 * float(gaps.max()), 2), "events": len(times),
            "p99_x": round(float(np.percentile(during, 99)) / alone, 2), "max_gap_x": round(float(gaps.max()) / alone, 2),
            "ttft_s": [round(c.ttft, 3) for c in stream.longs],
            "ttft_x": round(float(np.mean([c.ttft / a for c, a in zip(stream.longs, alone_ttft)])), 3),
            "max_gap_parts": where(stream, trace, largest)}


def measured_configuration(repo, name: str, args: list[str], prompts: dict, s: dict) -> dict:
    from launcher.harness import TritonServer, free_ports

    http, grpc, metrics, openai = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai,
                      extra_args=args, environment={"KVFORGE_TOKEN_TRACE": "1"}) as server:
        url = server.openai_url
        warm = Completion(url, prompts["streams"][0], 4)
        warm.run()
        try:
            say(f"stream_gaps: {name}, the long prompts alone")
            alone = [c.ttft for c in arrive(url, prompts["alone"], s["arrival_gap_s"])]
            streams = []
            for r in range(s["rounds"]):
                say(f"stream_gaps: {name}, round {r + 1}/{s['rounds']}")
                streams.append(one_round(url, prompts["streams"][r], prompts["longs"][r], s))
            logged = traces(server.log_dir / "kvforge.jsonl", [f"{stream.id}-0" for stream in streams])
            rounds = [measure(stream, alone, logged.get(f"{stream.id}-0")) for stream in streams]
        except RuntimeError as e:
            raise RuntimeError(f"{e} ({name}); the server's log tail:\n{server.log_tail(40)}") from None
    summary = {key: describe([x[key] for x in rounds], digits=2, stats=("median", "max"))
               for key in ("itl_alone_p50_ms", "itl_during_p50_ms", "itl_during_p99_ms", "max_gap_ms", "p99_x",
                           "max_gap_x", "ttft_x")}
    return {"args": args, "alone_ttft_s": [round(t, 3) for t in alone], "summary": summary, "rounds": rounds}


def run(params: Params, artifacts) -> dict:
    from bench.serving import prompt_texts

    s = shape(params.quick)
    model = s["model"] or params.model
    engine_dir = artifacts.engine(artifacts.export(model, "inplace", "fp32"), "fp32", params.threads)
    repo = artifacts.root / "model_repository_stream_gaps"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    rounds, count = s["rounds"], s["long_count"]
    streams = prompt_texts(engine_dir, 20, rounds + 1)
    texts = prompt_texts(engine_dir, s["long_tokens"], count)
    results = {}
    for name, args in s["configurations"].items():
        # a header of its own keeps every prompt fresh: no prefix hit from another round or configuration
        fresh = [[f"# {name}, round {r}, prompt {i}\n{texts[i]}" for i in range(count)] for r in range(rounds + 1)]
        prompts = {"streams": streams, "alone": fresh[-1], "longs": fresh}
        results[name] = measured_configuration(repo, name, args, prompts, s)
    return {"model": model, "shape": {k: v for k, v in s.items() if k != "configurations"},
            "configurations": results, "targets": {"aggregated": AGGREGATED, "disaggregated": DISAGGREGATED},
            "units": {"*_x": "over the stream's ITL p50 alone (ttft_x: over the prompts' TTFT alone)",
                      "max_gap_parts": "the round's largest gap: the engine's step gap, then of the second response "
                                       "its wait in the sender's queue and its delivery from the send's start"},
            "method": "fresh server per configuration with KVFORGE_TOKEN_TRACE=1; OpenAI completions streamed "
                      "with httpx, one client timestamp per event; fresh prompts per round (no prefix hits)"}


def targets(results: dict) -> list[dict]:
    section = results.get("stream_gaps")
    name = "stream_gaps: the default server keeps a stream's pace"
    required = (f"stream ITL p99 <= {AGGREGATED['p99']:g}x alone p50, long prompts' TTFT <= {AGGREGATED['ttft']:g}x "
                f"alone, max gap <= {AGGREGATED['max_gap']:g}x in every round")
    if not section_ran(section) or DEFAULT not in section["configurations"]:
        return [skipped(name, required, "the section or its default configuration did not run")]
    c = section["configurations"][DEFAULT]["summary"]
    rows = [target("stream_gaps: ITL p99 / alone p50 (default)", f"<= {AGGREGATED['p99']:g}x",
                   f"median {c['p99_x']['median']}x, worst {c['p99_x']['max']}x", c["p99_x"]["max"] <= AGGREGATED["p99"],
                   f"p99 median {c['itl_during_p99_ms']['median']} ms vs alone {c['itl_alone_p50_ms']['median']} ms"),
            target("stream_gaps: long prompts' TTFT / alone (default)", f"<= {AGGREGATED['ttft']:g}x",
                   f"median {c['ttft_x']['median']}x, worst {c['ttft_x']['max']}x",
                   c["ttft_x"]["max"] <= AGGREGATED["ttft"], "two prompts one after the other, as alone"),
            target("stream_gaps: max gap / alone p50 in every round (default)", f"<= {AGGREGATED['max_gap']:g}x",
                   f"worst {c['max_gap_x']['max']}x ({c['max_gap_ms']['max']} ms)",
                   c["max_gap_x"]["max"] <= AGGREGATED["max_gap"], f"median {c['max_gap_x']['median']}x")]
    if "disaggregated" in section["configurations"]:
        d = section["configurations"]["disaggregated"]["summary"]
        rows.append(target("stream_gaps: ITL p99 and max gap / alone p50 (disaggregated)",
                           f"<= {DISAGGREGATED['p99']:g}x and <= {DISAGGREGATED['max_gap']:g}x",
                           f"{d['p99_x']['max']}x and {d['max_gap_x']['max']}x (worst rounds)",
                           d["p99_x"]["max"] <= DISAGGREGATED["p99"] and d["max_gap_x"]["max"] <= DISAGGREGATED["max_gap"],
                           f"medians {d['p99_x']['median']}x, {d['max_gap_x']['median']}x"))
    return rows


def markdown(results: dict) -> list[str]:
    section = results.get("stream_gaps")
    if not rendered(section):
        return []
    s = section["shape"]
    configs = section["configurations"]
    return ["## Stream gaps while long prompts arrive (issue 37)", "",
            f"`{section['model']}`, OpenAI completions streamed through the front; one stream of up to {s['stream_tokens']} "
            f"tokens (closed {TAIL_EVENTS} events after the prompts' first tokens), {s['long_count']} fresh {s['long_tokens']}-token prompts arriving one after the other after its "
            f"{s['warm_tokens']}th token; {s['rounds']} rounds per configuration, median / worst round.", "",
            *table(["configuration", "ITL p50 alone ms", "p50 during ms", "p99 during ms", "p99 / alone",
                    "max gap ms", "max gap / alone", "TTFT / alone"],
                   [[n, c["summary"]["itl_alone_p50_ms"]["median"],
                     c["summary"]["itl_during_p50_ms"]["median"],
                     f"{c['summary']['itl_during_p99_ms']['median']} / {c['summary']['itl_during_p99_ms']['max']}",
                     f"{c['summary']['p99_x']['median']}x / {c['summary']['p99_x']['max']}x",
                     f"{c['summary']['max_gap_ms']['median']} / {c['summary']['max_gap_ms']['max']}",
                     f"{c['summary']['max_gap_x']['median']}x / {c['summary']['max_gap_x']['max']}x",
                     f"{c['summary']['ttft_x']['median']}x / {c['summary']['ttft_x']['max']}x"]
                    for n, c in configs.items()]), "",
            "Where each configuration's largest gaps went (the three worst rounds: engine step gap + sender queue + "
            "delivery of the second response, ms; the first response's own delays make up the rest):", "",
            *table(["configuration", "worst rounds' largest gap: engine + queued + delivery ms"],
                   [[n, "; ".join(f"{x['max_gap_ms']} = " + " + ".join(str(x['max_gap_parts'][k]) for k in PARTS)
                                  for x in sorted(c["rounds"], key=lambda x: -x["max_gap_ms"])[:3])]
                    for n, c in configs.items()])]


def plot(plt, results: dict, out) -> None:
    section = results.get("stream_gaps")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(section):
        left, right = axes
        for n, c in section["configurations"].items():
            x, y = c["summary"]["ttft_x"]["median"], c["summary"]["p99_x"]["median"]
            left.scatter([x], [y], label=n)
            right.plot(range(1, len(c["rounds"]) + 1), [r["max_gap_x"] for r in c["rounds"]], marker="o", label=n)
        left.axhline(AGGREGATED["p99"], color="grey", linestyle=":")
        left.axvline(AGGREGATED["ttft"], color="grey", linestyle=":")
        left.set(xlabel="long prompts' TTFT / alone (median)", ylabel="stream ITL p99 / alone p50 (median)",
                 title="The budget's trade-off per ITL target")
        right.axhline(AGGREGATED["max_gap"], color="grey", linestyle=":")
        right.set(xlabel="round", ylabel="largest gap / alone p50", title="The largest gap of each round")
        for ax in axes:
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, out / "stream_gaps.png", section, "stream_gaps", list(axes))
