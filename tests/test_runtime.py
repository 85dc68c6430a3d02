"""The in-process generation runtime (LLMEngine) on a real tiny export and ONNX Runtime."""
from __future__ import annotations

import math
import threading

import pytest

from runtime.greedy import greedy_tokens
from kvforge.errors import QueueFullError, RequestError
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners import open_runner
from runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from kvforge.manifest import Manifest

PROMPTS = ["def fibonacci(n):", "import os\n", "class Config:", "x = 1", "print(",
           "for i in range(10):\n    " + "total += i * i\n    " * 14]  # the last one spans chunks and buckets


@pytest.fixture(scope="module")
def engine_dir(exports):
    return exports()


def reference_greedy(engine_dir, prompt_ids: list[int], max_tokens: int, eos: set[int]) -> list[int]:
    """One sequence alone, stepping the runner token by token: no batching, no scheduler."""
    return greedy_tokens(open_runner(engine_dir), prompt_ids, max_tokens, eos)


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(30), f"timed out waiting for {what}"


def test_greedy_batched_equals_unbatched_reference(engine_dir):
    with LLMEngine(engine_dir, slots=3, prefill_tokens=32) as engine:
        prompt_ids = [engine.tokenizer.encode(p) for p in PROMPTS]
        assert max(map(len, prompt_ids)) > 64  # forces prompt chunks and a bigger capacity bucket
        # different lengths: sequences leave at different steps, so rows move and others join
        max_tokens = [24, 9, 17, 30, 5, 21]
        results = engine.generate(prompt_ids, [SamplingParams(max_tokens=n) for n in max_tokens])
        stats = engine.stats()
        eos = set(engine.tokenizer.eos_token_ids)
    for ids, n, result in zip(prompt_ids, max_tokens, results):
        assert result.token_ids == reference_greedy(engine_dir, ids, n, eos)
        assert result.text == engine.tokenizer.decode(result.token_ids)
    assert stats["max_rows"] == 3 and stats["multi_row_steps"] > 10
    assert stats["prefill_steps"] + stats["mixed_steps"] >= 3  # the long prompt took several chunks
    assert stats["resizes"] >= 2 and stats["capacity"] == 64  # grew for the long prompt, shrank after
    assert stats["running"] == stats["waiting"] == 0
    idle = 64 * Manifest.load(engine_dir).kv_bytes_per_token  # one row of the smallest bucket
    assert stats["kv_bytes_allocated"] == idle and stats["kv_utilization"] == idle / stats["kv_cache_bytes"]


def test_requests_join_and_leave_the_running_batch(engine_dir):
    with LLMEngine(engine_dir, slots=4) as engine:
        alone = {p: r.token_ids for p, r in zip(PROMPTS[:3], engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8)))}
        long_started, short_done, long_done = threading.Event(), threading.Event(), threading.Event()
        long_tokens: list[int] = []
        tokens_when_short_done: list[int] = []

        def on_long(out):
            long_tokens.extend(out.token_ids)
            long_started.set()
            if out.finished:
                long_done.set()

        engine.submit(PROMPTS[5], SamplingParams(max_tokens=200), on_long)
        wait_for(long_started, "the long request's first token")
        joined = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=8))  # join while it decodes
        tokens_when_short_done.append(len(long_tokens))
        short_done.set()
        wait_for(long_done, "the long request")
        stats = engine.stats()
    assert [r.token_ids for r in joined] == [alone[p] for p in PROMPTS[:3]]
    assert long_tokens == reference_greedy(engine_dir, engine.tokenizer.encode(PROMPTS[5]), 200,
                                           set(engine.tokenizer.eos_token_ids))
    assert tokens_when_short_done[0] < len(long_tokens)  # they finished while it was still running
    assert stats["max_rows"] == 4


def test_outputs_stream_token_by_token(engine_dir):
    with LLMEngine(engine_dir) as engine:
        outputs, done = [], threading.Event()
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=32),
                      lambda out: (outputs.append(out), out.finished and done.set()))
        wait_for(done, "the stream")
    sizes = [len(o.token_ids) for o in outputs]
    # a token whose bytes do not complete a character yet rides along with the next one
    assert sum(sizes) == 32 and max(sizes) <= 2 and sizes.count(1) >= 24, sizes
    assert all(o.text for o in outputs[:-1]) and not any(o.finished for o in outputs[:-1])


def test_admission_waits_for_slots_and_kv_blocks(engine_dir):
    with LLMEngine(engine_dir, slots=2) as engine:
        ids = [engine.submit(p, SamplingParams(max_tokens=30)) for p in PROMPTS[:5]]
        stats = engine.stats()
        assert stats["running"] <= 2 and stats["running"] + stats["waiting"] + stats["finished"] == 5
        assert len(engine.generate(PROMPTS[:2], SamplingParams(max_tokens=4))) == 2
        assert engine.stats()["max_rows"] == 2 and len(ids) == 5
    # slot buffers for 128 tokens, 4 slots: requests fitting the 64-token bucket run two at a
    # time (four rows would be 256 tokens), and a promise needing the 224 bucket never fits
    bytes_per_token = Manifest.load(engine_dir).kv_bytes_per_token
    with LLMEngine(engine_dir, slots=4, kv_cache_bytes=128 * bytes_per_token) as engine:
        engine.generate(PROMPTS[:4], SamplingParams(max_tokens=20))
        assert engine.stats()["max_rows"] == 2
        with pytest.raises(RequestError, match="needs 224 KV tokens .* the cache holds 128"):
            engine.submit(PROMPTS[0], SamplingParams(max_tokens=200))


