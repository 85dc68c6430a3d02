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
"""
from __future__ import annotations

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
        self.entry_bytes = HEADER.size + len(self.tensors) + self.payload_bytes

    def encode(self, block_hash: bytes, arrays: Arrays) -> bytes:
        payload = b"".join(np.ascontiguousarray(arrays[t.name], t.dtype).tobytes() for t in self.spec.tensors)
        checksum = xxhash.xxh3_128_digest(payload)
        return HEADER.pack(MAGIC, VERSION, len(self.spec.tensors), self.namespace, block_hash, len(payload),
                           checksum) + self.tensors + payload

    def decode(self, block_hash: bytes, raw: bytes) -> Arrays:
        if len(raw) != self.entry_bytes:
            raise CorruptEntry(f"entry is {len(raw)} bytes, expected {self.entry_bytes}")
        magic, version, count, namespace, stored_hash, length, checksum = HEADER.unpack_from(raw)
        if (magic, version, count, length) != (MAGIC, VERSION, len(self.spec.tensors), self.payload_bytes):
            raise CorruptEntry("header does not match this format")
        if namespace != self.namespace or stored_hash != block_hash:
            raise CorruptEntry("entry belongs to another model, KV dtype or block")
        if raw[HEADER.size:HEADER.size + len(self.tensors)] != self.tensors:
            raise CorruptEntry("tensor shapes or dtypes differ")
        payload = memoryview(raw)[HEADER.size + len(self.tensors):]
        if xxhash.xxh3_128_digest(payload) != checksum:
            raise CorruptEntry("checksum mismatch")
        arrays, offset = {}, 0
        for name, dtype, shape, elements in self.layout:
            array = np.frombuffer(payload, dtype, elements, offset).reshape(shape)
            arrays[name], offset = array, offset + array.nbytes
        return arrays
