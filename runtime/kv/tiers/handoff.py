"""The prefill -> decode hand-off on one host: KV blocks as files in a shared-memory directory
(/dev/shm, a tmpfs: RAM, no disk), written by the prefill worker, taken by the decode engine.

A hand-off is a prefix hit: the decode engine finds the prompt's blocks here through the tier
load path (runtime/kv/tiers/lower.py), copies them into its own pool and deletes the files (a
taken lease). Blocks the decode side never takes (a cancelled or abandoned request) are leased
for `lease_seconds` and then swept by the writer; nothing else evicts them, and
clear_prefix_cache does not touch them. Files are named by block hash and checked on read
(namespace, hash and checksum, tiers/codec.py), so a stale or foreign file is a miss, never a
wrong block. A full /dev/shm fails the write: the decode side recomputes that prompt.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path

from runtime.kv.tiers.base import Into, Tier, TierStats
from runtime.kv.tiers.codec import Arrays, BlockCodec, CorruptEntry

SUFFIX = ".kvb"
DEFAULT_ROOT = Path("/dev/shm")


class HandoffTier(Tier):
    name = "handoff"
    write_behind = False

    def __init__(self, directory: Path, codec: BlockCodec):
        self.codec = codec
        self.stats = TierStats(self.name)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def present(self, hashes: list[bytes]) -> int:
        return next((i for i, h in enumerate(hashes) if not self._path(h).exists()), len(hashes))

    def get_many(self, hashes: list[bytes], tags: list[bytes] | None = None, into: Into | None = None) -> list[Arrays]:
        """The leading run of hashes handed off (hashes: what present() found), each file deleted
        once read (the lease is taken)."""
        found = []
        for h, block in zip(hashes, (into or self.codec.blanks)(len(hashes))):
            path = self._path(h)
            began = time.perf_counter()
            try:
                self.codec.read_into(path, h, block)
                found.append(block)
            except FileNotFoundError:
                break
            except (OSError, CorruptEntry):
                self.stats.count("corrupt_blocks")
                path.unlink(missing_ok=True)
                break
            self.stats.measured(time.perf_counter() - began, self.codec.entry_bytes)
            self.stats.count("read_bytes", self.codec.entry_bytes)
            path.unlink(missing_ok=True)
        self.stats.count("hit_blocks", len(found))
        self.stats.count("miss_blocks", len(hashes) - len(found))
        return found

    def put_many(self, entries: list[tuple[bytes, bytes]], tags: list[bytes] | None = None) -> int:
        """Write every entry (atomically: a reader sees a whole file or none); a failure (/dev/shm
        full) stops the writes and is counted."""
        for written, (block_hash, raw) in enumerate(entries):
            path = self._path(block_hash)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(raw)
                os.replace(tmp, path)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                self.stats.count("errors")
                return written
            self.stats.count("written_blocks")
            self.stats.count("written_bytes", len(raw))
        return len(entries)

    def discard(self, hashes: list[bytes]) -> None:
        for h in hashes:
            with contextlib.suppress(OSError):
                self._path(h).unlink()

    def sweep(self, lease_seconds: float) -> int:
        """Delete hand-offs older than their lease (and temporary files of a crashed writer)."""
        expired, cutoff = 0, time.time() - lease_seconds
        for path in self.dir.iterdir():
            try:
                if path.stat().st_mtime < cutoff:
                    path.unlink(missing_ok=True)
                    expired += path.suffix == SUFFIX
            except OSError:
                continue
        return expired
