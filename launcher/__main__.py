"""kvforge's launcher: the real `tritonserver` under a supervisor, behind the HTTP front, in one process.

    python -m launcher --repo model_repository [--host H --http-port P ...] [-- COMMAND...]

The front owns HOST:HTTP_PORT and proxies /v2 to Triton's HTTP on a private loopback port;
gRPC and metrics are Triton's own, on HOST. Triton's model-repository, logging, trace and
shared-memory APIs need the control key (header `kvforge-key`, over HTTP and gRPC): it comes
from $KVFORGE_CONTROL_KEY, else from a key file readable by its owner only (made once). The
supervisor restarts tritonserver when it exits or one of its python-backend stubs dies, and
holds readiness false meanwhile. SIGTERM drains: readiness false, in-flight requests get
--drain-seconds to finish, then everything stops. Without COMMAND the launcher runs until
SIGINT/SIGTERM; with it, COMMAND runs once the server is ready and its exit code is returned.
Every setting is checked before anything starts: a mistake is one line and exit code 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
import tempfile
import urllib.parse
from pathlib import Path

import uvloop

from frontend.config import DEFAULT_MAX_BODY_BYTES, FrontConfig
from frontend.server import serve
from kvforge import engine_config, env
from kvforge.engine_config import EngineConfig
from kvforge.cli import fail_cleanly
from kvforge.limits import DRAIN_SECONDS
from kvforge.net import CONTROL_KEY_HEADER, is_loopback, port_in_use
from launcher.keys import DEFAULT_KEY_FILE, control_key
from launcher.supervisor import Supervisor
from launcher.tritonserver import READY_TIMEOUT, ServerError, TritonProcess, free_ports, server_env
from runtime.kv.tiers.handoff import DEFAULT_ROOT as SHARED_MEMORY


# the query options a KV Redis URL may carry (value sets; empty: any value, e.g. a CA file's path)
TLS_OPTIONS = {"ssl_cert_reqs": ("none", "optional", "required"), "ssl_ca_certs": ()}


class ConfigError(ValueError):
    """A setting the launcher refuses before it starts anything."""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--http-port", type=int, default=8000, help="the front (proxying Triton's /v2 HTTP API)")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="the OpenAI-compatible API, served by the front too (default: off; make serve: 9000); "
                             f"beyond loopback it needs ${env.OPENAI_API_KEY}")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--triton-http-port", type=int, default=None,
                        help="Triton's own HTTP port, on 127.0.0.1 only (default: a free port)")
    parser.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT)
    parser.add_argument("--log-dir", type=Path, help="triton.log and kvforge.jsonl (access log and "
                        "supervision events) go here (default: a temporary directory)")
    parser.add_argument("--control-key-file", type=Path, default=DEFAULT_KEY_FILE,
                        help=f"used when ${env.CONTROL_KEY} is unset (default: %(default)s)")
    parser.add_argument("--max-body-bytes", type=int, default=None, help="largest request body the front accepts")
    parser.add_argument("--reasoning-parser", choices=("auto", "off"), default="auto",
                        help="the OpenAI API's chat answers: auto returns a thinking model's <think> block as "
                             "reasoning_content where the chat template writes <think>; off leaves it in content")
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                        help="on SIGTERM, how long in-flight requests may take to finish")
    engine_config.add_flags(parser, engine_config.LAUNCHER)  # every engine setting the llm model reads
    return parser.parse_args(argv)


def redis_url_error(url: str) -> str | None:
    """What is wrong with a KV Redis URL, or None. Never quotes the URL or a parser's message
    about it: either may hold the password."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return "must start with redis:// or rediss://"
    try:
        parts.port
    except ValueError:
        return "has a port that is not a number (an '@' missing after the password?)"
    if not parts.hostname:
        return "names no host"
    if not re.fullmatch(r"/?|/\d+", parts.path):
        return "must name its database as one whole number (/0), or none"
    for key, values in urllib.parse.parse_qs(parts.query, keep_blank_values=True).items():
        if key not in TLS_OPTIONS or any(v not in TLS_OPTIONS[key] for v in values) and TLS_OPTIONS[key]:
            return f"has the query option {key!r} with a value kvforge does not take (only {', '.join(TLS_OPTIONS)})"
    return None


