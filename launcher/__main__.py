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
import os
import re
import sys
import tempfile
import urllib.parse
from pathlib import Path

import uvloop

from frontend.config import DEFAULT_MAX_BODY_BYTES, FrontConfig
from frontend.server import serve
from kvforge import env
from kvforge.cli import fail_cleanly
from kvforge.limits import DRAIN_SECONDS
from kvforge.net import CONTROL_KEY_HEADER, is_loopback, port_in_use
from launcher.keys import DEFAULT_KEY_FILE, control_key
from launcher.supervisor import Supervisor
from launcher.tritonserver import READY_TIMEOUT, ServerError, TritonProcess, free_ports, server_env
from runtime.disaggregation import THRESHOLD_TOKENS, TRANSPORTS
from runtime.runners.ort import DEFAULT_SPIN_US, MAX_SPIN_US
from runtime.scheduler import ITL_TARGET_DECODE_STEPS, check_itl_target, check_prefill_budget
from runtime.speculation import MAX_DRAFT_TOKENS, Speculation


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
    parser.add_argument("--drain-seconds", type=float, default=DRAIN_SECONDS,
                        help="on SIGTERM, how long in-flight requests may take to finish")
    parser.add_argument("--queue-timeout", type=float, default=None,
                        help="seconds a request may wait for a KV slot before it is refused (llm model)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may run in all before it is ended (llm model)")
    parser.add_argument("--itl-target-steps", type=float, default=None,
                        help="the engine step length that prompt tokens may fill beside decoding rows, in measured "
                        f"decode steps (default {ITL_TARGET_DECODE_STEPS:g}): larger favours time to first token, "
                        "smaller the other streams' inter-token latency")
    parser.add_argument("--itl-target-ms", type=float, default=None,
                        help="the same target in milliseconds, whatever a decode step takes")
    parser.add_argument("--prefill-budget", type=int, default=None,
                        help="instead of the target: a fixed number of prompt tokens per engine step beside every "
                        "decoding row")
    parser.add_argument("--scheduler", choices=env.SCHEDULERS, default=None,
                        help="stall-free (default): every step runs every decoding row plus prompt chunks up to "
                        "the budget; alternate: prompt-chunk steps take turns with decode steps")
    parser.add_argument("--disaggregate", action="store_true",
                        help="prefill long prompts in a prefill worker process beside the decode engine, the KV "
                        "handed over through the block store (docs/serving.md#disaggregated-prefill)")
    parser.add_argument("--prefill-threads", type=int, default=None, help="the prefill worker's threads")
    parser.add_argument("--decode-threads", type=int, default=None,
                        help="the engine's threads (default: $KVFORGE_THREADS, else every core)")
    parser.add_argument("--spin-us", type=int, default=None,
                        help=f"microseconds an idle ONNX Runtime thread spins for work before it sleeps (default "
                        f"{DEFAULT_SPIN_US}; spinning speeds decode on cores the engine has to itself and slows "
                        "clients sharing them: docs/serving.md#threads)")
    parser.add_argument("--pd-threshold", type=int, default=None,
                        help=f"uncached prompt tokens above which a prompt goes to the prefill worker "
                        f"(default {THRESHOLD_TOKENS})")
    parser.add_argument("--pd-transport", choices=TRANSPORTS, default=None,
                        help="shm: /dev/shm on this host (default); redis: through the Redis KV tier")
    parser.add_argument("--speculative", choices=env.SPECULATIVE_METHODS, default=None,
                        help="ngram: requests draft tokens from their own prompt and output and verify them in "
                        "one step (prompt lookup; the same greedy and seeded text); off (default): only requests "
                        "asking speculative=ngram do")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help=f"the most tokens a draft holds (default {MAX_DRAFT_TOKENS}; it adapts to acceptance)")
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


