"""What every kvforge command shares: progress lines and one-line errors instead of tracebacks."""
from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

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


@contextlib.contextmanager
def atomic_directory(out: Path) -> Iterator[Path]:
    """Yield a temporary sibling of `out` to fill; it replaces `out` only if the block succeeds,
    so a failure never leaves a half-written export or engine behind."""
    out = Path(out)
    parent = out.resolve().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=parent))
    except OSError as e:
        raise ManifestError(f"cannot write the output directory {out}: {e.strerror}") from None
    try:
        tmp.chmod(0o755)
        yield tmp
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
