"""Keeps one TritonProcess serving, and writes supervision events."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from kvforge.jsonlog import append_json_line
from launcher.tritonserver import ServerError, TritonProcess

WATCH_SECONDS = 0.1  # how often the supervisor looks at the server and its stubs
PROBE_SECONDS = 1.0  # how often it asks the server's health endpoint
PROBE_FAILURES = 3  # consecutive failed probes that count as a hung server
# A model reloaded or unloaded by the key holder replaces or ends its stub: a stub missing this
# long is checked against the models Triton has ready before it counts as dead.
STUB_GRACE_SECONDS = 0.5


def event(log_dir: Path | None, what: str, **fields) -> None:
    """A supervision event: one line on stderr, one JSON line in LOG_DIR/kvforge.jsonl."""
    print(f"[kvforge] {what}" + "".join(f" {k}={v}" for k, v in fields.items()), file=sys.stderr, flush=True)
    append_json_line(log_dir / "kvforge.jsonl" if log_dir else None, dict(event=what, **fields))


class Supervisor:
    """Keeps one TritonProcess serving: restarts it when it exits, when a backend stub dies
    (Triton neither restarts a stub nor ends the streams it held) or when its health probe keeps
    failing. `not_ready()` says why the service must not get traffic, or None."""

    def __init__(self, server: TritonProcess, ready_timeout: float, log_dir: Path | None):
        self.server, self.ready_timeout, self.log_dir = server, ready_timeout, log_dir
        self.restarts = {"server_exited": 0, "stub_died": 0, "server_hung": 0}
        self.state = "starting"
        self.draining = False
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvforge-supervisor", daemon=True)

    def not_ready(self) -> str | None:
        if self.draining:
            return "the server is shutting down"
        if self.state != "ready":
            return f"the server is {self.state}"
        return None

    def start(self) -> None:
        """Start the server in the supervisor's thread (see _die_with_parent); raise if it fails."""
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            self.server.start(self.ready_timeout)
        except BaseException as e:
            self._error = e
            self._started.set()
            return
        expected, missing = self.server.stubs(), {}
        self.state = "ready"
        event(self.log_dir, "ready", stubs=len(expected))
        self._started.set()
        failed_probes, next_probe = 0, time.monotonic() + PROBE_SECONDS
        while not self._stop.wait(WATCH_SECONDS):
            reason, alive = None, self.server.stubs()  # before poll(): a dead server also has no stubs
            now = time.monotonic()
            expected |= alive  # a model the key holder loaded is watched too
            missing = {name: missing.get(name, now) for name in expected - alive}
            if self.server.process.poll() is not None:
                reason, detail = "server_exited", f"exit code {self.server.process.returncode}"
            elif overdue := [name for name, since in missing.items() if now - since >= STUB_GRACE_SECONDS]:
                ready = self.server.ready_models()
                dead = [name for name in overdue if ready is None or name.rsplit("_", 2)[0] in ready]
                expected -= set(overdue) - set(dead)  # unloaded on purpose: no stub expected
                if dead:
                    reason, detail = "stub_died", f"stub(s) {sorted(dead)} gone"
            elif now >= next_probe:
                # live, not ready: a model the key holder is loading makes the server unready, not hung
                failed_probes = 0 if self.server.healthy(timeout=2.0, probe="live") else failed_probes + 1
                next_probe = time.monotonic() + PROBE_SECONDS
                if failed_probes >= PROBE_FAILURES:
                    reason, detail = "server_hung", f"{failed_probes} health probes failed"
            if reason is None or self._stop.is_set():
                continue
            self.state = "restarting"
            self.restarts[reason] += 1
            event(self.log_dir, "restart", reason=reason, detail=detail, count=self.restarts[reason])
            started = time.monotonic()
            # a kill, not a shutdown: open streams end at once and a broken stub cannot stall it
            self.server.stop(graceful=False)
            while not self._stop.is_set():
                try:
                    self.server.start(self.ready_timeout)
                    break
                except ServerError as e:
                    event(self.log_dir, "restart_failed", error=str(e).splitlines()[0])
                    self._stop.wait(1.0)
            expected, missing, failed_probes = self.server.stubs(), {}, 0
            if not self._stop.is_set():
                self.state = "ready"
                event(self.log_dir, "ready", stubs=len(expected), after_s=round(time.monotonic() - started, 2))

    def stop(self) -> None:
        self.state = "stopping"
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.server.stop()
        self.state = "stopped"
