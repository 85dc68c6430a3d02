"""Soak: mixed traffic at concurrency 64 against a real launcher (front + supervised Triton).

    python -m bench.soak [--seconds 600] [--concurrency 64] [--out results/soak.json]

Each worker loops over a weighted mix: HTTP streams and single responses through the front, gRPC
streams straight to Triton, streams the client leaves early (cancelled), and bad requests
(malformed JSON, wrong types, oversized bodies, a huge stop string, a wrong `step` shape).
An "error" is anything a well-behaved server would not answer: a 5xx other than a 503 refusal
for load, a bad request not answered 4xx, a good request that fails, or a hang (client
timeout). It reports errors by kind, p50/p99 latency per kind, RSS of the launcher, tritonserver
and its stubs at the start and end, the cancellation latency (client disconnect to the engine's
"cancelled" log line, via the request id; and from the model seeing it to the engine's last
output) and the CPU the llm model spent polling for cancellations (share of one core); JSON to
--out, a markdown table to stdout.
"""
from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

from bench.common import describe

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, item):", "for i in range(",
           "with open(path) as f:", "def parse(text):\n    \"\"\""]
MIX = {"http_stream": 30, "http_generate": 20, "grpc_stream": 20, "http_cancel": 12, "grpc_cancel": 5, "bad": 13}
BAD = [(b'{"text_input": "x", "max_tokens": ', "generate"), (b'{"text_input": 7, "max_tokens": 3}', "generate"),
       (b'{"text_input": "x", "max_tokens": "many"}', "generate_stream"),
       (b'{"text_input": "x", "max_tokens": 3, "seed": -1}', "generate"),
       (json.dumps({"text_input": "x", "max_tokens": 3, "stop_words": ["s" * 500_000]}).encode(), "generate"),
       (json.dumps({"text_input": "", "max_tokens": 3}).encode(), "generate"),
       (b"a" * (2 << 20), "generate"), (b"step", "step")]
CLIENT_TIMEOUT = 120.0


def rss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            total += int(next(l for l in Path(f"/proc/{pid}/status").read_text().splitlines()
                              if l.startswith("VmRSS:")).split()[1])
        except (OSError, StopIteration):
            pass
    return total


def service_pids(server) -> list[int]:
    """The launcher, tritonserver and its stub processes."""
    triton = server.tritonserver_pid()
    pids = [server.process.pid] + ([triton] if triton else [])
    if triton:
        try:
            pids += [int(p) for p in Path(f"/proc/{triton}/task/{triton}/children").read_text().split()]
        except OSError:
            pass
    return pids


