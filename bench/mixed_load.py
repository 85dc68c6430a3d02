"""Section mixed_load (issue 20): streams decoding while long fresh prompts prefill, through the
real server (`python -m launcher`, gRPC streams, per-token client timestamps), per scheduler.

Configurations: `alternate` (the scheduler before issue 20: prompt-chunk steps take turns with
decode steps, chunks of 256: `--scheduler alternate --prefill-budget 256`), `stall-free default`
(every step runs every decoding row plus the prompt tokens that keep it within the ITL target:
issue 37) and `stall-free` at fixed budgets, each on a fresh server with the same engine.

- arrivals (the issue's target): one stream (a ~100-token prompt, ignore_eos) decodes; after
  `warm_tokens` of its tokens, `long_count` fresh `long_tokens`-token prompts arrive at once
  (8 answer tokens each). The stream's inter-token latency (ITL) alone (before the arrivals) and
  while they prefill (from their arrival to the last one's first token); their TTFT. Medians over
  `rounds` rounds.
- load: `background` streams decode throughout while fresh prompts of 1K/2K/3K tokens arrive as
  a Poisson process at each rate for `load_seconds`; a long prompt meets the SLO when its TTFT
  <= TTFT_SLO, the background streams when their ITL p99 over the run <= ITL_SLO. A run attains the SLO when
  the streams met theirs and >= ATTAINMENT of the long prompts met theirs; goodput (DistServe) =
  the highest rate measured whose run attained it (0: none did).
A configuration whose run fails (a request error, a lost connection) is measured once more on a
fresh server; the failure and the server's log tail stay in its results (`retried_after`).
Time budget: ~15 min full (small-llama, 4K context), ~1.5 min --quick (tiny sizes).
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np

from bench.common import Params, describe, panels, rendered, run_module, say, section_ran, skipped, table, target

DEFAULT = "stall-free default"  # the budget from the ITL target (runtime/scheduler.py)
TTFT_SLO, ITL_SLO = 10.0, 0.150  # seconds: the SLO this machine is judged at (2 cores)
ATTAINMENT = 0.9
# 3 digits: a quick run's coalesced tiny-model stream has gaps of ~0.05 ms, which 1 digit made 0
ms = dict(scale=1e3, digits=3)


def shape(quick: bool) -> dict:
    from runtime.scheduler import PREFILL_BUDGET

    if quick:
        return dict(model=None, budgets=(), rounds=1, stream_prompt=16, warm_tokens=4, long_tokens=96,
                    long_count=2, background=2, load_lengths=(64, 96), rates=(0.5,), load_seconds=6.0)
    return dict(model="small-llama", budgets=(PREFILL_BUDGET, 24, 256), rounds=3, stream_prompt=100, warm_tokens=20,
                long_tokens=2000, long_count=2, background=4, load_lengths=(1000, 2000, 3000), rates=(0.05, 0.1, 0.15),
                load_seconds=40.0)


def configurations(s: dict) -> list[tuple[str, list[str]]]:
    """(name, launcher flags); the disaggregated ones run 1 + 1 threads on this machine's 2 cores."""
    return [("alternate", ["--scheduler", "alternate", "--prefill-budget", "256"]), (DEFAULT, [])] + [
        (f"stall-free {b}", ["--scheduler", "stall-free", "--prefill-budget", str(b)]) for b in s["budgets"]] + [
        ("disaggregated", ["--disaggregate", "--pd-threshold", "0"]),
        ("conditional", ["--disaggregate"])]


def handoff_metrics(metrics_url: str) -> dict:
    """What the server says its hand-offs cost: write (prefill worker) and read (decode side)."""
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()

    def value(name: str, label: str = "") -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") and label in line)

    count = value("kvforge_pd_handoff_seconds_count")
    return {"handoffs": int(value("kvforge_pd_handoffs_total")), "failures": int(value("kvforge_pd_handoff_failures_total")),
            "remote": int(value("kvforge_pd_remote_prefills_total")), "local": int(value("kvforge_pd_local_prefills_total")),
            "bytes": int(value("kvforge_pd_handoff_bytes_total")),
            "write_mean_s": value("kvforge_pd_handoff_seconds_sum") / count if count else None,
            "read_p50_s": value("kvforge_kv_tier_load_seconds_p50", 'tier="handoff"')}


