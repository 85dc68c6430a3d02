"""The local-disk tier: a restarted server hits what it stored.

Measured (`/tmp` on this machine's virtio disk, 256 blocks, read + checksum): a small-llama
block (1 MiB) reads at 0.84 GB/s one per file vs 0.78 GB/s sixteen per file, and a tiny-llama
block (16 KiB) costs 0.03 vs 0.02 ms: chunks buy nothing worth losing exact partial hits and
per-block LRU, so a file is a block. A bad file is removed and counted; a full or unwritable
disk switches the tier off with one warning.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from runtime.kv.tiers.base import Into, Tier, TierStats
from runtime.kv.tiers.codec import Arrays, BlockCodec, CorruptEntry

log = logging.getLogger("kvforge.tiers")

SUFFIX = ".kvb"
DISK_OFF_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


class DiskTier(Tier):
    """Files DIR/<namespace>/<hash>.kvb within a byte budget, least recently used evicted first.
    The index is rebuilt from the directory at start, so a restarted server hits what it stored."""

    name = "disk"
    keeps_evictions = True

    def __init__(self, root: Path, budget_bytes: int, codec: BlockCodec):
        self.codec, self.budget_bytes = codec, budget_bytes
        self.stats = TierStats(self.name)
        self.dir = Path(root) / codec.namespace.hex()[:32]
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes; least recently used first
        self.bytes_used = 0
        self.enabled = True
        self.lock = threading.Lock()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._rebuild()
        except OSError as e:
            self._switch_off(e)

    def _rebuild(self) -> None:
        entries = []
        for path in self.dir.iterdir():
            if path.suffix != SUFFIX:  # a temporary file left by a crash mid-write
                path.unlink(missing_ok=True)
                continue
            try:
                block_hash = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            entries.append((st.st_mtime, block_hash, st.st_size))
        for _, block_hash, size in sorted(entries):
            self.index[block_hash] = size
            self.bytes_used += size
        self._evict(0)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _switch_off(self, e: OSError) -> None:
        if self.enabled:  # the file name stays out of the message: paths are the operator's business
            log.warning("the disk KV tier is off from now on: %s (serving continues without it)",
                        e.strerror or type(e).__name__)
        self.enabled = False
        self.stats.count("errors")

    def contains(self, block_hash: bytes) -> bool:
        return block_hash in self.index

    def present(self, hashes: list[bytes]) -> int:
        """How many of hashes[0..] are stored, as a run."""
        with self.lock:
            return next((i for i, h in enumerate(hashes) if h not in self.index), len(hashes))

    def get_many(self, hashes: list[bytes], tags: list[bytes] | None = None, into: Into | None = None) -> list[Arrays]:
        """The leading run (hashes: what present() found); a bad file ends it (a chain does not
        continue past a hole)."""
        found = []
        for block_hash, block in zip(hashes, (into or self.codec.blanks)(len(hashes))):
            if not self._get(block_hash, block):
                break
            found.append(block)
        return found

    def _get(self, block_hash: bytes, block: Arrays) -> bool:
        with self.lock:
            if not self.enabled or block_hash not in self.index:
                self.stats.count("miss_blocks")
                return False
            self.index.move_to_end(block_hash)
        path = self._path(block_hash)
        began = time.perf_counter()
        try:
            self.codec.read_into(path, block_hash, block)
        except (OSError, CorruptEntry) as e:
            self._forget(block_hash, corrupt=isinstance(e, CorruptEntry))
            return False
        self.stats.measured(time.perf_counter() - began, self.codec.entry_bytes)
        self.stats.count("hit_blocks")
        self.stats.count("read_bytes", self.codec.entry_bytes)
        try:
            os.utime(path)  # recency survives a restart
        except OSError:
            pass
        return True

    def _forget(self, block_hash: bytes, corrupt: bool) -> None:
        with self.lock:
            self.bytes_used -= self.index.pop(block_hash, 0)
        self._path(block_hash).unlink(missing_ok=True)
        self.stats.count("miss_blocks")
        self.stats.count("corrupt_blocks" if corrupt else "errors")

    def put_many(self, entries: list[tuple[bytes, bytes]], tags: list[bytes] | None = None) -> int:
        return sum(self._put(block_hash, raw) for block_hash, raw in entries)

    def _put(self, block_hash: bytes, raw: bytes) -> bool:
        with self.lock:
            if block_hash in self.index:
                return True
            if not self.enabled or len(raw) > self.budget_bytes:
                return False
            self._evict(len(raw))
        path = self._path(block_hash)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(raw)
            os.replace(tmp, path)  # atomic: a reader sees the whole file or none
        except OSError as e:
            tmp.unlink(missing_ok=True)
            if e.errno in DISK_OFF_ERRNOS:
                self._switch_off(e)
            else:
                self.stats.count("errors")
            return False
        with self.lock:
            if block_hash not in self.index:
                self.index[block_hash] = len(raw)
                self.bytes_used += len(raw)
        self.stats.count("written_blocks")
        self.stats.count("written_bytes", len(raw))
        return True

    def _evict(self, incoming: int) -> None:
        """Under the lock: drop least recently used files until `incoming` more bytes fit."""
        while self.index and self.bytes_used + incoming > self.budget_bytes:
            block_hash, size = self.index.popitem(last=False)
            self.bytes_used -= size
            self._path(block_hash).unlink(missing_ok=True)
            self.stats.count("evicted_blocks")
