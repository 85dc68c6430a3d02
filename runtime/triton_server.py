"""kvforge's launcher: the real `tritonserver` (bundled in the nvidia-pytriton wheel, CPU, no
docker) under a supervisor, behind the HTTP front (frontend/), in one process.

    python -m runtime.triton_server --repo model_repository [--host H --http-port P ...] [-- COMMAND...]

    with TritonServer(Path("model_repository"), http_port=8000) as server:  # the launcher as a child
        ...  # server.http_url (the front), server.grpc_url, server.metrics_url, server.control_key

The front owns HOST:HTTP_PORT and proxies /v2 to Triton's HTTP on a private loopback port;
gRPC and metrics are Triton's own, on HOST. Triton's model-repository, logging, trace and
shared-memory APIs need the control key (header `kvforge-key`, over HTTP and gRPC): it comes
from $KVFORGE_CONTROL_KEY, else from a key file readable by its owner only (made once). The
supervisor restarts tritonserver when it exits or one of its python-backend stubs dies, and
holds readiness false meanwhile. SIGTERM drains: readiness false, in-flight requests get
--drain-seconds to finish, then everything stops. Without COMMAND the launcher runs until
SIGINT/SIGTERM; with it, COMMAND runs once the server is ready and its exit code is returned.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from kvforge.cli import fail_cleanly

READY_TIMEOUT = 120.0
STOP_TIMEOUT = 15.0
LOG_TAIL_LINES = 15
WATCH_SECONDS = 0.1  # how often the supervisor looks at the server and its stubs
PROBE_SECONDS = 1.0  # how often it asks the server's health endpoint
PROBE_FAILURES = 3  # consecutive failed probes that count as a hung server
DRAIN_SECONDS = 30.0
# Triton APIs only the key holder may use; health, metadata, model config, statistics and
# inference stay open. Loading a model runs its code, so model-repository must stay closed.
RESTRICTED_APIS = "model-repository,logging,trace,shared-memory"
CONTROL_KEY_HEADER = "kvforge-key"
CONTROL_KEY_ENV = "KVFORGE_CONTROL_KEY"
OPENAI_KEY_ENV = "KVFORGE_OPENAI_API_KEY"  # the bearer key the OpenAI-compatible API then requires
DEFAULT_KEY_FILE = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "kvforge" / "control.key"
STUB_NAME = "triton_python_backend_stub"
STUB_INSTANCE_ARG = 8  # the python backend starts a stub as: stub model.py shm ... instance_name ...
# A model reloaded or unloaded by the key holder replaces or ends its stub: a stub missing this
# long is checked against the models Triton has ready before it counts as dead.
STUB_GRACE_SECONDS = 0.5


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


def control_key(key_file: Path = DEFAULT_KEY_FILE) -> tuple[str, str]:
    """(key, where it came from): $KVFORGE_CONTROL_KEY, else key_file, created 0600 on first use."""
    if os.environ.get(CONTROL_KEY_ENV):
        return os.environ[CONTROL_KEY_ENV], f"${CONTROL_KEY_ENV}"
    key_file = Path(key_file)
    if not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    if key_file.stat().st_mode & 0o077:
        raise ServerError(f"the control key file {key_file} is readable by others; chmod 600 it")
    key = key_file.read_text().strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", key):
        raise ServerError(f"the control key in {key_file} must be 16+ characters of A-Z a-z 0-9 _ -")
    return key, str(key_file)


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


def event(log_dir: Path | None, what: str, **fields) -> None:
    """A supervision event: one line on stderr, one JSON line in LOG_DIR/kvforge.jsonl."""
    print(f"[kvforge] {what}" + "".join(f" {k}={v}" for k, v in fields.items()), file=sys.stderr, flush=True)
    append_json_line(log_dir / "kvforge.jsonl" if log_dir else None, dict(event=what, **fields))


def append_json_line(path: Path | None, record: dict) -> bool:
    """Append one JSON line; False (never an exception) when the disk is full or the file gone."""
    if path is None:
        return False
    line = json.dumps(dict(time=round(time.time(), 3), **record)) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
        return True
    except OSError:
        return False


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


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime.triton_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000, help="the front (proxying Triton's /v2 HTTP API)")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="the OpenAI-compatible API, served by the front too (default: off; make serve: 9000); "
                             f"beyond loopback it needs ${OPENAI_KEY_ENV}")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--triton-http-port", type=int, default=None,
                        help="Triton's own HTTP port, on 127.0.0.1 only (default: a free port)")
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT)
    parser.add_argument("--log-dir", type=Path, help="triton.log and kvforge.jsonl (access log and "
                        "supervision events) go here (default: a temporary directory)")
    parser.add_argument("--control-key-file", type=Path, default=DEFAULT_KEY_FILE,
                        help=f"used when ${CONTROL_KEY_ENV} is unset (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="largest request body the front accepts")
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                        help="on SIGTERM, how long in-flight requests may take to finish")
    parser.add_argument("--queue-timeout", type=float, default=None,
                        help="seconds a request may wait for a KV slot before it is refused (llm model)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run in all before it is ended (llm model)")
    parser.add_argument("--prefix-cache", choices=("on", "off"), default="on",
                        help="reuse the KV of repeated prompt prefixes (llm model; default: on)")
    parser.add_argument("--kv-host-bytes", type=int, default=None,
                        help="byte budget of the host RAM KV block pool (default: a quarter of RAM, at most 8 GiB)")
    parser.add_argument("--kv-disk-dir", type=Path, help="a local-disk KV tier below RAM in this directory "
                        "(a restarted server hits what it stored; default: off)")
    parser.add_argument("--kv-disk-bytes", type=int, help="byte budget of the disk tier (default: 8 GiB)")
    parser.add_argument("--kv-redis-url", help="a shared Redis KV tier, redis://[:PASSWORD@]HOST:PORT/DB or "
                        "rediss://... (default: off; $KVFORGE_KV_REDIS_URL keeps a password off the command line)")
    parser.add_argument("--kv-redis-ttl", type=int, help="seconds before a Redis KV entry expires (default: never; "
                        "Redis's maxmemory policy evicts)")
    args = parser.parse_args(argv)
    if args.kv_host_bytes is not None and args.kv_host_bytes < 0:
        parser.error("--kv-host-bytes must be >= 0")
    for flag, value in (("--kv-disk-bytes", args.kv_disk_bytes), ("--kv-redis-ttl", args.kv_redis_ttl)):
        if value is not None and value <= 0:
            parser.error(f"{flag} must be > 0")
    if args.kv_redis_url and not args.kv_redis_url.startswith(("redis://", "rediss://")):
        parser.error("--kv-redis-url must start with redis:// or rediss://")
    return args


def tier_env(args: argparse.Namespace) -> dict[str, str]:
    """The KV tiers' knobs for the llm model's process: by environment, never its config, so paths
    and passwords stay out of model metadata (KVFORGE_KV_REDIS_URL already set is kept)."""
    env = {"KVFORGE_KV_DISK_DIR": args.kv_disk_dir and str(args.kv_disk_dir.resolve()),
           "KVFORGE_KV_DISK_BYTES": args.kv_disk_bytes and str(args.kv_disk_bytes),
           "KVFORGE_KV_REDIS_URL": args.kv_redis_url, "KVFORGE_KV_REDIS_TTL": args.kv_redis_ttl and str(args.kv_redis_ttl)}
    return {name: value for name, value in env.items() if value}


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from frontend.config import DEFAULT_MAX_BODY_BYTES, FrontConfig
    from frontend.server import serve

    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    def run() -> int:
        repo = args.repo.resolve()
        if not repo.is_dir():
            raise ServerError(f"model repository {repo} does not exist "
                              "(`python -m engines repository ENGINE_DIR --repo DIR` writes it)")
        for port in filter(None, (args.http_port, args.openai_port)):
            if port_in_use(args.host, port):
                raise ServerError(f"port {port} on {args.host} is in use (another server?); choose another")
        api_key = os.environ.get(OPENAI_KEY_ENV) or None
        if args.openai_port and not api_key and not is_loopback(args.host):
            raise ServerError(f"the OpenAI-compatible API on {args.host} would be open to anyone: set ${OPENAI_KEY_ENV} "
                              "(clients send it as a bearer token) or bind 127.0.0.1")
        key, key_source = control_key(args.control_key_file)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvforge-logs-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        model_env = {CONTROL_KEY_ENV: key, "KVFORGE_ACCESS_LOG": str(log_dir / "kvforge.jsonl")}
        model_env["KVFORGE_PREFIX_CACHE"] = "1" if args.prefix_cache == "on" else "0"
        model_env.update(tier_env(args))
        for name, value in (("KVFORGE_QUEUE_TIMEOUT", args.queue_timeout),
                            ("KVFORGE_REQUEST_TIMEOUT", args.request_timeout),
                            ("KVFORGE_KV_HOST_BYTES", args.kv_host_bytes)):
            if value is not None:
                model_env[name] = str(value)
        triton = TritonProcess(repo, args.host, args.triton_http_port or free_ports(1)[0], args.grpc_port, args.metrics_port,
                               key, log_dir / "triton.log", server_env(model_env))
        supervisor = Supervisor(triton, args.ready_timeout, log_dir)
        config = FrontConfig(triton_http=f"127.0.0.1:{triton.http_port}", triton_grpc=f"127.0.0.1:{args.grpc_port}",
                             model_repository=repo, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                             api_key=api_key)
        try:
            supervisor.start()
            print(f"[kvforge] serving: HTTP {args.host}:{args.http_port} (front), gRPC {args.host}:{args.grpc_port}, "
                  f"metrics http://{args.host}:{args.metrics_port}/metrics"
                  + (f", OpenAI API http://{args.host}:{args.openai_port}/v1" if args.openai_port else "")
                  + f"; control key from {key_source} "
                  f"(header {CONTROL_KEY_HEADER}); logs in {log_dir}", file=sys.stderr, flush=True)
            return uvloop.run(serve(config, supervisor, args.host, args.http_port, log_dir,
                                    args.drain_seconds, command, args.openai_port))
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            supervisor.stop()

    return fail_cleanly(run)


class TritonServer:
    """The launcher as a child process (its own session), for tests and benchmarks: the URLs
    reach the front (http_url), Triton's gRPC and metrics; `control_key` opens the control APIs."""

    def __init__(self, repo: Path, host: str = "127.0.0.1", http_port: int = 8000, grpc_port: int = 8001,
                 metrics_port: int = 8002, ready_timeout: float = READY_TIMEOUT, log_dir: Path | None = None,
                 extra_args: list[str] | None = None, control_key: str | None = None,
                 launcher_prefix: list[str] | None = None, openai_port: int | None = None):
        self.repo = Path(repo).resolve()
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

    def start(self) -> "TritonServer":
        if self.log_dir is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="kvforge-server-"))
            self.log_dir = self._tmp
        self.log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*self.launcher_prefix, sys.executable, "-m", "runtime.triton_server", "--repo", str(self.repo), "--host", self.host,
               "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
               "--metrics-port", str(self.metrics_port), "--ready-timeout", str(self.ready_timeout),
               "--log-dir", str(self.log_dir),
               *(["--openai-port", str(self.openai_port)] if self.openai_port else []), *self.extra_args]
        with open(self.launcher_log, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                            cwd=Path(__file__).resolve().parents[1],
                                            env={**os.environ, CONTROL_KEY_ENV: self.control_key})
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


if __name__ == "__main__":
    sys.exit(main())
