"""Shared fixtures, made once per test session: real exports of the tiny preset, a real tritonserver."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SERVING_CONTEXT = 2048
SERVING_SLOTS = 10
PATIENCE = 120.0  # seconds: what `patient` gives a load or a Redis command (a hang bound, not a speed)


def run_cli(*args: str, check: bool = False, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a kvforge command the way a user does (python -m ...), from the repository root."""
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="session")
def exports(tmp_path_factory):
    """exports(layout, dtype, model="tiny-llama") -> export dir, created in-process on first use."""
    from export.__main__ import export

    root = tmp_path_factory.mktemp("exports")
    made: dict[tuple, Path] = {}

    def make(layout: str = "inplace", dtype: str = "fp32", model: str = "tiny-llama", max_seq_len: int = 512) -> Path:
        key = (layout, dtype, str(model), max_seq_len)
        if key not in made:
            out = root / f"{Path(model).name}-{layout}-{dtype}-{max_seq_len}"
            export(str(model), out, layout, dtype, max_seq_len)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def triton(exports, tmp_path_factory):
    """The launcher (front, OpenAI API, supervised tritonserver) on free loopback ports serving the
    repository (`llm`, its aliases, `step`) for the tiny export.
    The preset's whole context lets a request run long enough to be cancelled mid-generation."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    repo = tmp_path_factory.mktemp("model_repository")
    write_repository(exports(max_seq_len=SERVING_CONTEXT), repo, slots=SERVING_SLOTS)
    http, grpc, metrics, openai = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai) as server:
        yield server


@pytest.fixture
def patient(monkeypatch):
    """Pins what only speed would decide, for tests of the KV tiers that are about something
    else: a load from disk / Redis is never given up at its recompute deadline, never skipped on
    a bandwidth estimate made before the tier measured itself, and a Redis command does not time
    out. Hits are then exact. (Through a tritonserver nothing can be pinned.)"""
    import runtime.kv.tiers.base as tier_base
    import runtime.kv.tiers.redis as redis_tier
    import runtime.scheduler as scheduler

    monkeypatch.setattr(scheduler, "LOAD_DEADLINE_FLOOR", PATIENCE)
    monkeypatch.setattr(scheduler, "LOAD_DEADLINE_UNMEASURED", PATIENCE)
    monkeypatch.setattr(tier_base, "INITIAL_BANDWIDTH", {"disk": math.inf, "redis": math.inf})
    monkeypatch.setattr(redis_tier, "REDIS_TIMEOUT_SECONDS", PATIENCE)


@pytest.fixture(scope="session")
def fp32(exports):
    """The tiny preset's in-place fp32 export."""
    return exports()


@pytest.fixture(scope="session")
def codec(fp32):
    """The block codec of that export's KV cache."""
    from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
    from runtime.kv.tiers.codec import BlockCodec

    manifest = Manifest.load(fp32)
    return BlockCodec(kv_block_spec(manifest), cache_namespace(manifest))