def check_config(args: argparse.Namespace) -> None:
    """Refuse a bad configuration with one line, before any server starts."""
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
    for flag, value in (("--kv-host-bytes", args.kv_host_bytes),):
        if value is not None and value < 0:
            raise ConfigError(f"{flag} must be >= 0, got {value}")
    for flag, value in (("--kv-disk-bytes", args.kv_disk_bytes), ("--kv-redis-ttl", args.kv_redis_ttl),
                        ("--ready-timeout", args.ready_timeout), ("--queue-timeout", args.queue_timeout),
                        ("--request-timeout", args.request_timeout), ("--max-body-bytes", args.max_body_bytes)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} must be > 0, got {value}")
    pd_flags = [flag for flag, value in (("--prefill-threads", args.prefill_threads), ("--pd-threshold",
                args.pd_threshold), ("--pd-transport", args.pd_transport)) if value is not None]
    if pd_flags and not args.disaggregate:
        raise ConfigError(f"{', '.join(pd_flags)} configure disaggregated serving: add --disaggregate")
    if args.disaggregate and args.prefix_cache == "off":
        raise ConfigError("--disaggregate hands prompts' KV over as prefix-cache hits: drop --prefix-cache off")
    for flag, value in (("--prefill-threads", args.prefill_threads), ("--decode-threads", args.decode_threads)):
        if value is not None and not 1 <= value <= 256:
            raise ConfigError(f"{flag} must be in 1..256, got {value}")
    if args.spin_us is not None and not 0 <= args.spin_us <= MAX_SPIN_US:
        raise ConfigError(f"--spin-us must be in 0..{MAX_SPIN_US}, got {args.spin_us}")
    if args.pd_threshold is not None and args.pd_threshold < 0:
        raise ConfigError(f"--pd-threshold must be >= 0, got {args.pd_threshold}")
    if args.prefill_budget is not None:
        try:
            check_prefill_budget(args.prefill_budget)
        except ValueError as e:
            raise ConfigError(f"--prefill-budget: {e}") from None
    targets = [flag for flag, value in (("--itl-target-ms", args.itl_target_ms),
                                        ("--itl-target-steps", args.itl_target_steps)) if value is not None]
    if targets and args.prefill_budget is not None:
        raise ConfigError(f"--prefill-budget fixes the prompt tokens per step and {targets[0]} derives them: give one")
    try:
        check_itl_target(None if args.itl_target_ms is None else args.itl_target_ms / 1000, args.itl_target_steps)
    except ValueError as e:
        raise ConfigError(f"{' / '.join(targets)}: {e}") from None
    if args.speculative_tokens is not None:
        if args.speculative != "ngram":
            raise ConfigError("--speculative-tokens sizes the drafts of --speculative ngram: add it")
        try:
            Speculation(max_draft_tokens=args.speculative_tokens).check()
        except ValueError as e:
            raise ConfigError(f"--speculative-tokens: {e}") from None
    if args.drain_seconds < 0:
        raise ConfigError(f"--drain-seconds must be >= 0, got {args.drain_seconds}")
    redis_url = args.kv_redis_url or os.environ.get(env.KV_REDIS_URL)
    if redis_url and (problem := redis_url_error(redis_url)):
        source = "--kv-redis-url" if args.kv_redis_url else f"${env.KV_REDIS_URL}"
        raise ConfigError(f"{source} {problem} (expected redis://[:PASSWORD@]HOST:PORT/DB or rediss://...)")
    if args.pd_transport == "redis" and not redis_url:
        raise ConfigError("--pd-transport redis hands KV over through the Redis KV tier: give --kv-redis-url")
    if (args.kv_disk_dir or redis_url) and args.prefix_cache == "off":
        raise ConfigError("the disk and Redis KV tiers sit below the prefix cache: drop --prefix-cache off")
    for flag, directory in (("--log-dir", args.log_dir), ("--kv-disk-dir", args.kv_disk_dir)):
        if directory is None:
            continue
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"{flag} {directory} cannot be created: {e.strerror}") from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {directory} is not writable")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    def run() -> int:
        try:
            check_config(args)
            key, key_source = control_key(args.control_key_file)
        except ServerError as e:
            raise ConfigError(str(e)) from None
        repo = args.repo.resolve()
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvforge-logs-"))
        model_env = env.model_environment(
            key, log_dir / "kvforge.jsonl", prefix_cache=args.prefix_cache == "on", kv_host_bytes=args.kv_host_bytes,
            kv_disk_dir=args.kv_disk_dir, kv_disk_bytes=args.kv_disk_bytes, kv_redis_url=args.kv_redis_url,
            kv_redis_ttl=args.kv_redis_ttl, queue_timeout=args.queue_timeout, request_timeout=args.request_timeout,
            prefill_budget=args.prefill_budget, itl_target_ms=args.itl_target_ms,
            itl_target_steps=args.itl_target_steps, scheduler=args.scheduler,
            disaggregate=args.disaggregate, prefill_threads=args.prefill_threads, pd_threshold=args.pd_threshold,
            pd_transport=args.pd_transport, speculative=args.speculative, speculative_tokens=args.speculative_tokens, spin_us=args.spin_us)
        if args.disaggregate:  # on 2 cores, 1 + 1: the workers take turns on no core
            cores = os.cpu_count() or 2
            prefill = args.prefill_threads or max(1, cores // 2)
            model_env[env.PREFILL_THREADS] = str(prefill)
            model_env[env.THREADS] = str(args.decode_threads or max(1, cores - prefill))
        elif args.decode_threads:
            model_env[env.THREADS] = str(args.decode_threads)
        own = (args.http_port, args.grpc_port, args.metrics_port, args.openai_port)
        triton = TritonProcess(repo, args.host, args.triton_http_port or free_ports(1, exclude=own)[0], args.grpc_port,
                               args.metrics_port, key, log_dir / "triton.log", server_env(model_env))
        supervisor = Supervisor(triton, args.ready_timeout, log_dir)
        config = FrontConfig(triton_http=f"127.0.0.1:{triton.http_port}", triton_grpc=f"127.0.0.1:{args.grpc_port}",
                             model_repository=repo, max_body_bytes=args.max_body_bytes or DEFAULT_MAX_BODY_BYTES,
                             api_key=os.environ.get(env.OPENAI_API_KEY) or None)
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


if __name__ == "__main__":
    sys.exit(main())
