"""Serving measured by NVIDIA's aiperf through the OpenAI-compatible API (make bench's section 5).

aiperf drives /v1/chat/completions and /v1/completions (streaming) at each concurrency level
with synthetic prompts of a fixed token count (--tokenizer is the engine dir, so it counts as
the server does) and reports TTFT, inter-token latency and output tokens/s the way other
servers' published figures are made. min_tokens (a kvforge/vLLM extension field) holds every
answer at the requested length, and --use-server-token-count takes the counts from `usage`.
The API runs in a process of its own (uvicorn), as `make serve` runs it.
"""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time
from pathlib import Path

import httpx

ENDPOINT_TYPES = ("chat", "completions")
STARTUP_SECONDS = 60
# aiperf reports these metrics (profile_export_aiperf.json) -> our names
METRICS = {"time_to_first_token": "ttft_ms", "inter_token_latency": "inter_token_ms",
           "request_latency": "request_latency_ms"}


def _serve(triton_http: str, triton_grpc: str, repo: str, port: int) -> None:
    import uvicorn

    from frontend.config import FrontConfig
    from frontend.openai_api import create_openai_app

    app = create_openai_app(FrontConfig(triton_http, triton_grpc, Path(repo)))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def start_api(server, repo: Path, port: int) -> multiprocessing.Process:
    process = multiprocessing.get_context("spawn").Process(
        target=_serve, args=(server.http_url, server.grpc_url, str(repo), port), daemon=True)
    process.start()
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline and process.is_alive():
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.terminate()
    raise RuntimeError(f"the OpenAI-compatible API did not start on port {port}")


def one_level(url: str, engine_dir: Path, endpoint: str, concurrency: int, requests: int, prompt_tokens: int,
              new_tokens: int, out: Path) -> dict:
    command = [str(aiperf_command()), "profile", "--model", "llm", "--url", url,
               "--endpoint-type", endpoint, "--streaming", "--concurrency", str(concurrency),
               "--request-count", str(requests), "--warmup-request-count", str(min(concurrency, 4)),
               "--isl", str(prompt_tokens), "--osl", str(new_tokens),
               "--extra-inputs", f"min_tokens:{new_tokens}", "--use-server-token-count",
               "--tokenizer", str(engine_dir), "--random-seed", "0", "--ui-type", "none",
               "--artifact-dir", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900)
    export = out / "profile_export_aiperf.json"
    if result.returncode != 0 or not export.is_file():
        return {"concurrency": concurrency, "error": (result.stderr or result.stdout)[-800:]}
    data = json.loads(export.read_text())

    def stat(name: str) -> dict:
        return {k: round(data[name][k], 3) for k in ("p50", "p99", "avg") if data[name].get(k) is not None}

    return {"concurrency": concurrency, "requests": int(data["completed_request_count"]["avg"]),
            "error_rate_percent": data["request_error_rate"]["avg"],
            **{ours: stat(theirs) for theirs, ours in METRICS.items()},
            "output_tokens_per_s": round(data["output_token_throughput"]["avg"], 2),
            "output_tokens": int(data["total_output_tokens"]["avg"])}


def aiperf_command() -> Path:
    return Path(sys.executable).with_name("aiperf")


def run(server, repo: Path, engine_dir: Path, concurrency: tuple[int, ...], requests_for, prompt_tokens: int,
        new_tokens: int, work: Path, say) -> dict:
    """aiperf at each concurrency level on both endpoint types; skipped (saying so) where aiperf is
    not installed: `make bench` installs the bench extra, `make setup` (and so `make test`) does not."""
    from launcher.harness import free_ports

    if not aiperf_command().is_file():
        return {"skipped": f"aiperf is not installed in {Path(sys.executable).parent} (make bench installs it)"}
    port, = free_ports(1)
    api = start_api(server, repo, port)
    try:
        levels = {}
        for endpoint in ENDPOINT_TYPES:
            levels[endpoint] = []
            for c in concurrency:
                say(f"serving: aiperf {endpoint}, concurrency {c}")
                levels[endpoint].append(one_level(f"http://127.0.0.1:{port}", engine_dir, endpoint, c,
                                                  requests_for(c), prompt_tokens, new_tokens, work / f"{endpoint}-{c}"))
    finally:
        api.terminate()
        api.join(10)
    return {"tool": "aiperf profile (streaming, synthetic prompts, server token counts)", **levels}