def metric(server, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


class Worker:
    def __init__(self, server, seed: int, stats: dict, cancels: dict, lock: threading.Lock):
        from clients.api import LLMClient

        self.server, self.rng, self.stats, self.cancels, self.lock = server, random.Random(seed), stats, cancels, lock
        self.http = LLMClient(server.http_url, "http", timeout=CLIENT_TIMEOUT)
        self.grpc = LLMClient(server.grpc_url, "grpc", timeout=CLIENT_TIMEOUT)
        self.count = 0

    def record(self, kind: str, outcome: str, seconds: float, detail: str = "") -> None:
        with self.lock:
            self.stats[kind]["outcomes"][outcome] += 1
            if outcome in ("ok", "refused_4xx"):
                self.stats[kind]["latency"].append(seconds)
            if outcome not in ("ok", "refused_4xx", "refused_for_load") and len(self.stats[kind]["examples"]) < 5:
                self.stats[kind]["examples"].append(detail[:200])

    def run(self, until: float) -> None:
        kinds, weights = zip(*MIX.items())
        while time.monotonic() < until:
            kind = self.rng.choices(kinds, weights)[0]
            started = time.perf_counter()
            try:
                outcome, detail = getattr(self, kind)()
            except Exception as e:  # anything unexpected is an error of this kind, never a stop
                outcome, detail = "error", f"{type(e).__name__}: {e}"
            self.record(kind, outcome, time.perf_counter() - started, detail)

    def generation_outcome(self, call) -> tuple[str, str]:
        from clients.api import GenerationError

        try:
            completion = call()
        except GenerationError as e:
            return ("refused_for_load", str(e)) if str(e).startswith("UNAVAILABLE:") else ("error", str(e))
        return ("ok", "") if completion.token_ids else ("error", "no tokens")

    def options(self) -> dict:
        return dict(max_tokens=self.rng.choice([16, 64, 128]), temperature=self.rng.choice([0.0, 0.8]), seed=1)

    def http_stream(self):
        return self.generation_outcome(lambda: self.http.generate(self.rng.choice(PROMPTS), **self.options()))

    def http_generate(self):
        return self.generation_outcome(lambda: self.http.generate(self.rng.choice(PROMPTS), stream=False,
                                                                  **self.options()))

    def grpc_stream(self):
        return self.generation_outcome(lambda: self.grpc.generate(self.rng.choice(PROMPTS), **self.options()))

    def http_cancel(self):
        """Leave a long stream after a few events; the engine must log it cancelled."""
        self.count += 1
        request_id = f"soak-{id(self)}-{self.count}"
        connection = http.client.HTTPConnection(*self.server.http_url.split(":"), timeout=CLIENT_TIMEOUT)
        try:
            connection.request("POST", "/v2/models/llm/generate_stream", json.dumps(
                {"text_input": self.rng.choice(PROMPTS), "max_tokens": 900, "stream": True}),
                headers={"X-Request-ID": request_id})
            response = connection.getresponse()
            if response.status == 503:
                return "refused_for_load", ""
            if response.status != 200:
                return "error", f"HTTP {response.status}"
            for _ in range(self.rng.randint(1, 8)):
                if not response.readline().startswith(b"data:") or not response.readline() == b"\n":
                    return "error", "stream ended early"
            left = time.time()
            connection.sock.shutdown(2)
        finally:
            connection.close()
        with self.lock:
            self.cancels[request_id] = left
        return "ok", ""

    def grpc_cancel(self):
        for _ in self.grpc.stream(self.rng.choice(PROMPTS), max_tokens=900):
            break  # leaving the stream cancels the request
        return "ok", ""

    def bad(self):
        body, endpoint = self.rng.choice(BAD)
        if endpoint == "step":
            import tritonclient.http as httpclient

            client = httpclient.InferenceServerClient(self.server.http_url, network_timeout=CLIENT_TIMEOUT)
            rows = httpclient.InferInput("input_ids", [2, 3], "INT64")
            rows.set_data_from_numpy(np.ones((2, 3), np.int64))
            try:
                client.infer("step", [rows])
            except Exception as e:
                return ("refused_4xx", "") if "shape [1, n]" in str(e) else ("error", str(e))
            finally:
                client.close()
            return "error", "a [2, 3] step input was accepted"
        request = urllib.request.Request(f"http://{self.server.http_url}/v2/models/llm/{endpoint}", data=body,
                                         method="POST")
        try:
            urllib.request.urlopen(request, timeout=CLIENT_TIMEOUT).read()
        except urllib.error.HTTPError as e:
            text = e.read()
            if e.code == 503:
                return "refused_for_load", ""
            return ("refused_4xx", "") if 400 <= e.code < 500 and len(text) < 1000 else ("error", f"{e.code} {text[:100]}")
        return "error", "a bad request was accepted"


def served_repository(model: str, work: Path) -> Path:
    """A model repository under work/ for model (exported once, inplace fp32, 1024 context)."""
    from engines.repository import write_repository
    from export.__main__ import export

    export_dir = work / "export"
    if not (export_dir / "manifest.json").is_file():
        export(model, export_dir, "inplace", "fp32", 1024)
    write_repository(export_dir, work / "repo")
    return work / "repo"


def latency_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50_ms": None, "p99_ms": None}
    return describe(seconds, scale=1e3, digits=1, unit="_ms", stats=("p50", "p99"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--model", default=str(ROOT / "models" / "stdlib-llama"))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "soak.json")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "soak")
    args = parser.parse_args(argv)

    from launcher.harness import TritonServer, free_ports

    repo = served_repository(args.model, args.work)
    http, grpc, metrics = free_ports(3)
    stats = defaultdict(lambda: {"outcomes": Counter(), "latency": [], "examples": []})
    cancels: dict[str, float] = {}
    lock = threading.Lock()
    logs = args.work / "logs"
    if logs.exists():
        for old in logs.iterdir():
            old.unlink()
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, log_dir=logs) as server:
        from clients.api import LLMClient

        LLMClient(server.grpc_url).generate(PROMPTS[0], max_tokens=4)  # warm-up
        rss_start = rss_kib(service_pids(server))
        tokens0, poll0 = metric(server, "kvforge_generated_tokens_total"), metric(server, "kvforge_cancel_poll_seconds_total")
        started = time.monotonic()
        until = started + args.seconds
        workers = [Worker(server, seed, stats, cancels, lock) for seed in range(args.concurrency)]
        threads = [threading.Thread(target=w.run, args=(until,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        rss_samples = []
        while any(t.is_alive() for t in threads):
            time.sleep(5)
            rss_samples.append((round(time.monotonic() - started, 1), rss_kib(service_pids(server))))
            if time.monotonic() > until + 2 * CLIENT_TIMEOUT:
                break
        hung = sum(t.is_alive() for t in threads)
        wall = time.monotonic() - started
        time.sleep(1)
        tokens = metric(server, "kvforge_generated_tokens_total") - tokens0
        poll = metric(server, "kvforge_cancel_poll_seconds_total") - poll0
        rss_end = rss_kib(service_pids(server))
        restarts = [json.loads(l) for l in (logs / "kvforge.jsonl").read_text().splitlines() if '"restart"' in l]
        engine, stop_ms = {}, []
        for line in (logs / "kvforge.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("source") == "engine" and record.get("finish_reason") == "cancelled":
                engine[record["request_id"]] = record["time"]
                if record.get("stop_ms") is not None:
                    stop_ms.append(record["stop_ms"])
        cancel_ms = [1000 * (engine[r] - left) for r, left in cancels.items() if r in engine]
        ready_at_end = server.ready()
    kinds = {kind: {"outcomes": dict(s["outcomes"]), **latency_ms(s["latency"]),
                    "examples": s["examples"]} for kind, s in stats.items()}
    errors = sum(s["outcomes"].get("error", 0) for s in kinds.values())
    result = {
        "seconds": round(wall, 1), "concurrency": args.concurrency, "model": args.model, "mix": MIX,
        "requests": sum(sum(s["outcomes"].values()) for s in kinds.values()), "errors": errors,
        "hung_workers": hung, "restarts": len(restarts), "ready_at_end": ready_at_end, "kinds": kinds,
        "generated_tokens_per_s": round(tokens / wall, 1),
        "rss_mib": {"start": round(rss_start / 1024, 1), "end": round(rss_end / 1024, 1),
                    "growth": round((rss_end - rss_start) / 1024, 1), "samples": rss_samples},
        "cancel_latency_ms": {"count": len(cancel_ms), "unmatched": len(cancels) - len(cancel_ms),
                              "p50": round(statistics.median(cancel_ms), 1) if cancel_ms else None,
                              "p99": round(float(np.percentile(cancel_ms, 99)), 1) if cancel_ms else None,
                              "max": round(max(cancel_ms), 1) if cancel_ms else None},
        "engine_stop_after_cancel_seen_ms": {"count": len(stop_ms),
                                             "p50": round(statistics.median(stop_ms), 2) if stop_ms else None,
                                             "p99": round(float(np.percentile(stop_ms, 99)), 2) if stop_ms else None},
        "cancel_poll_cpu_percent_of_a_core": round(100 * poll / wall, 3),
        "method": "closed loop, one thread per concurrent client; cancel latency = engine's cancelled log "
                  "line time - client's disconnect time (wall clocks of one machine)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| kind | ok | 4xx (expected) | 503 (load) | errors | p50 ms | p99 ms |\n|---|---|---|---|---|---|---|")
    for kind, s in sorted(kinds.items()):
        o = s["outcomes"]
        print(f"| {kind} | {o.get('ok', 0)} | {o.get('refused_4xx', 0)} | {o.get('refused_for_load', 0)} | "
              f"{o.get('error', 0)} | {s['p50_ms']} | {s['p99_ms']} |")
    print(f"\n{result['requests']} requests in {wall:.0f} s, {errors} errors, {hung} hung, {len(restarts)} restarts; "
          f"{result['generated_tokens_per_s']} tokens/s; RSS {result['rss_mib']['start']} -> "
          f"{result['rss_mib']['end']} MiB; cancel latency p50 {result['cancel_latency_ms']['p50']} ms, "
          f"p99 {result['cancel_latency_ms']['p99']} ms; cancel polling {result['cancel_poll_cpu_percent_of_a_core']}% "
          f"of a core; saved {args.out}")
    return 1 if errors or hung else 0


if __name__ == "__main__":
    sys.exit(main())