class Stream(threading.Thread):
    """One gRPC stream; `arrivals` holds (client time, tokens) per response, until `stop` is set
    (leaving the stream cancels the request on the server)."""

    def __init__(self, client, prompt: str, max_tokens: int, stop: threading.Event | None = None):
        super().__init__(daemon=True)
        self.client, self.prompt, self.max_tokens, self.stop = client, prompt, max_tokens, stop
        self.sent, self.arrivals, self.error = 0.0, [], None

    def run(self):
        self.sent = time.perf_counter()
        try:
            for delta in self.client.stream(self.prompt, max_tokens=self.max_tokens, ignore_eos=True):
                self.arrivals.append((time.perf_counter(), len(delta.token_ids)))
                if self.stop is not None and self.stop.is_set():
                    return
        except Exception as e:  # noqa: BLE001 - reported with the results, never hidden
            self.error = str(e)

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft(self) -> float:
        return next(t for t, n in self.arrivals if n) - self.sent

    def gaps(self, start: float = 0.0, end: float = float("inf")) -> list[float]:
        """Per-token gaps of the tokens arriving in [start, end]: a response carrying k tokens
        (the server's sender coalesced them) spreads its gap over the k."""
        out = []
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            if start <= t1 <= end and n:
                out += [(t1 - t0) / n] * n
        return out


def fresh_prompts(engine_dir, tokens: int, count: int) -> list[str]:
    from bench.serving import prompt_texts

    return prompt_texts(engine_dir, tokens, count)


def arrivals_round(client, stream_prompt: str, long_prompts: list[str], s: dict) -> dict:
    stop = threading.Event()
    stream = Stream(client, stream_prompt, s["context"] - s["stream_prompt"] - 1, stop)
    stream.start()
    while stream.tokens < s["warm_tokens"] and stream.is_alive():
        time.sleep(0.005)
    arrived = time.perf_counter()
    longs = [Stream(client, p, 8) for p in long_prompts]
    for t in longs:
        t.start()
    for t in longs:
        t.join()
    prefilled = max(t.sent + t.ttft for t in longs)
    stop.set()
    stream.join()
    errors = [t.error for t in [stream, *longs] if t.error]
    if errors:
        raise RuntimeError(f"mixed_load: a request failed: {errors[0]}")
    # up to the stream's first token after the last prompt's: the gap that straddles the end of
    # the prefill counts too (a tiny model can prefill both prompts between two stream tokens)
    released = next((t for t, n in stream.arrivals if t >= prefilled and n), prefilled)
    alone, during = stream.gaps(end=arrived), stream.gaps(arrived, released)
    if not alone or not during:
        raise RuntimeError(f"mixed_load: the stream ({stream.tokens} tokens) did not decode before and "
                           f"while the long prompts prefilled")
    return {"itl_alone_p50_s": float(np.median(alone)), "itl_during_p99_s": float(np.percentile(during, 99)),
            "itl_during_max_s": float(max(during)), "long_ttft_s": [t.ttft for t in longs]}


def load_run(client, background_prompts: list[str], long_prompts: list[str], rate: float, s: dict) -> dict:
    draw = random.Random(int(rate * 1000))
    stop = threading.Event()
    streams = [Stream(client, p, s["context"] - s["stream_prompt"] - 1, stop) for p in background_prompts]
    for t in streams:
        t.start()
    while any(t.tokens < 2 for t in streams):
        time.sleep(0.01)
    started, longs, at = time.perf_counter(), [], draw.expovariate(rate)
    while at < s["load_seconds"]:
        time.sleep(max(0.0, started + at - time.perf_counter()))
        # a header of its own keeps every arrival fresh: no prefix hit from an earlier one
        text = f"# arrival {len(longs)} at rate {rate}\n" + long_prompts[len(longs) % len(long_prompts)]
        longs.append(Stream(client, text, 8))
        longs[-1].start()
        at += draw.expovariate(rate)
    for t in longs:
        t.join()
    ended = time.perf_counter()
    stop.set()
    for t in streams:
        t.join()
    errors = [t.error for t in [*streams, *longs] if t.error]
    if errors:
        raise RuntimeError(f"mixed_load: a request failed: {errors[0]}")
    itl_p99 = float(np.percentile([g for t in streams for g in t.gaps(started, ended)], 99))
    ttfts = [t.ttft for t in longs]
    met = sum(t <= TTFT_SLO for t in ttfts) if itl_p99 <= ITL_SLO else 0
    return {"rate": rate, "long_prompts": len(longs), "background_itl_p99_s": itl_p99, "long_ttft_s": ttfts,
            "slo_met": met, "attained": itl_p99 <= ITL_SLO and met >= ATTAINMENT * len(longs)}


