"""Automatic prefix caching and the KV manager on real tiny exports (ONNX Runtime, in place):
a hit changes nothing but the time to the first token."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest

from kvforge.block_hash import block_hash, root_hash
from kvforge.manifest import Manifest, cache_namespace, kv_block_spec
from runtime.kv.block_pool import HostBlockPool
from runtime.kv.manager import KVManager
from kvforge.errors import RequestError
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners import open_runner
from runtime.sequence import Sequence
from tests.test_runtime import reference_greedy

BLOCK = 16
DOCUMENT = np.random.default_rng(0).integers(3, 4000, 150).tolist()  # 9 full blocks and a partial one
QUESTIONS = [np.random.default_rng(1 + i).integers(3, 4000, n).tolist() for i, n in enumerate((5, 21, 40, 3, 17, 30, 9, 12))]


def greedy(max_tokens=64, **kw):
    return SamplingParams(max_tokens=max_tokens, **kw)


def test_hash_chain_is_stable_and_salted():
    namespace = b"n" * 32
    a = block_hash(root_hash(namespace, None), list(range(BLOCK)))
    assert a == block_hash(root_hash(namespace, None), list(range(BLOCK)))  # no per-process seed
    assert a.hex() == block_hash(root_hash(namespace, b""), np.arange(BLOCK)).hex()
    assert a != block_hash(root_hash(namespace, b"tenant"), list(range(BLOCK)))
    assert a != block_hash(root_hash(b"m" * 32, None), list(range(BLOCK)))
    assert block_hash(a, [1] * BLOCK) != block_hash(block_hash(root_hash(namespace, None), [2] * BLOCK), [1] * BLOCK)


def test_namespace_separates_what_changes_kv(fp32, exports):
    base = Manifest.load(fp32)
    assert cache_namespace(base) == cache_namespace(Manifest.load(fp32))
    assert cache_namespace(base) != cache_namespace(Manifest.load(exports("inplace", "int8")))
    int8_weights = Manifest(**{**base.__dict__, "engine": {"weights": "int8"}})
    assert cache_namespace(base) != cache_namespace(int8_weights)
    moved = Manifest(**{**base.__dict__, "source": {**base.source, "path": "/elsewhere"}})
    assert cache_namespace(base) == cache_namespace(moved)  # the same checkpoint anywhere


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
def test_block_copies_round_trip_exactly_with_scales(exports, dtype):
    """What read_blocks gives and write_blocks takes is the slot's content, scales included."""
    runner = open_runner(exports("inplace", dtype))
    spec = kv_block_spec(runner.manifest)
    runner.allocate(2, 256)
    runner.step(np.array([DOCUMENT]), np.array([0]), np.array([len(DOCUMENT)]))
    if dtype != "fp32":
        assert any(name.endswith("_scale") for name in spec.names)
    pool = HostBlockPool(spec, 12 * spec.bytes_per_block)
    blocks = pool.put(runner.read_blocks(0, 0, 10), [None] * 10)  # the 10th is partial
    runner.write_blocks(1, 0, pool.get(blocks))
    for name, buf in runner.buffers.items():
        assert np.array_equal(buf[1, :, :len(DOCUMENT)], buf[0, :, :len(DOCUMENT)]), name
        assert spec.block_shape(name) == pool.arrays[name].shape[1:]
    assert pool.bytes_used == 10 * spec.bytes_per_block <= pool.budget_bytes


