"""Run the real `tritonserver` bundled in the nvidia-pytriton wheel, on CPU, without docker.

    with TritonServer(Path("model_repository"), http_port=8000) as server:
        ...  # server.grpc_url, server.http_url, server.metrics_url

    python -m runtime.triton_server --repo model_repository [--host H --http-port P ...] [-- COMMAND...]

Without COMMAND the server runs in the foreground until Ctrl-C; with it, COMMAND runs once the
server is ready, then the server stops and the exit code is COMMAND's.
"""
from __future__ import annotations

import argparse
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

from kvforge.cli import fail_cleanly

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 15.0
LOG_TAIL_LINES = 15


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
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the python backend has no stub for Python {version} ({stub} is missing)")
    python = into / "backends" / "python"
    python.mkdir(parents=True)
    for source in (root / "backends/python/libtriton_python.so",
                   root / "backends/python/triton_python_backend_utils.py", stub):
        (python / source.name).symlink_to(source)
    return into / "backends"


def server_env() -> dict[str, str]:
    """The stub's embedded interpreter finds this venv through `python3` on PATH (PYTHONPATH is not
    used for site-packages) and must load the same libpython."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"),
                                                          env.get("LD_LIBRARY_PATH")]))
    return env


def free_ports(count: int) -> list[int]:
    """Loopback ports free right now (all held at once, so they differ), for tests and benchmarks."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class TritonServer:
    def __init__(self, repo: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, ready_timeout: float = READY_TIMEOUT, log_path: Path | None = None):
        self.repo = Path(repo).resolve()
        self.host, self.ready_timeout = host, ready_timeout
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.requested_log = log_path
        self.log_path: Path | None = None
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

    def start(self) -> "TritonServer":
        if not self.repo.is_dir():
            raise ServerError(f"model repository {self.repo} does not exist "
                              "(`python -m engines repository ENGINE_DIR --repo DIR` writes it)")
        for port in (self.http_port, self.grpc_port, self.metrics_port):
            # a server already there would answer our readiness probe in this one's place
            if port_in_use(self.host, port):
                raise ServerError(f"port {port} on {self.host} is in use (another server?); choose other ports")
        root = bundled_server()
        self._tmp = Path(tempfile.mkdtemp(prefix="kvforge-triton-"))
        self.log_path = self.requested_log or self._tmp / "server.log"
        cmd = [str(root / "bin" / "tritonserver"), f"--model-repository={self.repo}",
               f"--backend-directory={backend_dir(root, self._tmp)}",
               f"--http-address={self.host}", f"--grpc-address={self.host}", f"--metrics-address={self.host}",
               f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}",
               f"--metrics-port={self.metrics_port}",
               "--model-control-mode=explicit", "--load-model=*", "--exit-timeout-secs=5"]
        with open(self.log_path, "ab") as log:
            # own session: stop() can signal the server and its backend stubs as one group
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env(),
                                            start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode} before it was "
                                  f"ready; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise ServerError(f"tritonserver was not ready within {self.ready_timeout:.0f} s at {url}; "
                          f"log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Triton's error lines (one per failure, naming the model and the Python traceback), then the tail."""
        try:
            log = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return f"(no server log at {self.log_path})"
        errors = [line for line in log[:-lines] if re.match(r"E\d{4} ", line)]
        return "\n".join(errors[-5:] + log[-lines:])

    def stop(self) -> None:
        """SIGINT (Triton unloads models and exits), then SIGKILL the group if that takes too long."""
        if self.process is not None and self.process.poll() is None:
            try:
                # the server alone: it finalizes its backend stubs itself
                self.process.send_signal(signal.SIGINT)
                self.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.process is not None:
            try:  # stubs left behind by a crashed server
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(prog="python -m runtime.triton_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT)
    parser.add_argument("--log", type=Path, help="server log file (default: a temporary file)")
    parser.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                        help="reuse the KV of repeated prompt prefixes (default: on)")
    parser.add_argument("--kv-host-bytes", type=int, help="byte budget of the host RAM KV block pool "
                        "(default: a quarter of RAM, at most 8 GiB)")
    parser.add_argument("--kv-disk-dir", type=Path, help="a local-disk KV tier below RAM in this directory "
                        "(a restarted server hits what it stored; default: off)")
    parser.add_argument("--kv-disk-bytes", type=int, help="byte budget of the disk tier (default: 8 GiB)")
    parser.add_argument("--kv-redis-url", help="a shared Redis KV tier, redis://[:PASSWORD@]HOST:PORT/DB or "
                        "rediss://... (default: off; $KVFORGE_KV_REDIS_URL keeps a password off the command line)")
    parser.add_argument("--kv-redis-ttl", type=int, help="seconds before a Redis KV entry expires (default: never; "
                        "Redis's maxmemory policy evicts)")
    args = parser.parse_args(own)
    # the llm model reads these in its own process (the server's environment is inherited), never
    # from its config: paths and passwords stay out of model metadata
    os.environ["KVFORGE_PREFIX_CACHE"] = "1" if args.prefix_cache == "on" else "0"
    for flag, value, env in (("--kv-host-bytes", args.kv_host_bytes, "KVFORGE_KV_HOST_BYTES"),
                             ("--kv-disk-bytes", args.kv_disk_bytes, "KVFORGE_KV_DISK_BYTES"),
                             ("--kv-redis-ttl", args.kv_redis_ttl, "KVFORGE_KV_REDIS_TTL")):
        if value is not None:
            if value < 0 or (value == 0 and flag != "--kv-host-bytes"):
                parser.error(f"{flag} must be {'>= 0' if flag == '--kv-host-bytes' else '> 0'}")
            os.environ[env] = str(value)
    if args.kv_disk_dir is not None:
        os.environ["KVFORGE_KV_DISK_DIR"] = str(args.kv_disk_dir.resolve())
    if args.kv_redis_url:
        if not args.kv_redis_url.startswith(("redis://", "rediss://")):
            parser.error("--kv-redis-url must start with redis:// or rediss://")
        os.environ["KVFORGE_KV_REDIS_URL"] = args.kv_redis_url
    # a plain `kill` (or docker stop) must stop the server too, not orphan it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def run() -> int:
        server = TritonServer(args.repo, args.host, args.http_port, args.grpc_port, args.metrics_port,
                              args.ready_timeout, args.log)
        try:
            with server:
                print(f"[kvforge] tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url}, "
                      f"metrics {server.metrics_url} (log: {server.log_path})", file=sys.stderr, flush=True)
                if command:
                    return subprocess.call(command)
                while server.process.poll() is None:
                    time.sleep(0.5)
                print(f"tritonserver exited with code {server.process.returncode}; log tail:\n"
                      f"{server.log_tail()}", file=sys.stderr)
                return 1
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