def goodput(load: list[dict]) -> float:
    return max((x["rate"] for x in load if x["attained"]), default=0.0)


def measured_configuration(repo, name: str, args: list[str], prompts: tuple, s: dict) -> tuple:
    """(arrival rounds, load runs, hand-off metrics) of one configuration on a fresh server."""
    from clients.api import LLMClient
    from launcher.harness import TritonServer, free_ports

    stream_prompts, longs, load_prompts = prompts
    rounds = s["rounds"]
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, extra_args=args) as server:
        client = LLMClient(server.grpc_url)
        client.generate(stream_prompts[0], max_tokens=4)  # warm-up
        runs, load = [], []
        try:
            for r in range(rounds):
                say(f"mixed_load: {name}, arrivals round {r + 1}/{rounds}")
                runs.append(arrivals_round(client, stream_prompts[r],
                                           longs[r * s["long_count"]:(r + 1) * s["long_count"]], s))
            for rate in s["rates"]:
                say(f"mixed_load: {name}, Poisson load at {rate}/s for {s['load_seconds']:.0f} s")
                load.append(load_run(client, stream_prompts[rounds:], load_prompts, rate, s))
        except RuntimeError as e:  # the server's side of it, before its logs go with it
            raise RuntimeError(f"{e} ({name}); the server's log tail:\n{server.log_tail(40)}") from None
        return runs, load, handoff_metrics(server.metrics_url) if "--disaggregate" in args else None


def run(params: Params, artifacts) -> dict:
    from kvforge.manifest import Manifest

    s = shape(params.quick)
    model = s["model"] or params.model
    engine_dir = artifacts.engine(artifacts.export(model, "inplace", "fp32"), "fp32", params.threads)
    s["context"] = Manifest.load(engine_dir).max_seq_len  # a stream runs until stopped
    repo = artifacts.root / "model_repository_mixed_load"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    rounds = s["rounds"]
    stream_prompts = fresh_prompts(engine_dir, s["stream_prompt"], rounds + s["background"])
    longs = fresh_prompts(engine_dir, s["long_tokens"], rounds * s["long_count"])
    load_prompts = [p for n in s["load_lengths"] for p in fresh_prompts(engine_dir, n, 3)]
    prompts = stream_prompts, longs, load_prompts
    results = {}
    for name, args in configurations(s):
        try:
            runs, load, handoffs = measured_configuration(repo, name, args, prompts, s)
            retried = None
        except RuntimeError as e:  # once more on a fresh server; the failure stays in the results
            say(f"mixed_load: {name} failed ({str(e).splitlines()[0][:200]}); once more on a fresh server")
            retried = str(e)
            runs, load, handoffs = measured_configuration(repo, name, args, prompts, s)
        results[name] = {
            "handoffs": handoffs, "goodput_per_s": goodput(load),
            "itl_alone_p50_ms": describe([x["itl_alone_p50_s"] for x in runs], **ms, stats=("median",))["median"],
            "itl_during_p99_ms": describe([x["itl_during_p99_s"] for x in runs], **ms, stats=("median",))["median"],
            "itl_during_max_ms": describe([x["itl_during_max_s"] for x in runs], **ms, stats=("median",))["median"],
            "long_ttft_s": describe([t for x in runs for t in x["long_ttft_s"]], digits=2, stats=("median", "max")),
            "rounds": runs, "load": load, "args": args, "retried_after": retried}
    return {"model": model, "shape": s, "slo": {"ttft_s": TTFT_SLO, "itl_p99_ms": ITL_SLO * 1e3, "attainment": ATTAINMENT},
            "configurations": results,
            "units": {"itl_*_ms": "ms between a stream's tokens (a coalesced response spreads its gap)",
                      "long_ttft_s": "s from sending a long prompt to its first token", "rate": "long prompts/s",
                      "attained": "the streams met their SLO and >= attainment of the long prompts theirs",
                      "goodput_per_s": "the highest rate measured whose run attained the SLO (DistServe)"},
            "method": "fresh server per configuration; gRPC streams with per-response client timestamps; "
                      "prompts cut from held-out text, fresh per round (no prefix hits)"}


