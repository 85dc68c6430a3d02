"""Prefill/decode disaggregation (issue 20): a prefill worker process beside the decode engine,
the prompt's KV handed over through the block store.

The decode engine (LLMEngine with `disaggregation=`) sends a prompt to the worker only when its
uncached tokens exceed `threshold_tokens` and fewer than `max_queue` remote prefills are in
flight (Dynamo's conditional rule: short or cached prompts stay local, where stall-free steps
prefill them). The worker runs its own LLMEngine on its own threads, prefills the prompt
(max_tokens=1), and writes the prompt's full blocks to the transport, acknowledged before it
reports done. The decode engine then queues the request as any other: admission finds the
blocks in the hand-off tier (one host: runtime/kv/tiers/handoff.py on /dev/shm) or in the
shared Redis (across hosts, `transport="redis"`: written through), loads them as a prefix hit
and computes the rest of the last block itself, so it samples the first token with the
request's own sampler: greedy and seeded tokens are those of aggregated serving.

Failures cost recompute, never a wrong answer: a worker that dies, errs or takes longer than
`handoff_timeout` fails its in-flight hand-offs and the decode engine prefills those prompts
locally (counted); blocks are checked against their chain hash on read; a cancelled request
discards its blocks. The decode side restarts a dead worker (after RESTART_SECONDS) and prefills
locally meanwhile. The worker exits when its parent does.

Protocol: JSON messages over a Unix socket in a private directory (multiprocessing.connection
with a random authkey; bytes only, never pickles). The worker process: runtime/prefill_worker.py.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Client
from pathlib import Path
from typing import Callable

from kvforge import env
from kvforge.engine_config import THRESHOLD_TOKENS, TRANSPORTS, flags_of, variable
from kvforge.block_hash import chain
from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.handoff import DEFAULT_ROOT, HandoffTier

log = logging.getLogger("kvforge.disaggregation")

MAX_QUEUE = 2  # remote prefills in flight beyond which prompts stay local (the worker is saturated)
LEASE_SECONDS = 60.0
HANDOFF_TIMEOUT = 300.0
START_TIMEOUT = 120.0
RESTART_SECONDS = 1.0


@dataclass(frozen=True)
class Disaggregation:
    """How the decode engine uses a prefill worker."""

    threads: int | None = None  # the worker's intra-op threads (default: every core)
    transport: str = "shm"
    threshold_tokens: int = THRESHOLD_TOKENS
    max_queue: int = MAX_QUEUE
    lease_seconds: float = LEASE_SECONDS
    handoff_timeout: float = HANDOFF_TIMEOUT
    redis_url: str | None = None  # transport "redis": the Redis both sides use as their tier

    def check(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"the hand-off transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.transport == "redis" and not self.redis_url:
            raise ValueError("the redis hand-off transport needs the Redis KV tier (kv_redis_url) on both sides")
        if self.threshold_tokens < 0 or self.max_queue < 1:
            raise ValueError("threshold_tokens must be >= 0 and max_queue >= 1")


def python_executable() -> str:
    """This environment's interpreter (inside a Triton stub, sys.executable is not one)."""
    candidate = Path(sys.prefix) / "bin" / "python"
    return str(candidate) if candidate.is_file() else sys.executable


