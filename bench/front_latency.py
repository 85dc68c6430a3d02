"""What the HTTP front adds: the same requests through the front and straight to Triton's HTTP.

    python -m bench.front_latency [--requests 200] [--streams 20] [--out results/front_latency.json]

Sequential, one client: per request, a 1-token /generate (round trip); per token, a 256-token
/generate_stream (total time / tokens, and the gap between events); per cancellation, a long
/generate_stream left after its first event (from the disconnect to the engine's "cancelled"
line in the access log). The two paths take turns request by request against one server, so
load from elsewhere hits both alike. JSON to --out and a markdown table to stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):"


def post(url: str, body: dict) -> tuple[float, list[float]]:
    """(total seconds, event arrival times) of one request."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    arrivals = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data:") or line.startswith(b"{"):
                arrivals.append(time.perf_counter() - started)
    return time.perf_counter() - started, arrivals


def cancelled_lines(access_log: Path) -> list[dict]:
    if not access_log.is_file():
        return []
    records = [json.loads(line) for line in access_log.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("source") == "engine" and r.get("finish_reason") == "cancelled"]


def cancel_seconds(url: str, body: dict, access_log: Path) -> float:
    """From leaving a stream after its first event to the engine ending the request (the
    access log's line for it; one cancellation at a time, so the next such line is this one)."""
    before = len(cancelled_lines(access_log))
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            if line.startswith(b"data:"):
                break
    left = time.time()  # the connection is closed here
    deadline = left + 30
    while time.time() < deadline:
        lines = cancelled_lines(access_log)
        if len(lines) > before:
            return lines[before]["time"] - left
        time.sleep(0.005)
    raise RuntimeError(f"the engine never logged the cancelled stream of {url} within 30 s")


def ms(values: list[float]) -> dict:
    values = sorted(values)
    return {"median": round(1000 * statistics.median(values), 3),
            "p90": round(1000 * values[int(0.9 * (len(values) - 1))], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.front_latency", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--cancels", type=int, default=20)
    parser.add_argument("--model", default=str(ROOT / "models" / "stdlib-llama"))
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "front_latency.json")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "front_latency")
    args = parser.parse_args(argv)

    from bench.soak import served_repository
    from launcher.harness import TritonServer, free_ports

    repo = served_repository(args.model, args.work)
    http, grpc, metrics, triton_http = free_ports(4)
    paths = {"front": f"http://127.0.0.1:{http}", "direct": f"http://127.0.0.1:{triton_http}"}
    one = {name: [] for name in paths}
    per_token = {name: [] for name in paths}
    gaps = {name: [] for name in paths}
    cancels = {name: [] for name in paths}
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics,
                      extra_args=["--triton-http-port", str(triton_http)]) as server:
        for base in paths.values():  # warm-up
            post(f"{base}/v2/models/llm/generate", {"text_input": PROMPT, "max_tokens": 4})
        for _ in range(args.requests):
            for name, base in paths.items():
                one[name].append(post(f"{base}/v2/models/llm/generate", {"text_input": PROMPT, "max_tokens": 1})[0])
        body = {"text_input": PROMPT, "max_tokens": args.stream_tokens, "stream": True}
        for _ in range(args.streams):
            for name, base in paths.items():
                total, arrivals = post(f"{base}/v2/models/llm/generate_stream", body)
                per_token[name].append(total / args.stream_tokens)
                gaps[name] += [b - a for a, b in zip(arrivals, arrivals[1:])]
        long = {"text_input": PROMPT, "max_tokens": 1000, "stream": True}
        for _ in range(args.cancels):
            for name, base in paths.items():
                cancels[name].append(cancel_seconds(f"{base}/v2/models/llm/generate_stream", long,
                                                    server.log_dir / "kvforge.jsonl"))
    result = {
        "requests": args.requests, "streams": args.streams, "stream_tokens": args.stream_tokens, "model": args.model,
        "request_ms": {name: ms(v) for name, v in one.items()},
        "per_token_ms": {name: ms(v) for name, v in per_token.items()},
        "event_gap_ms": {name: ms(v) for name, v in gaps.items()},
        "cancel_ms": {name: ms(v) for name, v in cancels.items()},
        "method": "sequential, one client, front and direct taking turns request by request on one server",
    }
    result["added_ms"] = {
        "per_request_median": round(result["request_ms"]["front"]["median"] - result["request_ms"]["direct"]["median"], 3),
        "per_token_median": round(result["per_token_ms"]["front"]["median"] - result["per_token_ms"]["direct"]["median"], 4),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| path | 1-token request median / p90 ms | streamed per token median ms | event gap median ms "
          "| disconnect to engine stop median / p90 ms |\n|---|---|---|---|---|")
    for name in paths:
        r, t, g, c = (result[key][name] for key in ("request_ms", "per_token_ms", "event_gap_ms", "cancel_ms"))
        print(f"| {name} | {r['median']} / {r['p90']} | {t['median']} | {g['median']} | {c['median']} / {c['p90']} |")
    print(f"\nthe front adds {result['added_ms']['per_request_median']} ms per request and "
          f"{result['added_ms']['per_token_median']} ms per streamed token (medians); saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