def test_queue_full_is_a_clear_error(engine_dir):
    with LLMEngine(engine_dir, slots=1, max_waiting=2) as engine:
        running = threading.Event()
        first = engine.submit("x", SamplingParams(max_tokens=400), lambda out: running.set())
        wait_for(running, "the first request to run")
        queued = [engine.submit("y", SamplingParams(max_tokens=400)) for _ in range(2)]
        with pytest.raises(QueueFullError, match="waiting queue is full"):
            engine.submit("z", SamplingParams(max_tokens=4))
        for request_id in [first, *queued]:
            assert engine.cancel(request_id)


def test_seeded_sampling_is_reproducible(engine_dir):
    with LLMEngine(engine_dir) as engine:
        def run(**kw):
            return engine.generate([PROMPTS[0]], SamplingParams(max_tokens=16, **kw))[0].token_ids

        greedy = run()
        assert run(temperature=1.0, seed=7) == run(temperature=1.0, seed=7)
        assert run(temperature=1.0, seed=7) != run(temperature=1.0, seed=8)
        assert run(temperature=0.8, top_k=50, top_p=0.9, seed=3) == run(temperature=0.8, top_k=50, top_p=0.9, seed=3)
        assert run(temperature=1.0, top_k=1, seed=1) == greedy  # top-k 1 leaves only the argmax
        assert run(temperature=1.0, top_p=1e-9, seed=2) == greedy  # so does a vanishing nucleus


def test_stop_strings_and_stop_tokens(engine_dir):
    with LLMEngine(engine_dir) as engine:
        full = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20))[0]
        stop = full.text[len(full.text) // 2:][:4]
        deltas: list[str] = []
        done = threading.Event()

        def collect(out):
            deltas.append(out.text)
            if out.finished:
                deltas.append(out.finish_reason)
                done.set()

        engine.submit(PROMPTS[0], SamplingParams(max_tokens=20, stop=(stop,)), collect)
        wait_for(done, "the stop-string request")
        assert "".join(deltas[:-1]) == full.text[:full.text.index(stop)] and deltas[-1] == "stop"
        assert all(stop not in d for d in deltas)  # the stop string was held back, never streamed
        stop_token = full.token_ids[5]
        cut = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=20, stop_token_ids=(stop_token,)))[0]
        assert cut.token_ids == full.token_ids[:full.token_ids.index(stop_token)] and cut.finish_reason == "stop"
        assert full.finish_reason == "length" and len(full.token_ids) == 20


def test_cancellation_frees_the_slot(engine_dir):
    with LLMEngine(engine_dir, slots=1) as engine:
        started, ended = threading.Event(), threading.Event()
        finals = []

        def on_output(out):
            started.set()
            if out.finished:
                finals.append(out)
                ended.set()

        running = engine.submit(PROMPTS[0], SamplingParams(max_tokens=400), on_output)
        waiting = engine.submit(PROMPTS[1], SamplingParams(max_tokens=400), on_output)
        wait_for(started, "the first token")
        assert engine.cancel(waiting) and engine.cancel(running)
        wait_for(ended, "the cancellation")
        assert engine.generate([PROMPTS[2]], SamplingParams(max_tokens=4))[0].finish_reason == "length"
        stats = engine.stats()
    assert [f.finish_reason for f in finals] == ["cancelled", "cancelled"]
    assert stats["cancelled"] == 2 and stats["running"] == 0
    assert stats["kv_bytes_allocated"] == 64 * Manifest.load(engine_dir).kv_bytes_per_token
    assert stats["generated_tokens"] < 400
    assert not engine.cancel(running)  # no longer live


@pytest.mark.parametrize("prompt, params, message", [
    ("", {}, "prompt is empty"),
    ("word " * 2000, {}, "the context holds 512"),
    ("x" * 20000, {}, "characters; the limit"),
    ("x", {"max_tokens": 0}, "max_tokens must be at least 1"),
    ("x", {"max_tokens": 600}, "exceeds the context of 512"),
    ("x", {"temperature": -0.5}, "temperature must be a finite number"),
    ("x", {"temperature": math.nan}, "temperature must be a finite number"),
    ("x", {"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ("x", {"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ("x", {"top_k": -1}, "top_k must be an integer >= 0"),
    ("x", {"stop": ("",)}, "each stop string"),
    ([1, 99999], {}, "prompt token ids must be in"),
    (b"x", {}, "a prompt is a str or a list of token ids"),
])
def test_bad_requests_raise_request_error(engine_dir, prompt, params, message):
    with LLMEngine(engine_dir) as engine:
        with pytest.raises(RequestError, match=message):
            engine.submit(prompt, SamplingParams(**params))
        assert engine.generate(["x"], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_detokenizer_streams_whole_characters(engine_dir):
    tokenizer = Tokenizer(engine_dir, Manifest.load(engine_dir))
    text = "naïve café ✓ 日本語 — ok"
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several byte-level tokens
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.push(t) for t in ids] + [detok.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