def _default(section: dict) -> tuple[str, dict] | tuple[None, None]:
    return (DEFAULT, section["configurations"][DEFAULT]) if DEFAULT in section["configurations"] else (None, None)


def targets(results: dict) -> list[dict]:
    section = results.get("mixed_load")
    required = ("stall-free default: stream ITL p99 during two 2K prompts <= 4x its ITL p50 alone; "
                "their TTFT <= 1.3x the alternate scheduler's")
    if not section_ran(section):
        return [skipped("mixed_load: stall-free by default", required, "the section did not run")]
    name, c = _default(section)
    if c is None:
        return [skipped("mixed_load: stall-free by default", required, "the default budget was not measured")]
    before = section["configurations"]["alternate"]
    ratio = c["itl_during_p99_ms"] / c["itl_alone_p50_ms"]
    ttft = c["long_ttft_s"]["median"] / before["long_ttft_s"]["median"]
    best = max(section["configurations"], key=lambda n: section["configurations"][n]["goodput_per_s"])
    goodput = {n: section["configurations"][n]["goodput_per_s"] for n in ("alternate", best)}
    rows = [target("mixed_load: stream ITL p99 / p50 (stall-free default)", "<= 4x",
                   f"{ratio:.1f}x ({c['itl_during_p99_ms']:.1f} / {c['itl_alone_p50_ms']:.1f} ms)", ratio <= 4,
                   f"alternate: {before['itl_during_p99_ms'] / before['itl_alone_p50_ms']:.1f}x"),
            target("mixed_load: long prompts' TTFT vs alternate", "<= 1.3x", f"{ttft:.2f}x", ttft <= 1.3,
                   f"median {c['long_ttft_s']['median']:.2f} s vs {before['long_ttft_s']['median']:.2f} s")]
    if goodput["alternate"] > 0:
        rows.append(target("mixed_load: goodput, best vs alternate", ">= 2x",
                           f"{goodput[best] / goodput['alternate']:.2f}x ({best})",
                           goodput[best] >= 2 * goodput["alternate"],
                           f"the highest rate attaining the SLO: {goodput[best]:g} vs {goodput['alternate']:g}/s"))
    else:
        rows.append(target("mixed_load: goodput, best vs alternate", ">= 2x (alternate: 0 -> rates reported)",
                           f"{best}: {goodput[best]:g}/s", None,
                           "the alternate scheduler met the SLO at no rate measured; see the load table"))
    pd = {n: section["configurations"][n] for n in ("disaggregated", "conditional") if n in section["configurations"]}
    if pd:
        n, c = min(pd.items(), key=lambda item: item[1]["itl_during_p99_ms"] / item[1]["itl_alone_p50_ms"])
        pd_ratio = c["itl_during_p99_ms"] / c["itl_alone_p50_ms"]
        rows.append(target("mixed_load: stream ITL p99 / p50, disaggregated", "<= 2x", f"{pd_ratio:.1f}x ({n})",
                           pd_ratio <= 2, f"{c['itl_during_p99_ms']:.1f} / {c['itl_alone_p50_ms']:.1f} ms, 1 + 1 threads"))
        h, c = pd.get("disaggregated", c)["handoffs"], pd.get("disaggregated", c)
        if h and h["handoffs"] and h["write_mean_s"] is not None:
            share = (h["write_mean_s"] + h["read_p50_s"]) / c["long_ttft_s"]["median"]
            rows.append(target("mixed_load: hand-off of a long prompt vs its TTFT (one host)", "<= 5%",
                               f"{100 * share:.2f}%", share <= 0.05,
                               f"write {1e3 * h['write_mean_s']:.1f} ms + read p50 {1e3 * h['read_p50_s']:.1f} ms "
                               f"(mean {h['bytes'] / h['handoffs'] / 2**20:.1f} MiB) vs TTFT {c['long_ttft_s']['median']:.2f} s"))
    return rows


