"""What every kvforge server shares about its sockets: the loopback rule for anonymous access,
the bind check before a server starts, and the header that carries the control key."""
from __future__ import annotations

import socket

CONTROL_KEY_HEADER = "kvforge-key"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False
