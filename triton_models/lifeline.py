"""A python-backend stub exits once the tritonserver that started it is gone.

Triton runs each model instance in a stub process, its child. A server that dies without
unloading its models (SIGKILL, a crash, the launcher killed and the server with it) leaves its
stubs re-parented, and the stub's own check does not always end them: one was found alive an
hour after its server died (PPID 1, 748 MB, still holding its engine). Every kvforge model calls
`exit_with_server()` from initialize(); a daemon thread then compares the stub's parent with
the server and ends the process at once when they differ (os._exit: with the server gone there
is nobody to finalize for, and a finalize could wait on it forever).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

POLL_SECONDS = 1.0
# the python backend starts a stub as: stub model.py shm_region default_size growth_size server_pid ...
SHM_REGION_ARG, SERVER_PID_ARG = 2, 5
SHM_REGION_PREFIX = b"triton_python_backend_shm_region"
EXIT_CODE = 1


def server_pid() -> int:
    """The pid of the server that started this stub, as the python backend passes it, so that a
    server that died before initialize() counts as gone; the parent's pid when the arguments are
    not laid out as expected (another Triton version)."""
    args = Path("/proc/self/cmdline").read_bytes().split(b"\0")
    if len(args) > SERVER_PID_ARG and args[SHM_REGION_ARG].startswith(SHM_REGION_PREFIX) \
            and args[SERVER_PID_ARG].isdigit():
        return int(args[SERVER_PID_ARG])
    return os.getppid()


def exit_with_server(poll_seconds: float = POLL_SECONDS) -> None:
    server = server_pid()

    def watch() -> None:
        # a dead parent's children are re-parented at once, even while it is an unreaped zombie
        while os.getppid() == server:
            time.sleep(poll_seconds)
        print(f"kvforge: tritonserver (pid {server}) is gone; its model stub {os.getpid()} exits",
              file=sys.stderr, flush=True)
        os._exit(EXIT_CODE)

    threading.Thread(target=watch, name="kvforge-exit-with-server", daemon=True).start()
