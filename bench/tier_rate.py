"""How fast the tiers below RAM hand a long prefix back (issue 41 item 3): `get_many` of N blocks
through the real DiskTier (page cache warm) and RedisTier (a real loopback redis-server), bytes
over wall time, decode and checksum included, into host pool blocks mapped ahead as the engine
loads them (runtime/kv/tiers/lower.py). Blocks have Llama-3.2-1B's fp32 KV shape (16 layers x 8
KV heads x 64, 16 tokens: 1 MiB), so 512 blocks are an 8K-token prefix.

    .venv/bin/python -m bench.tier_rate [--blocks 512] [--rounds 5] [--out results]

Prints a table and writes OUT/tier_rate.json. Rounds take turns between the tiers; the median
and the best round are reported (the first load after a store is slower: Redis and the kernel
still settle the fresh pages).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvforge.manifest import CacheTensor, KVBlockSpec
from launcher.harness import free_ports
from launcher.redis_server import RedisServer
from runtime.kv.block_pool import HostBlockPool
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.disk import DiskTier
from runtime.kv.tiers.redis import PIECE_BYTES, RedisTier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 16, 8, 64, 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()

    tensors = tuple(CacheTensor(f"past_key_values.{layer}.{kind}", "float32", KV_HEADS, HEAD_DIM, 131072)
                    for layer in range(LAYERS) for kind in ("key", "value"))
    codec = BlockCodec(KVBlockSpec(BLOCK_TOKENS, tensors), b"tier-rate".ljust(32, b"."))
    rng = np.random.default_rng(0)
    hashes = [i.to_bytes(16, "little") for i in range(args.blocks)]
    entries = [(h, codec.encode(h, {t.name: rng.standard_normal(codec.spec.block_shape(t.name)).astype("float32")
                                    for t in tensors})) for h in hashes]
    total = args.blocks * codec.entry_bytes
    print(f"tier_rate: {args.blocks} blocks of {codec.entry_bytes / 2**20:.2f} MiB ({total / 2**30:.2f} GiB)")

    pool = HostBlockPool(codec.spec, args.blocks * codec.spec.bytes_per_block)
    pool.map_ahead(pool.budget_bytes)
    pool.populated.wait()
    taken: list[int] = []

    def into(n: int) -> list[dict]:
        ids = pool.anonymous(n, partial=True)
        taken.extend(ids)
        return [pool.block(b) for b in ids]

    rates: dict[str, list[float]] = {"disk": [], "redis": []}
    with tempfile.TemporaryDirectory(prefix="kvforge-tier-rate-") as root, \
            RedisServer(free_ports(1)[0], maxmemory=f"{2 * total // 2**20 + 64}mb") as server:
        tiers = {"disk": DiskTier(Path(root), 2 * total, codec), "redis": RedisTier(server.url, codec)}
        for name, tier in tiers.items():
            assert tier.put_many(entries) == len(entries), f"{name} did not store every block"
        del entries
        for round_ in range(args.rounds):
            for name, tier in tiers.items():
                began = time.perf_counter()
                found = tier.get_many(hashes, into=into)
                seconds = time.perf_counter() - began
                pool.release(taken)
                taken.clear()
                assert len(found) == len(hashes), f"{name} returned {len(found)} of {len(hashes)} blocks"
                rates[name].append(total / seconds / 1e9)
                print(f"tier_rate: round {round_ + 1} {name}: {rates[name][-1]:.2f} GB/s")
        tiers["redis"].close()

    from redis.utils import HIREDIS_AVAILABLE

    result = {"blocks": args.blocks, "entry_bytes": codec.entry_bytes, "rounds": args.rounds,
              "redis_piece_bytes": PIECE_BYTES, "hiredis": HIREDIS_AVAILABLE,
              "gb_per_s": {name: {"median": round(statistics.median(r), 3), "best": round(max(r), 3),
                                  "rounds": [round(x, 3) for x in r]} for name, r in rates.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tier_rate.json").write_text(json.dumps(result, indent=1))
    print("| tier | median GB/s | best GB/s |\n|---|---|---|")
    for name, r in result["gb_per_s"].items():
        print(f"| {name} | {r['median']:.2f} | {r['best']:.2f} |")
    print(f"wrote {args.out / 'tier_rate.json'}")


if __name__ == "__main__":
    main()
