"""N kvforge replicas on one host behind the KV-aware router, in the foreground.

    python -m launcher.fleet --replicas N [--repo model_repository] [--host H --router-port 8080]
                             [--policy kv|round-robin|affinity]
                             [--log-dir build/logs] [--prefix-cache on|off] [--kv-host-bytes TOTAL]
                             [--kv-disk-dir DIR --kv-disk-bytes TOTAL] [ENGINE FLAGS]

Replica i (1..N, N <= 7) is one launcher (`python -m launcher`, a child process) on 127.0.0.1 at
the default ports + 10*i: front 8000+10i, gRPC 8001+10i, metrics 8002+10i, OpenAI API 9000+10i,
so none reaches the router's 8080. Only the router binds --host. Every port is checked free
before anything starts. The host's resources are split, not multiplied: each replica gets
cores/N ONNX Runtime threads ($KVFORGE_THREADS), TOTAL/N of the KV RAM pool and of the disk
budget, and its own LOG_DIR/replica-i and KV_DISK_DIR/replica-i; $KVFORGE_KV_REDIS_URL (one Redis
they share) and the control key reach every replica by environment. The engine's other settings
(`--prefill-budget`, `--scheduler`, `--disaggregate`, `--speculative`, `--spin-us`, ...:
kvforge/engine_config.py; what `make fleet` passes as KV_FLAGS) and the launcher's other flags are
checked as the launcher checks them before anything starts, and given to every replica. Ctrl-C or
SIGTERM stops the router, then every replica (each drains first).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from frontend.router import __main__ as router
from kvforge import engine_config
from kvforge.cli import fail_cleanly
from kvforge.net import port_in_use
from launcher import __main__ as launcher_cli
from launcher.harness import TritonServer
from launcher.keys import DEFAULT_KEY_FILE, control_key
from launcher.tritonserver import ServerError
from runtime.kv.block_pool import default_kv_host_bytes

MAX_REPLICAS = 7  # replica 8 would put its front on 8080, the router's port
PORT_STEP = 10
HTTP, GRPC, METRICS, OPENAI = 8000, 8001, 8002, 9000  # `make serve`'s ports; replica i adds 10*i
THREADS = engine_config.variable("threads")  # each replica's share of the cores, unless the operator set it
# launcher flags the fleet sets per replica itself: one value for every replica would collide or split nothing
PER_REPLICA_FLAGS = ("--http-port", "--grpc-port", "--metrics-port", "--openai-port", "--triton-http-port",
                     "--control-key-file")
# the engine settings split among the replicas rather than given to each
SHARES = {"kv_host_bytes": "the host RAM KV pools' total, split evenly (default: a quarter of RAM, at most 8 GiB, "
                           "split evenly)",
          "kv_disk_dir": "replica i's disk KV tier in DIR/replica-i (default: off)",
          "kv_disk_bytes": "the disk tiers' total, split evenly (default: 8 GiB each)"}


class FleetError(ValueError):
    """A setting the fleet refuses before it starts anything."""


def replica_ports(i: int) -> dict[str, int]:
    step = PORT_STEP * i
    return dict(http_port=HTTP + step, grpc_port=GRPC + step, metrics_port=METRICS + step, openai_port=OPENAI + step)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m launcher.fleet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, required=True, help=f"how many replicas (1..{MAX_REPLICAS})")
    parser.add_argument("--repo", type=Path, default=Path("model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="the router's address (replicas stay on 127.0.0.1)")
    parser.add_argument("--router-port", type=int, default=router.DEFAULT_PORT)
    parser.add_argument("--policy", default="kv", help=f"the router's policy: {', '.join(router.POLICIES)} "
                        "(default: kv; docs/fleet.md)")
    parser.add_argument("--log-dir", type=Path, default=Path("build/logs"), help="replica i logs in DIR/replica-i")
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds each replica may take to start")
    # the engine's settings, given to every replica; these three are split among them instead
    engine_config.add_flags(parser, engine_config.LAUNCHER, helps=SHARES)
    args, args.launcher_flags = parser.parse_known_args(argv)  # the launcher's others: --drain-seconds, ...
    return args


def check(args: argparse.Namespace) -> None:
    if not 1 <= args.replicas <= MAX_REPLICAS:
        raise FleetError(f"--replicas must be in 1..{MAX_REPLICAS} (replica 8's front would be on 8080), "
                         f"got {args.replicas}")
    if not args.repo.is_dir():
        raise FleetError(f"model repository {args.repo} does not exist")
    router.check_policy(args.policy)  # before any replica starts, not once they all have
    ports = [("the router", args.host, args.router_port)] + [
        (f"replica {i} ({flag})", "127.0.0.1", port)
        for i in range(1, args.replicas + 1) for flag, port in replica_ports(i).items()]
    for who, host, port in ports:
        if port_in_use(host, port):
            raise FleetError(f"port {port} on {host} ({who}) is in use (another server?); stop it first")
    for flag in ("kv_host_bytes", "kv_disk_bytes"):
        if getattr(args, flag) is not None and getattr(args, flag) < args.replicas:
            raise FleetError(f"--{flag.replace('_', '-')} must be at least --replicas bytes")
    for flag in args.launcher_flags:
        if flag.split("=")[0] in PER_REPLICA_FLAGS:
            raise FleetError(f"{flag.split('=')[0]} is set per replica by the fleet (the default ports + 10*i)")


def check_replica(replica: TritonServer) -> None:
    """A replica's command line, checked as its launcher will check it, before any replica starts."""
    try:
        launcher_cli.check_config(launcher_cli.parse_args(replica.launcher_args()))
    except launcher_cli.ConfigError as e:
        raise FleetError(str(e)) from None


