"""The router's command, `python -m frontend.router` (frontend/router/__init__.py: what the router does).

The flags are checked and every replica verified (it answers as a kvforge launcher and serves
this repository's cache namespace) before the router serves; a setting or replica it refuses
is one line, exit code 2.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from pathlib import Path

import uvicorn
import uvloop

import frontend.router
from frontend.body_limit import BodyLimit
from frontend.config import DEFAULT_MAX_BODY_BYTES
from frontend.router.app import SESSION_HEADER, Router
from frontend.router.policies import POLICIES
from frontend.router.prompts import Prompts
from frontend.router.replicas import Replica, log
from kvforge import env
from kvforge.cli import fail_cleanly
from kvforge.limits import DRAIN_SECONDS
from kvforge.net import is_loopback, port_in_use
from runtime.scheduler import PREFILL_BUDGET

DEFAULT_PORT = 8080


class RouterError(ValueError):
    """A setting or replica the router refuses at start (one line, exit code 2)."""


def parse_replica(spec: str, number: int) -> Replica:
    urls = [u.strip().rstrip("/") for u in spec.split(",")]
    if len(urls) != 3 or not all(re.fullmatch(r"https?://[^/\s]+:\d+", u) for u in urls):
        raise RouterError(f"--replica {spec!r} must be three URLs: HTTP,OPENAI,METRICS "
                          "(e.g. http://127.0.0.1:8010,http://127.0.0.1:9010,http://127.0.0.1:8012)")
    return Replica(number, *urls)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m frontend.router",
                                     description=frontend.router.__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path("model_repository"),
                        help="the replicas' model repository: tokenizer, chat template, cache namespace")
    parser.add_argument("--replica", action="append", default=[], metavar="HTTP,OPENAI,METRICS",
                        help="a replica's front, OpenAI API and metrics URLs; once per replica")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    parser.add_argument("--balance-tokens", type=int, default=PREFILL_BUDGET,
                        help="prompt tokens of cache hit worth one more sequence on a replica "
                             "(default: %(default)s, one prefill chunk)")
    parser.add_argument("--policy", default="kv", help=f"how a replica is chosen: {', '.join(POLICIES)} "
                        f"(default: kv; affinity keys on the {SESSION_HEADER} header or the OpenAI API's user)")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if not args.replica:
        raise RouterError("give at least one --replica HTTP,OPENAI,METRICS")
    check_policy(args.policy)
    if not 0 < args.port < 65536:
        raise RouterError(f"--port must be a port in 1..65535, got {args.port}")
    if args.max_body_bytes <= 0 or args.balance_tokens < 0:
        raise RouterError("--max-body-bytes must be > 0 and --balance-tokens >= 0")
    if not os.environ.get(env.OPENAI_API_KEY) and not is_loopback(args.host):
        raise RouterError(f"the router on {args.host} would be open to anyone: set ${env.OPENAI_API_KEY} "
                          "(clients send it as a bearer token) or bind 127.0.0.1")
    if port_in_use(args.host, args.port):
        raise RouterError(f"port {args.port} on {args.host} (--port) is in use (another server?); choose another")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise RouterError(f"--policy must be one of {', '.join(POLICIES)}, got {policy!r}")


async def serve(args: argparse.Namespace) -> int:
    replicas = [parse_replica(spec, i) for i, spec in enumerate(args.replica, 1)]
    router = Router(Prompts(args.repo), replicas, args.balance_tokens, os.environ.get(env.OPENAI_API_KEY) or None,
                    args.policy)
    for problem in await asyncio.gather(*(router.health.verify(r) for r in replicas)):
        if problem:
            await router.client.aclose()
            raise RouterError(problem)
    server = uvicorn.Server(uvicorn.Config(BodyLimit(router.app(), args.max_body_bytes), host=args.host,
                                           port=args.port, log_level="warning", access_log=False, lifespan="on",
                                           timeout_graceful_shutdown=DRAIN_SECONDS))
    log(f"routing http://{args.host}:{args.port} (/v2 generate, /v1, /metrics; policy {args.policy}) over "
        + ", ".join(f"{r.number}={r.http}" for r in replicas))
    await server.serve()  # uvicorn's own SIGINT/SIGTERM handling: in-flight requests finish first
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> int:
        check_args(args)
        return uvloop.run(serve(args))

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