def markdown(results: dict) -> list[str]:
    section = results.get("mixed_load")
    if not rendered(section):
        return []
    s, slo = section["shape"], section["slo"]
    lines = ["## Mixed load: streams beside long prompts (issue 20)", "",
             f"`{section['model']}`; one stream decoding, {s['long_count']} fresh {s['long_tokens']}-token prompts "
             f"arriving together after {s['warm_tokens']} of its tokens; medians of {s['rounds']} rounds.", "",
             *[f"- `{n}` was measured again on a fresh server after a failure: "
               f"{c['retried_after'].splitlines()[0][:300]}" for n, c in section["configurations"].items()
               if c.get("retried_after")], "",
             *table(["scheduler", "stream ITL p50 alone ms", "ITL p99 during ms", "ITL max during ms",
                     "p99 / p50", "long TTFT median / max s"],
                    [[n, c["itl_alone_p50_ms"], c["itl_during_p99_ms"], c["itl_during_max_ms"],
                      f"{c['itl_during_p99_ms'] / c['itl_alone_p50_ms']:.1f}x",
                      f"{c['long_ttft_s']['median']} / {c['long_ttft_s']['max']}"]
                     for n, c in section["configurations"].items()]), "",
             *(["Hand-offs (disaggregated configurations; the prefill worker writes to /dev/shm, the decode "
                "engine loads them as a prefix hit):", "",
                *table(["configuration", "remote / local prefills", "hand-offs", "failures", "MiB per hand-off",
                        "write mean ms", "read p50 ms"],
                       [[n, f"{h['remote']} / {h['local']}", h["handoffs"], h["failures"],
                         f"{h['bytes'] / max(h['handoffs'], 1) / 2**20:.2f}",
                         f"{1e3 * h['write_mean_s']:.1f}" if h["write_mean_s"] is not None else "-",
                         f"{1e3 * h['read_p50_s']:.1f}"]
                        for n, c in section["configurations"].items() if (h := c.get("handoffs"))]), ""]
               if any(c.get("handoffs") for c in section["configurations"].values()) else []),
             f"Poisson arrivals of {'/'.join(map(str, s['load_lengths']))}-token prompts beside {s['background']} "
             f"streams, {s['load_seconds']:.0f} s per rate; SLO TTFT <= {slo['ttft_s']:.0f} s and stream ITL p99 <= "
             f"{slo['itl_p99_ms']:.0f} ms; a run attains it when the streams met theirs and >= "
             f"{100 * slo['attainment']:.0f}% of the long prompts theirs; goodput = the highest rate attaining it.", "",
             *table(["scheduler", "rate /s", "long prompts", "stream ITL p99 ms", "TTFT median s", "met TTFT SLO",
                     "attained", "goodput /s"],
                    [[n, x["rate"], x["long_prompts"], f"{x['background_itl_p99_s'] * 1e3:.0f}",
                      f"{np.median(x['long_ttft_s']):.2f}" if x["long_ttft_s"] else "-", x["slo_met"],
                      "yes" if x["attained"] else "no", f"{c['goodput_per_s']:g}"]
                     for n, c in section["configurations"].items() for x in c["load"]])]
    return lines


def plot(plt, results: dict, out) -> None:
    section = results.get("mixed_load")

    def draw(left, right):
        configs = section["configurations"]
        for n, c in configs.items():
            left.scatter([c["long_ttft_s"]["median"]], [c["itl_during_p99_ms"]], label=n)
            right.plot([x["rate"] for x in c["load"]], [x["slo_met"] / max(x["long_prompts"], 1) for x in c["load"]],
                       marker="o", label=f"{n} (goodput {c['goodput_per_s']:g}/s)")
        left.set(xlabel="long prompts' TTFT median (s)", ylabel="stream ITL p99 during their prefill (ms)",
                 title="Stall vs TTFT per scheduler")
        right.axhline(ATTAINMENT, color="grey", linestyle=":")
        right.set(xlabel="long-prompt arrival rate (/s)", ylabel="share of long prompts meeting both SLOs",
                  title="SLO attainment (goodput: the highest rate >= the line)")

    panels(plt, out / "mixed_load.png", section, "mixed_load", draw)
