"""The processes a test started, read from /proc: who they are (a pid with its start time, so a
reused pid is not mistaken for one that is gone), their descendants, and the llm model's stub."""
from __future__ import annotations

import re
from pathlib import Path


def process_start(pid: int) -> str | None:
    """The process's start time (with its pid, who it is), or None once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in "ZX" else fields[19]


def children(pid: int) -> list[int]:
    """The process's children (those of every thread), [] once it is gone."""
    found = []
    for listing in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found += [int(p) for p in listing.read_text().split()]
        except OSError:  # the thread ended meanwhile
            pass
    return found


def descendants(pid: int) -> dict[int, str]:
    """Every live process below pid (children, theirs, ...) -> its start time."""
    found, todo = {}, children(pid)
    while todo:
        p = todo.pop()
        started = process_start(p)
        if started is not None and p not in found:
            found[p] = started
            todo += children(p)
    return found


def is_llm_stub(pid: int) -> bool:
    """The `llm` model's python-backend stub: its command line names its instance, llm_<group>_<n>
    (not tensorrt_llm_bls_0_0 nor vllm_model_0_0)."""
    try:
        arguments = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(re.fullmatch(rb"llm_\d+_\d+", arg) for arg in arguments)
