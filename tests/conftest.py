"""Shared fixtures, made once per test session: real exports of the tiny preset, a real tritonserver.
And the run's leftovers: what tests make outside pytest's tmp_path goes under run folders that a
reaper process removes when this pytest ends, however it ends (a SIGKILL included)."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
SERVING_CONTEXT = 2048
SERVING_SLOTS = 10
PATIENCE = 120.0  # seconds: what `patient` gives a load or a Redis command (a hang bound, not a speed)
SHARED_MEMORY = Path("/dev/shm")

# Blocks until pytest is gone (its end of the pipe closes, whatever killed it), lets the children
# that die with it go (PR_SET_PDEATHSIG), then removes the run folders.
_REAPER = ("import shutil, sys, time\n"
           "sys.stdin.buffer.read()\n"
           "time.sleep(2)\n"
           "for folder in sys.argv[1:]:\n"
           "    shutil.rmtree(folder, ignore_errors=True)\n")
_REAPER_PIPE = pytest.StashKey[int]()


def pytest_sessionstart(session):
    """This run's temporary files go in run folders: TMPDIR (the launchers' kvforge-server-*,
    kvforge-redis-cluster-*, the prefill workers' sockets, and every child's) and, for in-process
    engines, the hand-off root in /dev/shm (kvforge-pd-*). pytest's own tmp_path stays where it was
    (its last runs are kept for a look after a failure)."""
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    folders = [Path(tempfile.mkdtemp(prefix=f"kvforge-test-{os.getpid()}-"))]
    if SHARED_MEMORY.is_dir():
        folders.append(Path(tempfile.mkdtemp(prefix=f"kvforge-test-{os.getpid()}-", dir=SHARED_MEMORY)))
        import runtime.disaggregation

        runtime.disaggregation.DEFAULT_ROOT = folders[-1]
    os.environ["TMPDIR"] = tempfile.tempdir = str(folders[0])
    read, write = os.pipe()
    subprocess.Popen([sys.executable, "-S", "-c", _REAPER, *map(str, folders)], stdin=read,
                     start_new_session=True)  # its own session: a Ctrl-C of the run does not reach it
    os.close(read)
    session.config.stash[_REAPER_PIPE] = write  # open until this process ends


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
    an estimate of its time (a tier's measured latency, or its bandwidth before it measured
    itself), and a Redis command does not time out. Hits are then exact: from disk, Redis and a prefill worker's hand-off. (Through a
    tritonserver nothing can be pinned.)"""
    import runtime.kv.tiers.base as tier_base
    import runtime.kv.tiers.redis as redis_tier
    import runtime.scheduler as scheduler
    from runtime.kv.tiers.lower import LowerTiers

    monkeypatch.setattr(scheduler, "LOAD_DEADLINE_FLOOR", PATIENCE)
    monkeypatch.setattr(scheduler, "LOAD_DEADLINE_UNMEASURED", PATIENCE)
    monkeypatch.setattr(tier_base, "INITIAL_BANDWIDTH", {"disk": math.inf, "redis": math.inf, "handoff": math.inf})
    monkeypatch.setattr(LowerTiers, "estimate", lambda self, tier, blocks: 0.0)  # a measured latency skips no load
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


# The families' tiny checkpoints and their exports, session-wide: tests/test_families.py and
# tests/test_family_weights.py share them, and tests/test_moe.py and tests/test_deepseek_moe.py the
# mixture-of-experts ones (an export takes seconds of tracing per family).
from tests.families import family_checkpoints, family_exports, family_tokenizer_dir  # noqa: E402,F401
from tests.families import moe_checkpoints, moe_exports  # noqa: E402,F401
