"""The launcher as a child process (its own session), for tests and benchmarks. It dies with the
thread that started it (PR_SET_PDEATHSIG), so a killed test run leaves no server behind.

    with TritonServer(Path("model_repository"), http_port=8000) as server:
        ...  # server.http_url (the front), server.grpc_url, server.metrics_url, server.control_key
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kvforge import env
from kvforge.limits import DRAIN_SECONDS
from launcher.tritonserver import LOG_TAIL_LINES, READY_TIMEOUT, STOP_TIMEOUT, free_ports, http_ready, wait_ready

__all__ = ["TritonServer", "dying_with_parent", "free_ports"]

# Run as `python -S -c _DIE_WITH_PARENT PARENT_PID COMMAND...`: PR_SET_PDEATHSIG (1), then exec
# COMMAND (the setting survives exec). A wrapper rather than a preexec_fn: that would make
# subprocess fork the whole (big) test process instead of spawning, and fork can fail for memory.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
                    "if os.getppid() != int(sys.argv[1]):\n"
                    "    sys.exit('the starting process is gone')\n"
                    "os.execvp(sys.argv[2], sys.argv[2:])\n")


def dying_with_parent(command: list[str]) -> list[str]:
    """COMMAND, SIGKILLed when the thread that starts it goes away (a killed test run leaves
    nothing behind; only the thread that started it may own it)."""
    return [sys.executable, "-S", "-c", _DIE_WITH_PARENT, str(os.getpid()), *command]


class TritonServer:
    """The launcher as a child process (its own session), for tests and benchmarks: the URLs
    reach the front (http_url), Triton's gRPC and metrics; `control_key` opens the control APIs."""

    def __init__(self, repo: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, ready_timeout: float = READY_TIMEOUT, log_dir: Path | None = None,
                 extra_args: list[str] | None = None, control_key: str | None = None,
                 launcher_prefix: list[str] | None = None, openai_port: int | None = None,
                 environment: dict[str, str] | None = None):
        """environment: variables for the launcher beyond this process's (e.g. KVFORGE_TOKEN_TRACE)."""
        self.repo = Path(repo).resolve()
        self.environment = dict(environment or {})
        self.openai_port = openai_port
        self.host, self.ready_timeout = host, ready_timeout
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.extra_args = list(extra_args or [])
        self.launcher_prefix = list(launcher_prefix or [])  # e.g. a namespace wrapper that execs the rest
        self.control_key = control_key or secrets.token_urlsafe(24)
        self.log_dir = Path(log_dir) if log_dir else None
        self.process: subprocess.Popen | None = None
        self._tmp: Path | None = None

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str:
        return f"http://{self.host}:{self.openai_port}/v1"

    @property
    def launcher_log(self) -> Path:
        return self.log_dir / "launcher.log"

    def launcher_args(self) -> list[str]:
        """The launcher's command line, after `python -m launcher`."""
        return ["--repo", str(self.repo), "--host", self.host, "--http-port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), "--metrics-port", str(self.metrics_port),
                "--ready-timeout", str(self.ready_timeout), *(["--log-dir", str(self.log_dir)] if self.log_dir else []),
                *(["--openai-port", str(self.openai_port)] if self.openai_port else []), *self.extra_args]

    def start(self) -> "TritonServer":
        if self.log_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvforge-server-"))
            self.log_dir = self._tmp
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*self.launcher_prefix, sys.executable, "-m", "launcher", *self.launcher_args()]
        with open(self.launcher_log, "ab") as log:
            # SIGKILLed when the starting thread goes (its tritonserver follows: PDEATHSIG there too)
            self.process = subprocess.Popen(dying_with_parent(cmd), stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=Path(__file__).resolve().parents[1],
                                            env={**os.environ, **self.environment, env.CONTROL_KEY: self.control_key})
        try:
            self.wait_ready(self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def ready(self) -> bool:
        return http_ready(self.http_url, timeout=2.0)

    def wait_ready(self, timeout: float) -> None:
        wait_ready(self.process, self.ready, timeout, "the launcher", self.log_tail)

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        tails = []
        for path in (self.launcher_log, self.log_dir / "triton.log"):
            try:
                tails.append("\n".join(path.read_text(errors="replace").splitlines()[-lines:]))
            except OSError:
                pass
        return "\n".join(tails)

    def tritonserver_pid(self) -> int | None:
        """The supervised tritonserver's pid (the launcher's tritonserver child), if one runs."""
        try:
            children = Path(f"/proc/{self.process.pid}/task").glob("*/children")
            for pid in " ".join(p.read_text() for p in children).split():
                if Path(f"/proc/{pid}/comm").read_text().strip() == "tritonserver":
                    return int(pid)
        except OSError:
            pass
        return None

    def stop(self) -> None:
        """SIGTERM (the launcher drains and stops Triton), then SIGKILL its group if that takes too long."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                self.process.wait(STOP_TIMEOUT + DRAIN_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)  # tritonserver dies with it (PDEATHSIG)
                self.process.wait()
        self.process = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp, self.log_dir = None, None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


