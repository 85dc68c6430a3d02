"""The real `tritonserver` (bundled in the nvidia-pytriton wheel, CPU, no docker) as one process.

HTTP is on a private loopback port (the front owns the public one); gRPC and metrics are
Triton's own, on the host. Triton's model-repository, logging, trace and shared-memory APIs need
the control key (header `kvforge-key`, over HTTP and gRPC).
"""
from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from kvforge.net import CONTROL_KEY_HEADER, port_in_use

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 15.0
LOG_TAIL_LINES = 15
# Triton APIs only the key holder may use; health, metadata, model config, statistics and
# inference stay open. Loading a model runs its code, so model-repository must stay closed.
RESTRICTED_APIS = "model-repository,logging,trace,shared-memory"
STUB_NAME = "triton_python_backend_stub"
STUB_INSTANCE_ARG = 8  # the python backend starts a stub as: stub model.py shm ... instance_name ...


class ServerError(RuntimeError):
    """The server could not start or did not become ready; the message carries its log tail."""


def bundled_server() -> Path:
    """<site-packages>/pytriton/tritonserver: bin/tritonserver, the python backend and its stubs."""
    try:
        import pytriton
    except ImportError:
        raise ServerError("nvidia-pytriton is not installed; it carries the tritonserver binary "
                          "(`make setup` installs it)") from None
    root = Path(pytriton.__file__).parent / "tritonserver"
    if not (root / "bin" / "tritonserver").is_file():
        raise ServerError(f"{root}/bin/tritonserver is missing; reinstall nvidia-pytriton")
    return root


def backend_dir(root: Path, into: Path) -> Path:
    """A private backends/python holding the backend and the stub for this Python: the wheel
    keeps its stubs apart, and the backend refuses to load without one beside it."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise ServerError(f"the python backend has no stub for Python {version} ({stub} is missing)")
    python = into / "backends" / "python"
    python.mkdir(parents=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into / "backends"


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The stub's embedded interpreter finds this venv through `python3` on PATH (PYTHONPATH is not
    used for site-packages) and must load the same libpython."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                          env.get("LD_LIBRARY_PATH")]))
    env.update(extra or {})
    return env


def free_ports(count: int, exclude=()) -> list[int]:
    """Loopback ports free right now (all held at once, so they differ), none of `exclude`: ports
    already chosen but not bound yet (a launcher's own, which the kernel may hand out again)."""
    while True:
        sockets = [socket.socket() for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        ports = [s.getsockname()[1] for s in sockets]
        for s in sockets:
            s.close()
        if not set(ports) & set(exclude):
            return ports


def http_ready(address: str, timeout: float, probe: str = "ready") -> bool:
    """Whether /v2/health/<probe> answers 200 ("live": the server works; "ready": and every model is)."""
    try:
        with urllib.request.urlopen(f"http://{address}/v2/health/{probe}", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(process: subprocess.Popen, ready: Callable[[], bool], timeout: float, what: str,
               log_tail: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"{what} exited with code {process.returncode} before it was ready; "
                              f"log tail:\n{log_tail()}")
        if ready():
            return
        time.sleep(0.1)
    raise ServerError(f"{what} was not ready within {timeout:.0f} s; log tail:\n{log_tail()}")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the thread that started it goes away, so a
    killed launcher never leaves a server running (the supervisor thread starts every server)."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class TritonProcess:
    """One tritonserver process: HTTP on a private loopback port, gRPC and metrics on host."""

    def __init__(self, repo: Path, host: str, http_port: int, grpc_port: int, metrics_port: int,
                 key: str, log_path: Path, env: dict[str, str]):
        self.repo, self.host, self.key, self.log_path, self.env = repo, host, key, log_path, env
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.process: subprocess.Popen | None = None
        self._tmp: Path | None = None

    def command(self, backends: Path) -> list[str]:
        restricted = f"{RESTRICTED_APIS}:{CONTROL_KEY_HEADER}={self.key}"
        return [str(bundled_server() / "bin" / "tritonserver"), f"--model-repository={self.repo}",
                f"--backend-directory={backends}",
                "--http-address=127.0.0.1", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
                f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}",
                f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
                "--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=5"]

    def start(self, ready_timeout: float) -> None:
        for port in (self.grpc_port, self.metrics_port):
            if port_in_use(self.host, port):
                raise ServerError(f"port {port} on {self.host} is in use (another server?); choose other ports")
        self._tmp = Path(tempfile.mkdtemp(prefix="kvforge-triton-"))
        cmd = self.command(backend_dir(bundled_server(), self._tmp))
        with open(self.log_path, "ab") as log:
            # own session: the supervisor can signal the server and its backend stubs as one group
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def healthy(self, timeout: float = 1.0, probe: str = "ready") -> bool:
        return http_ready(f"127.0.0.1:{self.http_port}", timeout, probe)

    def _wait_ready(self, ready_timeout: float) -> None:
        wait_ready(self.process, self.healthy, ready_timeout, "tritonserver", self.log_tail)

    def stubs(self) -> set[str]:
        """Instance names (e.g. llm_0_0) of the server's live python-backend stubs (its children;
        zombies are dead). The stub's command line carries its instance name."""
        names = set()
        try:
            children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children").read_text().split()
        except OSError:
            return names
        for pid in children:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            name, state = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2]
            if STUB_NAME.startswith(name) and state not in "ZX" and len(args) > STUB_INSTANCE_ARG:
                names.add(args[STUB_INSTANCE_ARG].decode(errors="replace"))
        return names

    def ready_models(self) -> set[str] | None:
        """Models the server has READY (the repository index needs the key); None if it does not answer."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}/v2/repository/index", data=b"{}",
                                         headers={CONTROL_KEY_HEADER: self.key}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=2.0) as response:
                return {m["name"] for m in json.loads(response.read()) if m.get("state") == "READY"}
        except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
            return None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Triton's error lines (one per failure, naming the model and the Python traceback), then the tail."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no server log at {self.log_path})"
        errors = [line for line in log[:-lines] if re.match(r"E\d{4} ", line)]
        return "\n".join(errors[-5:] + log[-lines:])

    def stop(self, graceful: bool = True) -> None:
        """SIGINT (Triton unloads models and exits), then SIGKILL the group if that takes too long."""
        if self.process is not None and self.process.poll() is None and graceful:
            try:
                self.process.send_signal(signal.SIGINT)  # the server alone: it finalizes its stubs itself
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            try:  # what is left: a server that did not stop, stubs of a crashed one
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None