def test_blocks_in_scattered_pool_rows_and_per_block_lists_copy_exactly(fp32):
    """A prefix goes into a slot through views of runs of consecutive pool rows: blocks stored
    between held ones, given as per-block lists (a tier load) or stacked, one shared with a cached
    duplicate, come back exactly."""
    runner = open_runner(fp32)
    spec = kv_block_spec(runner.manifest)
    runner.allocate(2, 256)
    runner.step(np.array([DOCUMENT]), np.array([0]), np.array([len(DOCUMENT)]))
    source = runner.read_blocks(0, 0, 10)
    pool = HostBlockPool(spec, 40 * spec.bytes_per_block)
    held = pool.put({n: a[:3] for n, a in source.items()}, [None] * 3)
    pool.release(held[1:2])  # row 1 free again, between held rows 0 and 2
    first = pool.put({n: a[:4] for n, a in source.items()}, [b"a", b"b", b"c", b"d"])
    per_block = {n: [a[i] for i in range(3, 10)] for n, a in source.items()}
    rest = pool.put(per_block, [b"d"] + [bytes([i]) for i in range(5)] + [None])  # b"d": a duplicate of block 3
    blocks = first[:3] + rest
    assert rest[0] == first[3] and [start for start, _ in pool.runs(blocks)] == [0, 1]  # rows 1, then 3..11
    for start, views in pool.runs(blocks):
        runner.write_blocks(1, start, views)
    for name, buf in runner.buffers.items():
        assert np.array_equal(buf[1, :, :len(DOCUMENT)], buf[0, :, :len(DOCUMENT)]), name


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_prefill_after_copied_prefix_matches_full_prefill(exports, dtype):
    """Runner level: 9 blocks copied from the pool + prefill of the rest + 64 decode steps give
    the logits of the sequence computed from scratch (fp32 within 1e-5; int8 KV caches exactly
    what the slot held, so it is as close)."""
    directory = exports("inplace", dtype)
    cold, warm = open_runner(directory), open_runner(directory)
    for runner in (cold, warm):
        runner.allocate(1, 256)
    prompt = DOCUMENT + QUESTIONS[1]
    logits = [cold.step(np.array([prompt]), np.array([0]), np.array([len(prompt)]))[0, -1]]
    pool = HostBlockPool(cold.block, 9 * cold.block.bytes_per_block)
    warm.write_blocks(0, 0, pool.get(pool.put(cold.read_blocks(0, 0, 9), [None] * 9)))
    cached = 9 * BLOCK
    logits.append(warm.step(np.array([prompt[cached:]]), np.array([cached]), np.array([len(prompt) - cached]))[0, -1])
    worst = float(np.abs(logits[0] - logits[1]).max())
    for i in range(64):
        tokens = [int(x.argmax()) for x in logits]
        assert tokens[0] == tokens[1], i
        logits = [r.step(np.array([[t]]), np.array([len(prompt) + i]), np.array([1]))[0, 0]
                  for r, t in zip((cold, warm), tokens)]
        worst = max(worst, float(np.abs(logits[0] - logits[1]).max()))
    assert worst <= (1e-5 if dtype == "fp32" else 1e-3), worst


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_greedy_with_a_hit_equals_without(exports, dtype):
    directory = exports("inplace", dtype)
    prompt = DOCUMENT + QUESTIONS[2]
    with LLMEngine(directory, prefix_cache=False) as engine:
        expected = engine.generate([prompt], greedy())[0]
        assert engine.generate([prompt], greedy())[0].cached_tokens == 0  # disabled never hits
        assert engine.stats()["prefix_cache_hit_tokens"] == 0
    with LLMEngine(directory) as engine:
        cold = engine.generate([prompt], greedy())[0]
        warm = engine.generate([prompt], greedy())[0]
        stats = engine.stats()
    assert len(expected.token_ids) == 64
    assert cold.token_ids == warm.token_ids == expected.token_ids and warm.text == expected.text
    assert (cold.cached_tokens, warm.cached_tokens) == (0, (len(prompt) - 1) // BLOCK * BLOCK)
    assert stats["prefix_cache_hit_tokens"] == warm.cached_tokens
    assert stats["prefix_cache_queried_tokens"] == 2 * len(prompt)


def test_seeded_sampling_is_identical_with_a_hit(fp32):
    prompt = DOCUMENT + QUESTIONS[0]
    params = SamplingParams(max_tokens=48, temperature=1.0, top_p=0.9, seed=11)
    with LLMEngine(fp32, prefix_cache=False) as engine:
        expected = engine.generate([prompt], params)[0].token_ids
    with LLMEngine(fp32) as engine:
        runs = [engine.generate([prompt], params)[0] for _ in range(2)]
    assert [r.cached_tokens for r in runs] == [0, (len(prompt) - 1) // BLOCK * BLOCK]
    assert [r.token_ids for r in runs] == [expected, expected]


def test_partial_hits_and_a_strict_prefix_prompt(fp32):
    shared = DOCUMENT[:100]  # 6 full blocks, then the prompts differ
    other = shared + QUESTIONS[3] + QUESTIONS[4]
    strict = DOCUMENT[:70]  # a strict prefix of the cached prompt
    with LLMEngine(fp32) as engine:
        engine.generate([DOCUMENT], greedy(8))
        partial = engine.generate([other], greedy(32))[0]
        prefix = engine.generate([strict], greedy(32))[0]
        whole = engine.generate([DOCUMENT[:96] + [DOCUMENT[96]]], greedy(32))[0]  # ends right after 6 blocks
    eos = set(engine.tokenizer.eos_token_ids)
    assert partial.cached_tokens == 96 and prefix.cached_tokens == 64
    assert whole.cached_tokens == 96  # everything but the last token, which is always computed
    assert partial.token_ids == reference_greedy(fp32, other, 32, eos)
    assert prefix.token_ids == reference_greedy(fp32, strict, 32, eos)
    assert whole.token_ids == reference_greedy(fp32, DOCUMENT[:97], 32, eos)


def test_eight_requests_sharing_a_prefix_joining_at_different_times(fp32):
    """Each request joins at its predecessor's 3rd token (submitted from the engine thread, so at
    that step whatever the machine's speed): with 64-token chunks, mid-prefill or mid-decode."""
    prompts = [DOCUMENT + q for q in QUESTIONS]
    with LLMEngine(fp32, prefix_cache=False) as engine:
        alone = [engine.generate([p], greedy(40))[0].token_ids for p in prompts]
    with LLMEngine(fp32, slots=8, prefill_budget=64) as engine:
        results: dict[int, list[int]] = {}
        cached: dict[int, int] = {}
        done = threading.Semaphore(0)

        def collect(i):
            def on_output(out):
                had = len(results.setdefault(i, []))
                results[i].extend(out.token_ids)
                if had < 3 <= len(results[i]) and i + 1 < len(prompts):  # the next one joins now
                    engine.submit(prompts[i + 1], greedy(40), collect(i + 1))
                if out.finished:
                    cached[i] = out.cached_tokens
                    done.release()
            return on_output

        engine.submit(prompts[0], greedy(40), collect(0))
        for _ in prompts:
            assert done.acquire(timeout=120)
        stats = engine.stats()
    assert [results[i] for i in range(len(prompts))] == alone
    assert all(cached[i] == 144 for i in range(1, len(prompts)))
    assert stats["max_rows"] > 1


def test_a_burst_with_one_prefix_computes_it_once(fp32):
    prompts = [DOCUMENT + q for q in QUESTIONS[:4]]
    with LLMEngine(fp32, prefix_cache=False) as engine:
        alone = [r.token_ids for r in engine.generate(prompts, greedy(16))]
    # generate() hands all four over at once; 64-token chunks make the document take several steps
    with LLMEngine(fp32, slots=4, prefill_budget=64, solo_prefill_tokens=64) as engine:
        outs = engine.generate(prompts, greedy(16))
        stats = engine.stats()
    assert [o.token_ids for o in outs] == alone
    assert [o.cached_tokens for o in outs] == [0, 144, 144, 144]
    assert stats["prefix_waits"] > 0
    # the document was prefilled once; the others computed only their own tails
    assert stats["prompt_tokens"] == sum(len(p) for p in prompts) - 3 * 144


def test_eviction_under_a_tiny_pool_never_corrupts(fp32):
    spec = kv_block_spec(Manifest.load(fp32))
    prompts = [np.random.default_rng(20 + i).integers(3, 4000, 120).tolist() for i in range(6)]
    eos = set()
    with LLMEngine(fp32, slots=3, kv_host_bytes=5 * spec.bytes_per_block) as engine:
        eos = set(engine.tokenizer.eos_token_ids)
        together = engine.generate(prompts, greedy(24))  # 3 running at once, 7 blocks each, 5 in the pool
        one_by_one = [engine.generate([p], greedy(24))[0] for p in prompts + prompts[::-1]]
        stats = engine.stats()
    expected = [reference_greedy(fp32, p, 24, eos) for p in prompts]
    assert [o.token_ids for o in together] == expected
    assert [o.token_ids for o in one_by_one] == expected + expected[::-1]
    assert stats["blocks_evicted"] > 0 and stats["kv_host_pool_bytes"] <= 5 * spec.bytes_per_block
    assert stats["prefix_cache_hit_tokens"] > 0  # the repeat of the last prompt found its head


def test_salted_requests_never_hit_other_salts(fp32):
    prompt = DOCUMENT + QUESTIONS[5]
    with LLMEngine(fp32) as engine:
        def cached(salt):
            return _run(engine, prompt, salt)

        assert cached(None) == 0
        assert cached(b"tenant-a") == 0  # never the unsalted blocks
        full = (len(prompt) - 1) // BLOCK * BLOCK
        assert cached(b"tenant-a") == full
        assert cached(b"tenant-b") == 0
        assert cached(None) == full
        with pytest.raises(RequestError, match="cache_salt must be at most 256 bytes"):
            engine.submit(prompt, greedy(), cache_salt=b"x" * 300)


def _run(engine, prompt, salt):
    done, result = threading.Event(), {}

    def on_output(out):
        if out.finished:
            result["out"] = out
            done.set()

    engine.submit(prompt, greedy(4), on_output, cache_salt=salt)
    assert done.wait(60)
    return result["out"].cached_tokens


def test_clearing_the_cache_forgets_every_prefix(fp32):
    with LLMEngine(fp32) as engine:
        engine.generate([DOCUMENT], greedy(4))
        assert engine.clear_prefix_cache() > 0
        assert engine.generate([DOCUMENT], greedy(4))[0].cached_tokens == 0
        assert engine.generate([DOCUMENT], greedy(4))[0].cached_tokens == 144
        assert engine.stats()["kv_host_pool_bytes"] > 0


def test_slot_buffers_stay_within_kv_cache_bytes(fp32):
    bytes_per_token = Manifest.load(fp32).kv_bytes_per_token
    budget = 256 * bytes_per_token
    with LLMEngine(fp32, slots=8, kv_cache_bytes=budget) as engine:
        peak = []
        done, submitted = threading.Semaphore(0), threading.Event()

        def watch(out):
            peak.append(engine.runner.kv_bytes_allocated)  # the engine thread: between steps
            submitted.wait(120)  # holds the engine until every request waits: they run together
            if out.finished:
                done.release()

        for i, q in enumerate(QUESTIONS):
            engine.submit(q * 2, greedy(40 + 10 * i), watch)
        submitted.set()
        for _ in QUESTIONS:
            assert done.acquire(timeout=120)
        stats = engine.stats()
    assert max(peak) <= budget and stats["max_rows"] >= 2
    assert 0 < stats["kv_utilization"] <= 1 and stats["kv_cache_bytes"] == budget


def test_a_running_row_swaps_out_and_back_with_its_partial_block(fp32):
    """What swap preemption will do: a row's KV (9 full blocks and a partial one) goes to the
    pool, the row is overwritten by another sequence, and the KV comes back: decoding goes on
    as if nothing happened."""
    runner = open_runner(fp32)
    pool = HostBlockPool(runner.block, 32 * runner.block.bytes_per_block)
    kv = KVManager(runner, slots=2, kv_cache_bytes=1 << 30, pool=pool, namespace=cache_namespace(runner.manifest))
    seq = Sequence(1, DOCUMENT, greedy(), print, None, frozenset())
    kv.rows.fit_capacity(len(DOCUMENT) + 32)
    kv.rows.take_copies().run()  # the copies the engine runs at a step's start
    logits = runner.step(np.array([DOCUMENT]), np.array([0]), np.array([len(DOCUMENT)]))[0, -1]
    seq.num_cached = len(DOCUMENT)
    tokens = [int(logits.argmax())]
    blocks = kv.swap_out(seq, 0)
    kv.rows.take_copies().run()
    assert len(blocks) == 10 and pool.bytes_used == 10 * runner.block.bytes_per_block
    runner.step(np.array([QUESTIONS[2] * 4]), np.array([0]), np.array([160]))  # clobbers row 0
    kv.swap_in(seq, 0, blocks)
    kv.rows.take_copies().run()
    kv.copies_done()
    assert pool.bytes_used == 0  # anonymous blocks go back to the free list once copied in
    for i in range(16):
        logits = runner.step(np.array([[tokens[-1]]]), np.array([len(DOCUMENT) + i]), np.array([1]))[0, 0]
        tokens.append(int(logits.argmax()))
    assert tokens[:17] == reference_greedy(fp32, DOCUMENT, 17, set())


# ---------------------------------------------------------------- through a real tritonserver

CONTROL_KEY = "test-control-key"
POOL_BYTES = 64 << 20


@pytest.fixture(scope="module")
def server(exports, tmp_path_factory):
    """A server of our own: the launcher hands its control key and the pool budget to the model."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    repo = tmp_path_factory.mktemp("prefix_repository")
    write_repository(exports(), repo, slots=4)
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, control_key=CONTROL_KEY,
                      extra_args=["--kv-host-bytes", str(POOL_BYTES)]) as s:
        yield s


def post_generate(server, **inputs) -> tuple[int, dict]:
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate",
                                     json.dumps(inputs).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_triton_reports_cached_tokens_salts_and_clears_behind_the_key(server, fp32):
    from runtime.tokenizer import Tokenizer
    from tests.test_serving import metrics

    prompt = "def fibonacci(n):\n" + "    total += n * n\n" * 12
    full = (len(Tokenizer(fp32, Manifest.load(fp32)).encode(prompt)) - 1) // BLOCK * BLOCK
    first = post_generate(server, text_input=prompt, max_tokens=16)[1]
    second = post_generate(server, text_input=prompt, max_tokens=16)[1]
    salted = post_generate(server, text_input=prompt, max_tokens=16, cache_salt="tenant-a")[1]
    assert full >= 64 and first["cached_tokens"] == 0 and second["cached_tokens"] == full and salted["cached_tokens"] == 0
    assert second["text_output"] == first["text_output"] == salted["text_output"]

    status, body = post_generate(server, text_input="", max_tokens=1, clear_prefix_cache=True)
    assert status == 400 and "control key" in body["error"]
    status, body = post_generate(server, text_input="", max_tokens=1, clear_prefix_cache=True, control_key="guess")
    assert status == 400 and "control key" in body["error"]
    assert post_generate(server, text_input=prompt, max_tokens=4)[1]["cached_tokens"] == full  # still cached
    status, body = post_generate(server, text_input="", max_tokens=1, clear_prefix_cache=True,
                                 control_key=CONTROL_KEY)
    assert status == 200 and re.fullmatch(r"cleared [1-9]\d* prefix cache blocks", body["text_output"])
    assert post_generate(server, text_input=prompt, max_tokens=4)[1]["cached_tokens"] == 0

    deadline = time.monotonic() + 120  # a bound on what must happen, not a speed
    while True:  # the model publishes its metrics every 0.1 s
        m = metrics(server)
        settled = (m.get("kvforge_prefix_cache_hit_tokens_total", 0) >= 2 * second["cached_tokens"]
                   and m.get("kvforge_kv_host_pool_bytes", 0) > 0)  # the blocks stored after the clear
        if settled:
            break
        assert time.monotonic() < deadline, f"the metrics never showed the hits: {m}"
        time.sleep(0.1)
    assert m["kvforge_prefix_cache_hit_tokens_total"] == second["cached_tokens"] * 2
    assert m["kvforge_prefix_cache_queried_tokens_total"] > m["kvforge_prefix_cache_hit_tokens_total"]
    assert m["kvforge_kv_host_pool_budget_bytes"] == POOL_BYTES
    assert 0 < m["kvforge_kv_host_pool_bytes"] <= POOL_BYTES
    assert m["kvforge_kv_blocks_evicted_total"] == 0
