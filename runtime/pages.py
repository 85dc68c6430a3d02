"""Mapping memory before it is needed.

On this VM a page touched for the first time is slow (a fresh 1 GiB numpy array took 2.6 s to
fill, the same size again after freeing it 0.064 s; a 2K-token row moved into a new buffer took
~100 ms). KV memory that a step or a tier load writes into is therefore mapped ahead, off the
step path, as GPU engines allocate their KV cache at startup: MADV_POPULATE_WRITE faults the
pages in without touching their contents (0.3-1.2 s per GiB here), in a thread of its own (a
ctypes call releases the GIL).
"""
from __future__ import annotations

import ctypes
import mmap

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h
CHUNK_BYTES = 64 << 20

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(array: np.ndarray, begin: int = 0, end: int | None = None) -> bool:
    """Map the pages holding bytes begin..end of a C-contiguous array (rounded out: a page shared
    by two ranges mapped one after the other is in both; its contents are never changed). False
    where the kernel cannot (Linux < 5.14): pages then come at their first write, as without this."""
    end = array.nbytes if end is None else end
    page = mmap.PAGESIZE
    start = (array.ctypes.data + begin) // page * page
    stop = -(-(array.ctypes.data + end) // page) * page
    for chunk in range(start, stop, CHUNK_BYTES):
        if _libc.madvise(chunk, min(CHUNK_BYTES, stop - chunk), MADV_POPULATE_WRITE) != 0:
            return False
    return True
