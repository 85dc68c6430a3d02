"""One KV block as bytes, for every tier (never pickle).

Unit: one KV block (kvforge.manifest.KVBlockSpec), named by its prefix-cache chain hash, stored
as one entry, header and data together (an entry is whole or absent, never half evicted).
Format: a fixed little-endian header - magic, format version, tensor count, the cache
namespace, the block hash, payload length and an XXH3-128 checksum of the payload - then one
(dtype, 3 dims) record per cache tensor, then the tensors' bytes in spec order. Any mismatch
(another model or KV dtype, a truncated or corrupt entry) is refused as CorruptEntry: a miss.
The checksum guards against torn or flipped bytes, not an adversary (the namespace and hash do
the naming): XXH3 runs at tens of GB/s where blake2b ran at ~0.9 GB/s and capped a 100K-token
load (format 1 used blake2b; its entries are now misses).

An entry is decoded into a block it is given (in the engine, a host pool block mapped ahead):
a file is read straight into it (one preadv: no bytes object in between), a Redis reply copied
into it, and the checksum is taken over the block. A block that fails the check holds garbage
and is never named: the caller frees it.
"""
from __future__ import annotations

import os
import struct

import numpy as np
import xxhash

from kvforge.manifest import KVBlockSpec

MAGIC, VERSION = b"KVFB", 2
HEADER = struct.Struct("<4sHH32s16sQ16s")  # magic, version, tensors, namespace, hash, payload bytes, checksum
TENSOR = struct.Struct("<B3I")  # dtype code, block shape
DTYPE_CODES = {"float32": 1, "float16": 2, "int8": 3, "uint8": 4}

Arrays = dict[str, np.ndarray]  # one block: cache tensor name -> [kv_heads, block_tokens, D]


class CorruptEntry(ValueError):
    pass


class BlockCodec:
    """Bytes <-> one block, checked against this engine's namespace and block spec."""

    def __init__(self, spec: KVBlockSpec, namespace: bytes):
        self.spec, self.namespace = spec, namespace
        self.tensors = b"".join(TENSOR.pack(DTYPE_CODES[t.dtype], *spec.block_shape(t.name)) for t in spec.tensors)
        self.payload_bytes = spec.bytes_per_block
        # (name, dtype, block shape, elements) per tensor, in payload order: decode runs per block
        self.layout = [(t.name, t.dtype, shape, int(np.prod(shape)))
                       for t in spec.tensors for shape in [spec.block_shape(t.name)]]
        self.names = [name for name, *_ in self.layout]
        self.head_bytes = HEADER.size + len(self.tensors)
        self.entry_bytes = self.head_bytes + self.payload_bytes

    def encode(self, block_hash: bytes, arrays: Arrays) -> bytes:
        payload = b"".join(np.ascontiguousarray(arrays[t.name], t.dtype).tobytes() for t in self.spec.tensors)
        checksum = xxhash.xxh3_128_digest(payload)
        return HEADER.pack(MAGIC, VERSION, len(self.spec.tensors), self.namespace, block_hash, len(payload),
                           checksum) + self.tensors + payload

    def blank(self) -> Arrays:
        """A new block to decode into (tools and tests; the engine decodes into its pool's blocks)."""
        return {name: np.empty(shape, dtype) for name, dtype, shape, _ in self.layout}

    def blanks(self, n: int) -> list[Arrays]:
        return [self.blank() for _ in range(n)]

    def decode_into(self, block_hash: bytes, raw: bytes, block: Arrays) -> None:
        """Copy an entry held in memory (a Redis reply) into `block`, then check it."""
        if len(raw) != self.entry_bytes:
            raise CorruptEntry(f"entry is {len(raw)} bytes, expected {self.entry_bytes}")
        offset = self.head_bytes
        for name, dtype, shape, elements in self.layout:
            piece = np.frombuffer(raw, dtype, elements, offset)
            block[name][...] = piece.reshape(shape)
            offset += piece.nbytes
        self._check(block_hash, memoryview(raw)[:self.head_bytes], block)

    def read_into(self, path: os.PathLike, block_hash: bytes, block: Arrays) -> None:
        """Read an entry file into `block` (its arrays C-contiguous), then check it. Raises
        OSError (FileNotFoundError: no such entry) or CorruptEntry."""
        head = bytearray(self.head_bytes)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != self.entry_bytes:
                raise CorruptEntry(f"entry is {size} bytes, expected {self.entry_bytes}")
            read = os.preadv(fd, [head, *(block[name] for name in self.names)], 0)
        finally:
            os.close(fd)
        if read != self.entry_bytes:
            raise CorruptEntry(f"entry is {read} bytes, expected {self.entry_bytes}")
        self._check(block_hash, head, block)

    def _check(self, block_hash: bytes, head, block: Arrays) -> None:
        magic, version, count, namespace, stored_hash, length, checksum = HEADER.unpack_from(head)
        if (magic, version, count, length) != (MAGIC, VERSION, len(self.spec.tensors), self.payload_bytes):
            raise CorruptEntry("header does not match this format")
        if namespace != self.namespace or stored_hash != block_hash:
            raise CorruptEntry("entry belongs to another model, KV dtype or block")
        if head[HEADER.size:] != self.tensors:
            raise CorruptEntry("tensor shapes or dtypes differ")
        digest = xxhash.xxh3_128()
        for name in self.names:
            digest.update(block[name])
        if digest.digest() != checksum:
            raise CorruptEntry("checksum mismatch")
