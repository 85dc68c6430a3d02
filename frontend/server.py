"""The front process's servers: every app on its own port, all in one asyncio loop.

`apps()` lists what the front serves (the /v2 proxy, and the OpenAI-compatible API when it has
a port); each app is wrapped in the body limit and the in-flight count that a drain waits on:
they share the loop, the limit and the drain.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from frontend.body_limit import BodyLimit
from frontend.config import FrontConfig
from frontend.openai_api import create_openai_app
from frontend.proxy import create_proxy_app

GRACEFUL_CLOSE_SECONDS = 1.0  # after the drain, open connections get this long before they are cut


class InFlight:
    """Counts the HTTP requests being answered, across every app."""

    def __init__(self):
        self.active = 0

    def wrap(self, app: ASGIApp) -> ASGIApp:
        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                return await app(scope, receive, send)
            self.active += 1
            try:
                await app(scope, receive, send)
            finally:
                self.active -= 1
        return counted


class Server(uvicorn.Server):
    """A uvicorn server that leaves the signals to serve(): several run in one loop."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def apps(config: FrontConfig, supervisor, host: str, http_port: int, log_dir: Path,
         openai_port: int | None = None) -> list[tuple[ASGIApp, str, int]]:
    """(app, host, port) for every server the front runs."""
    served = [(create_proxy_app(config, supervisor.not_ready, log_dir / "kvforge.jsonl"), host, http_port)]
    if openai_port:
        served.append((create_openai_app(config), host, openai_port))
    return served


async def serve(config: FrontConfig, supervisor, host: str, http_port: int, log_dir: Path,
                drain_seconds: float, command: list[str], openai_port: int | None = None) -> int:
    """Serve until SIGINT/SIGTERM (then drain) or until COMMAND exits (its exit code)."""
    in_flight = InFlight()
    servers = [Server(uvicorn.Config(BodyLimit(in_flight.wrap(app), config.max_body_bytes), host=app_host,
                                     port=port, log_level="warning", access_log=False, lifespan="on",
                                     timeout_graceful_shutdown=GRACEFUL_CLOSE_SECONDS))
               for app, app_host, port in apps(config, supervisor, host, http_port, log_dir, openai_port)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(server.serve()) for server in servers]
    while not all(server.started for server in servers):
        if any(task.done() for task in tasks):
            raise RuntimeError("the front could not start a server (see the lines above)")
        await asyncio.sleep(0.02)
    waits = [asyncio.create_task(stop.wait())]
    if command:
        waits.append(asyncio.create_task(asyncio.to_thread(subprocess.call, command)))
    done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    code = next((t.result() for t in done if t is not waits[0]), 0)
    # readiness goes false first, so a load balancer stops sending while in-flight requests finish
    supervisor.draining = True
    deadline = time.monotonic() + drain_seconds
    while in_flight.active and time.monotonic() < deadline and not command:
        await asyncio.sleep(0.05)
    for server in servers:
        server.should_exit = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for wait in waits:
        wait.cancel()
    return code
