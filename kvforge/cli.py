"""What every kvforge command shares: progress lines and one-line errors instead of tracebacks."""
from __future__ import annotations

import contextlib
import ctypes
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


def free_large_buffers_at_once() -> None:
    """Serve every allocation of 1 MiB or more from its own mapping (glibc's M_MMAP_THRESHOLD), so
    that freeing a tensor returns its memory. By default glibc raises that threshold to 32 MiB
    after the first large free, and tensors below it then come from a heap that keeps what it
    freed: exporting a model tensor by tensor grew by ~40% of its weights (tests/test_big_models.py's
    12 layers of 16 MiB tensors) where it should stay flat. A no-op off glibc."""
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


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