def launcher_flags(args: argparse.Namespace, i: int) -> list[str]:
    """Replica i's launcher flags: the engine settings given, with its share of the KV pool's and
    the disk tier's bytes and its own disk directory, then the launcher's other flags."""
    settings = engine_config.given(args, engine_config.LAUNCHER)
    settings["kv_host_bytes"] = (args.kv_host_bytes or default_kv_host_bytes()) // args.replicas
    if args.kv_disk_dir:
        settings["kv_disk_dir"] = args.kv_disk_dir / f"replica-{i}"
    if args.kv_disk_bytes:
        settings["kv_disk_bytes"] = args.kv_disk_bytes // args.replicas
    return engine_config.flags_of(settings) + args.launcher_flags


def make_replicas(args: argparse.Namespace, control_key: str) -> list[TritonServer]:
    """The replicas' launchers, not started."""
    return [TritonServer(args.repo, **replica_ports(i), log_dir=args.log_dir / f"replica-{i}",
                         ready_timeout=args.ready_timeout, extra_args=launcher_flags(args, i), control_key=control_key)
            for i in range(1, args.replicas + 1)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def run() -> int:
        check(args)
        key, _ = control_key(DEFAULT_KEY_FILE)  # one key for every replica: clear_prefix_cache fans out with it
        # the children inherit it; a threads count the operator set is theirs to keep
        os.environ.setdefault(THREADS, str(max(1, (os.cpu_count() or 1) // args.replicas)))
        replicas = make_replicas(args, key)
        check_replica(replicas[0])  # the engine flags are every replica's; the ports were checked free above
        serving = False
        # SIGTERM while the replicas start: stop what was started, exit 143 (interrupted). Once the router
        # serves, it drains on SIGTERM and then raises the signal again: a requested stop, exit 0 as a launcher does
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0 if serving else 128 + signal.SIGTERM))
        try:
            for i, replica in enumerate(replicas, 1):
                print(f"[fleet] starting replica {i}/{args.replicas} on port {replica.http_port} "
                      f"({os.environ[THREADS]} threads; logs in {replica.log_dir})", file=sys.stderr, flush=True)
                replica.start()
            serving = True
            return router.main(["--repo", str(args.repo), "--host", args.host, "--port", str(args.router_port),
                                "--policy", args.policy,
                                *[arg for r in replicas for arg in ("--replica", ",".join(
                                    (f"http://{r.http_url}", f"http://{r.host}:{r.openai_port}",
                                     f"http://{r.host}:{r.metrics_port}")))]])
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping now; a second SIGTERM must not cut it short
            with ThreadPoolExecutor(len(replicas)) as pool:
                list(pool.map(TritonServer.stop, replicas))

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
