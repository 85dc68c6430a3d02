"""The names of KV blocks: the same in every process that serves one cache namespace.

A full block is named by a hash chain, blake2b(parent hash, the block's token ids), whose root
is the cache namespace (model, weights, KV dtype, layout, block size, format;
kvforge.manifest.cache_namespace), an optional per-request salt and, for a longrope model, which
factors the prompt runs on (ModelSpec.long_factors), so two replicas name the same prefix alike, a
salted request never meets another tenant's blocks, and K/V computed with longrope's short factors
never serve a prompt that runs on the long ones, nor the other way round. (Python's
`hash()` is salted per process: never use it for this.)
"""
from __future__ import annotations

import hashlib

import numpy as np

HASH_BYTES = 16  # 128-bit names: no collision between the blocks of any realistic cache
MAX_CACHE_SALT_BYTES = 256
# Consecutive blocks of a chain that a distributed store keeps together (one Redis Cluster slot):
# losing a node then cuts a prefix at a group boundary. 16 blocks of 16 tokens = 256 tokens, the
# chunk LMCache stores; see runtime/kv/tiers/redis.py.
PLACEMENT_BLOCKS = 16


def root_hash(namespace: bytes, salt: bytes | None, long_factors: bool = False) -> bytes:
    """The chain's parent for block 0: the namespace, and the salt when there is one; long_factors
    (a prompt on longrope's long factors) hashes in a domain of its own."""
    person = b"kvforge-rootlong" if long_factors else b"kvforge-root"
    h = hashlib.blake2b(namespace, digest_size=HASH_BYTES, person=person)
    if salt:
        h.update(len(salt).to_bytes(4, "little") + salt)
    return h.digest()


def block_hash(parent: bytes, token_ids) -> bytes:
    return hashlib.blake2b(parent + np.asarray(token_ids, "<i4").tobytes(), digest_size=HASH_BYTES).digest()


def chain(namespace: bytes, salt: bytes | None, token_ids, blocks: int, block_tokens: int,
          long_factors: bool = False) -> list[bytes]:
    """The hashes of the first `blocks` full blocks of token_ids (long_factors: root_hash's)."""
    parent, hashes = root_hash(namespace, salt, long_factors), []
    for i in range(blocks):
        parent = block_hash(parent, token_ids[i * block_tokens:(i + 1) * block_tokens])
        hashes.append(parent)
    return hashes


def placement_tags(chain: list[bytes], start: int, count: int) -> list[bytes]:
    """The placement tags of blocks start..start+count-1 of a chain (chain[i] = block i's hash):
    the hash of the first block of each one's group."""
    return [chain[i - i % PLACEMENT_BLOCKS] for i in range(start, start + count)]