def check_config(args: argparse.Namespace) -> EngineConfig:
    """Refuse a bad configuration with one line, before any server starts; the engine's settings
    as the llm model will read them."""
    ports = {"--http-port": args.http_port, "--grpc-port": args.grpc_port, "--metrics-port": args.metrics_port,
             "--openai-port": args.openai_port, "--triton-http-port": args.triton_http_port}
    ports = {flag: port for flag, port in ports.items() if port is not None}
    for flag, port in ports.items():
        if not 0 < port < 65536:
            raise ConfigError(f"{flag} must be a port in 1..65535, got {port}")
    by_port = {}
    for flag, port in ports.items():
        if port in by_port:
            raise ConfigError(f"{by_port[port]} and {flag} are both {port}; give each server its own port")
        by_port[port] = flag
    for flag, port in ports.items():
        host = "127.0.0.1" if flag == "--triton-http-port" else args.host
        if port_in_use(host, port):
            raise ConfigError(f"port {port} on {host} ({flag}) is in use (another server?); choose another")
    if not args.repo.is_dir():
        raise ConfigError(f"model repository {args.repo} does not exist "
                          "(`python -m engines repository ENGINE_DIR --repo DIR` writes it)")
    if args.openai_port and not os.environ.get(env.OPENAI_API_KEY) and not is_loopback(args.host):
        raise ConfigError(f"the OpenAI-compatible API on {args.host} would be open to anyone: set "
                          f"${env.OPENAI_API_KEY} (clients send it as a bearer token) or bind 127.0.0.1")
    for flag, value in (("--ready-timeout", args.ready_timeout), ("--max-body-bytes", args.max_body_bytes)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    if args.drain_seconds < 0:
        raise ConfigError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    config = engine_settings(args)
    for flag, directory in (("--log-dir", args.log_dir), ("--kv-disk-dir", config.kv_disk_dir)):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{flag} {directory} cannot be created: {e.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {directory} is not writable")
    return config


def engine_settings(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings the flags give (and the Redis URL $KVFORGE_KV_REDIS_URL), checked."""
    settings = engine_config.given(args, engine_config.LAUNCHER)
    redis_variable = engine_config.variable("kv_redis_url")
    if not args.kv_redis_url and os.environ.get(redis_variable):  # it reaches the model by environment
        settings["kv_redis_url"] = os.environ[redis_variable]
    if settings.get("kv_redis_url") and (problem := redis_url_error(settings["kv_redis_url"])):
        source = "--kv-redis-url" if args.kv_redis_url else f"${redis_variable}"
        raise ConfigError(f"{source} {problem} (expected redis://[:PASSWORD@]HOST:PORT/DB or rediss://...)")
    if args.kv_disk_dir:
        settings["kv_disk_dir"] = args.kv_disk_dir.resolve()
    try:
        config = engine_config.from_flags(settings)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if config.disaggregate:  # on 2 cores, 1 + 1: the workers take turns on no core
        cores = os.cpu_count() or 2
        prefill = config.prefill_threads or max(1, cores // 2)
        config = dataclasses.replace(config, prefill_threads=prefill, threads=config.threads or max(1, cores - prefill))
    return config


def model_environment(config: EngineConfig, control_key: str, access_log: Path) -> dict[str, str]:
    """The variables the llm model's process gets beyond the launcher's own environment."""
    return {env.CONTROL_KEY: control_key, env.ACCESS_LOG: str(access_log), **config.environment()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    def run() -> int:
        try:
            settings = check_config(args)
            key, key_source = control_key(args.control_key_file)
        except ServerError as e:
            raise ConfigError(str(e)) from None
        repo = args.repo.resolve()
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvforge-logs-"))
        run_folder = Path(tempfile.mkdtemp(prefix="kvforge-run-", dir=SHARED_MEMORY if SHARED_MEMORY.is_dir() else None))
        model_env = {**model_environment(settings, key, log_dir / "kvforge.jsonl"), env.RUN_FOLDER: str(run_folder)}
        own = (args.http_port, args.grpc_port, args.metrics_port, args.openai_port)
        triton = TritonProcess(repo, args.host, args.triton_http_port or free_ports(1, exclude=own)[0], args.grpc_port,
                               args.metrics_port, key, log_dir / "triton.log", server_env(model_env))
        supervisor = Supervisor(triton, args.ready_timeout, log_dir)
        config = FrontConfig(triton_http=f"127.0.0.1:{triton.http_port}", triton_grpc=f"127.0.0.1:{args.grpc_port}",
                             model_repository=repo, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                             api_key=os.environ.get(env.OPENAI_API_KEY) or None,
                             reasoning_parser=args.reasoning_parser == "auto")
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
            shutil.rmtree(run_folder, ignore_errors=True)

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
