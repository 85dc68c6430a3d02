"""One KV block as bytes, for every tier (never pickle).

Unit: one KV block (kvforge.manifest.KVBlockSpec), named by its prefix-cache chain hash, stored
as one entry, header and data together (an entry is whole or absent, never half evicted).
Format: a fixed little-endian header - magic, format version, tensor count, the cache
namespace, the block hash, payload length and a blake2b checksum of the payload - then one
(dtype, 3 dims) record per cache tensor, then the tensors' bytes in spec order. Any mismatch
(another model or KV dtype, a truncated or corrupt entry) is refused as CorruptEntry: a miss.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np

from kvforge.manifest import KVBlockSpec

MAGIC, VERSION = b"KVFB", 1
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
        self.entry_bytes = HEADER.size + len(self.tensors) + self.payload_bytes

    def encode(self, block_hash: bytes, arrays: Arrays) -> bytes:
        payload = b"".join(np.ascontiguousarray(arrays[t.name], t.dtype).tobytes() for t in self.spec.tensors)
        checksum = hashlib.blake2b(payload, digest_size=16).digest()
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
        if hashlib.blake2b(payload, digest_size=16).digest() != checksum:
            raise CorruptEntry("checksum mismatch")
        arrays, offset = {}, 0
        for t in self.spec.tensors:
            shape = self.spec.block_shape(t.name)
            array = np.frombuffer(payload, t.dtype, int(np.prod(shape)), offset).reshape(shape)
            arrays[t.name], offset = array, offset + array.nbytes
        return arrays