class PrefillWorker:
    """The decode side: starts and supervises the worker process, sends it prompts and calls
    on_done(job, ok, report) from its reader thread when a hand-off is written (or failed)."""

    def __init__(self, engine_dir: Path, config: Disaggregation, on_done: Callable[[int, bool, dict], None]):
        config.check()
        self.engine_dir, self.config, self.on_done = Path(engine_dir), config, on_done
        manifest = Manifest.load(engine_dir)
        self.codec = BlockCodec(kv_block_spec(manifest), cache_namespace(manifest))
        self.spec = manifest.model
        run_folder = os.environ.get(env.RUN_FOLDER) or None
        self.private = Path(tempfile.mkdtemp(prefix="kvforge-pd-", dir=run_folder))  # 0700: the socket lives here
        root = Path(run_folder) if run_folder else DEFAULT_ROOT if DEFAULT_ROOT.is_dir() else self.private
        self.handoff = HandoffTier(Path(tempfile.mkdtemp(prefix="kvforge-pd-", dir=root)), self.codec) \
            if config.transport == "shm" else None
        self.authkey = secrets.token_bytes(32)
        self.lock = threading.Lock()
        self.conn = None
        self.process: subprocess.Popen | None = None
        self.in_flight: dict[int, float] = {}  # job -> when it was sent
        self.closed = False
        self.supervisor = threading.Thread(target=self._supervise, name="kvforge-pd-supervisor", daemon=True)
        self.supervisor.start()
        threading.Thread(target=self._expire, name="kvforge-pd-expiry", daemon=True).start()

    @property
    def up(self) -> bool:
        return self.conn is not None

    def accepts(self, uncached_tokens: int) -> bool:
        with self.lock:
            return self.up and uncached_tokens > self.config.threshold_tokens and \
                len(self.in_flight) < self.config.max_queue

    def submit(self, job: int, token_ids: list[int], salt: bytes | None) -> bool:
        return self._send({"op": "prefill", "job": job, "ids": token_ids, "salt": salt.hex() if salt else None},
                          job)

    def cancel(self, job: int, token_ids: list[int], salt: bytes | None) -> None:
        """The request is gone: the worker stops it; whatever it wrote is discarded."""
        with self.lock:
            self.in_flight.pop(job, None)
        self._send({"op": "cancel", "job": job})
        if self.handoff is not None:
            blocks = (len(token_ids) - 1) // self.codec.spec.tokens
            self.handoff.discard(chain(self.codec.namespace, salt, token_ids, blocks, self.codec.spec.tokens,
                                       self.spec.long_factors(len(token_ids))))

    def _send(self, message: dict, job: int | None = None) -> bool:
        with self.lock:
            if self.conn is None:
                return False
            try:
                self.conn.send_bytes(json.dumps(message).encode())
            except OSError:
                return False
            if job is not None:
                self.in_flight[job] = time.monotonic()
            return True

    def _expire(self) -> None:
        """Fail hand-offs in flight past the timeout (a late answer no longer counts)."""
        while not self.closed:
            time.sleep(min(1.0, self.config.handoff_timeout / 4))
            now = time.monotonic()
            with self.lock:
                late = [j for j, sent in self.in_flight.items() if now - sent > self.config.handoff_timeout]
                for j in late:
                    del self.in_flight[j]
            for job in late:
                self.on_done(job, False, {"error": f"no hand-off within {self.config.handoff_timeout:g} s",
                                          "expired": True})

    # ------------------------------------------------------------------ the worker process

    def _command(self) -> list[str]:
        command = [python_executable(), "-m", "runtime.prefill_worker", "--engine", str(self.engine_dir),
                   "--socket", str(self.private / "socket"), "--lease-seconds", str(self.config.lease_seconds)]
        # the worker's engine: one prompt at a time, on its own threads
        command += flags_of({"slots": 1, **({"threads": self.config.threads} if self.config.threads else {})})
        if self.handoff is not None:
            command += ["--handoff-dir", str(self.handoff.dir)]
        return command

    def _start(self) -> None:
        socket = self.private / "socket"
        socket.unlink(missing_ok=True)
        # the code of this checkout, whatever process (a Triton stub) starts the worker
        root = str(Path(__file__).resolve().parents[1])
        environment = dict(os.environ, **{env.PD_AUTHKEY: self.authkey.hex()},
                           PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        if self.config.transport == "redis":
            environment[variable("kv_redis_url")] = self.config.redis_url
        self.process = subprocess.Popen(self._command(), env=environment, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT
        while not socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline or self.closed:
                raise OSError(f"the prefill worker did not start (exit code {self.process.poll()})")
            time.sleep(0.05)
        conn = Client(str(socket), family="AF_UNIX", authkey=self.authkey)
        with self.lock:
            self.conn = conn

    def _supervise(self) -> None:
        while not self.closed:
            try:
                self._start()
                self._read()
            except (OSError, EOFError) as e:
                if not self.closed:
                    log.warning("prefill worker: %s", e)
            self._lost()
            if not self.closed:
                time.sleep(RESTART_SECONDS)

    def _read(self) -> None:
        while True:
            report = json.loads(self.conn.recv_bytes())
            with self.lock:
                known = self.in_flight.pop(report["job"], None) is not None
            if known:
                self.on_done(report["job"], report["ok"], report)

    def _lost(self) -> None:
        """The worker is gone: what it was prefilling is prefilled locally."""
        with self.lock:
            conn, self.conn = self.conn, None
            lost, self.in_flight = list(self.in_flight), {}
        if conn is not None:
            conn.close()
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()
        for job in lost:
            self.on_done(job, False, {"error": "the prefill worker died"})

    def close(self) -> None:
        self.closed = True
        self._lost()
        self.supervisor.join(5)
        # rmtree, not unlink-then-rmdir: a hand-off the killed worker was still writing may land in between
        if self.handoff is not None:
            shutil.rmtree(self.handoff.dir, ignore_errors=True)
        shutil.rmtree(self.private, ignore_errors=True)
