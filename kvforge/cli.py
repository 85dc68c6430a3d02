"""What every kvforge command shares: progress lines and one-line errors instead of tracebacks."""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable

from kvforge.manifest import ManifestError


@contextlib.contextmanager
def progress(what: str):
    """Print what is happening and, when it is done, how long it took (on stderr)."""
    print(f"[kvforge] {what} ...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    yield
    print(f"[kvforge] {what}: done in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)


def fail_cleanly(main: Callable[[], int]) -> int:
    """Run a command; a user error (bad path, option, manifest, file) becomes one line and exit 2."""
    try:
        return main()
    except (ManifestError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
