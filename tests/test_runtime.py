"""The in-process generation runtime (LLMEngine) on a real tiny export and ONNX Runtime.

on_output runs on the engine thread, between steps: a test that needs something to happen at
a given point of a generation does it there (submit, cancel, or hold the engine), never by
racing the engine from the test's thread."""
from __future__ import annotations

import math
import sys
import threading

import pytest

from runtime.greedy import greedy_tokens
from kvforge.errors import EngineError, QueueFullError, RequestError
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
    assert event.wait(120), f"timed out waiting for {what}"


def test_greedy_batched_equals_unbatched_reference(engine_dir):
    with LLMEngine(engine_dir, slots=3, prefill_budget=32) as engine:
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
    manifest = Manifest.load(engine_dir)
    idle = 64 * manifest.kv_bytes_per_token  # one row of the smallest bucket
    assert stats["kv_bytes_allocated"] == idle and stats["kv_utilization"] == idle / stats["kv_cache_bytes"]
    # the reservation every layout lives in: three slots at max_seq_len, less than the budget
    assert stats["kv_bytes_held"] == 3 * manifest.max_seq_len * manifest.kv_bytes_per_token < stats["kv_cache_bytes"]


def test_resizes_within_the_reservation_keep_every_row(engine_dir):
    """The engine's buffers are views of one reservation, moved in place on a resize: each layout
    holds exactly what a runner copying into new buffers holds (random KV, every row)."""
    reserved = resizes_keep_every_row(engine_dir, slots=8, capacity=256)
    assert reserved.kv_bytes_held == 8 * 256 * reserved.manifest.kv_bytes_per_token


def resizes_keep_every_row(directory, slots: int, capacity: int):
    """A runner reserving `slots` x `capacity` positions' worth of KV and one copying into new
    buffers, through layouts of up to that size: each holds the same KV in every row (the newest
    row random, the others kept), and the reserved one's buffers are views of its reservation.
    Returns the reserved runner."""
    import numpy as np

    from kvforge.manifest import slot_bytes

    reserved, fresh = open_runner(directory), open_runner(directory)
    reserved.reserve(slots * slot_bytes(reserved.manifest.cache_tensors, capacity), slots)
    tensors = {t.name: t for t in reserved.manifest.cache_tensors}
    rng = np.random.default_rng(0)
    quarter, half = capacity // 4, capacity // 2
    layouts = [(slots // 4, quarter, 2), (slots // 2, capacity, 2), (slots // 2, capacity, 3), (3, half, 3),
               (slots, quarter, 3), (slots // 4, quarter, 2)]  # slots, capacity, rows
    for runner in (reserved, fresh):
        runner.allocate(*layouts[0][:2])
    valid = {}  # row -> the positions it holds (beyond them a reserved layout holds stale KV, never read)
    for slots, capacity, rows in layouts:
        for runner in (reserved, fresh):
            runner.resize(capacity, rows, slots=slots)
        valid = {r: min(n, capacity) for r, n in valid.items() if r < rows} | {rows - 1: capacity}
        for name in fresh.kv_arrays:
            row = rng.standard_normal(fresh.kv_arrays[name][rows - 1].shape).astype(fresh.kv_arrays[name].dtype)
            for runner in (reserved, fresh):
                runner.kv_arrays[name][rows - 1] = row  # the newest row gets new KV; the others are kept
                assert runner.kv_arrays[name].shape == (slots, row.shape[0], tensors[name].held(capacity), row.shape[2])
            for r, n in valid.items():
                assert np.array_equal(reserved.kv_arrays[name][r, :, :n], fresh.kv_arrays[name][r, :, :n])
    assert all(np.shares_memory(reserved.kv_arrays[name], reserved.reservation.flat[name])  # views, not new arrays
               for name in tensors)
    assert fresh.kv_bytes_held == fresh.kv_bytes_allocated
    return reserved


def resident_bytes(array) -> int:
    """The resident bytes of the mapping holding `array` (/proc/self/smaps)."""
    mapping = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                mapping = start <= array.ctypes.data < end
            elif mapping and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("the array's mapping is not in /proc/self/smaps")


def test_the_reservation_is_resident_before_any_step(engine_dir):
    """The reservation's pages are mapped in the background at startup, so the first resize or
    row move into them does not stall every stream on page faults; what kv_bytes_held reports is
    what the process holds."""
    runner = open_runner(engine_dir)
    runner.reserve(64 << 20, slots=8)
    wait_for(runner.reservation.populated, "the reservation's pages")
    flat = runner.reservation.flat
    assert sum(resident_bytes(a) for a in flat.values()) >= runner.kv_bytes_held == sum(a.nbytes for a in flat.values())
    assert all(not a.any() for a in flat.values())  # mapped, contents untouched


def test_requests_join_and_leave_the_running_batch(engine_dir):
    with LLMEngine(engine_dir, slots=4) as engine:
        short = SamplingParams(max_tokens=8)
        alone = {p: r.token_ids for p, r in zip(PROMPTS[:3], engine.generate(PROMPTS[:3], short))}
        long_done, shorts_done = threading.Event(), threading.Semaphore(0)
        long_tokens: list[int] = []
        joined: dict[str, list[int]] = {p: [] for p in PROMPTS[:3]}
        long_tokens_when_short_done: list[int] = []

        def on_short(prompt):
            def on_output(out):
                joined[prompt] += out.token_ids
                if out.finished:
                    long_tokens_when_short_done.append(len(long_tokens))
                    shorts_done.release()
            return on_output

        def on_long(out):
            if not long_tokens:  # its first token: the short ones join while it decodes
                for prompt in PROMPTS[:3]:
                    engine.submit(prompt, short, on_short(prompt))
            long_tokens.extend(out.token_ids)
            if out.finished:
                long_done.set()

        engine.submit(PROMPTS[5], SamplingParams(max_tokens=200), on_long)
        wait_for(long_done, "the long request")
        for _ in PROMPTS[:3]:
            assert shorts_done.acquire(timeout=120)
        stats = engine.stats()
    assert joined == alone
    assert long_tokens == reference_greedy(engine_dir, engine.tokenizer.encode(PROMPTS[5]), 200,
                                           set(engine.tokenizer.eos_token_ids))
    assert len(long_tokens) == 200 and max(long_tokens_when_short_done) < 200  # they left while it ran on
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
    # 192 tokens: three rows of 64, as many as the bytes hold (not the power of two below, 2)
    with LLMEngine(engine_dir, slots=4, kv_cache_bytes=192 * bytes_per_token) as engine:
        engine.generate(PROMPTS[:4], SamplingParams(max_tokens=20))
        assert engine.stats()["max_rows"] == 3


def test_queue_full_is_a_clear_error(engine_dir):
    with LLMEngine(engine_dir, slots=1, max_waiting=2) as engine:
        running, release = threading.Event(), threading.Event()

        def hold(out):  # the engine waits here (between steps) until the test has filled the queue
            running.set()
            release.wait(120)

        try:
            first = engine.submit("x", SamplingParams(max_tokens=400), hold)
            wait_for(running, "the first request to run")
            queued = [engine.submit("y", SamplingParams(max_tokens=400)) for _ in range(2)]
            with pytest.raises(QueueFullError, match="waiting queue is full"):
                engine.submit("z", SamplingParams(max_tokens=4))
            for request_id in [first, *queued]:
                assert engine.cancel(request_id)
        finally:
            release.set()


def test_generate_and_close_wait_a_bounded_time(engine_dir):
    engine = LLMEngine(engine_dir)
    holding, release = threading.Event(), threading.Event()

    def hold(out):  # a stuck on_output: the engine thread cannot go on
        holding.set()
        release.wait(120)

    try:
        engine.submit("x", SamplingParams(max_tokens=4), hold)
        wait_for(holding, "the engine to be held")
        with pytest.raises(TimeoutError, match=r"did not finish within 0.2 s; its 1 unfinished request\(s\) were "
                                               "cancelled"):
            engine.generate(["y"], SamplingParams(max_tokens=4), timeout=0.2)  # nothing can run meanwhile
        with pytest.raises(EngineError, match="did not stop within 0.2 s of close"):
            engine.close(timeout=0.2)
    finally:
        release.set()
    engine.close()  # the thread was let go: now it stops


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

        ids = {}

        def on_running(out):  # its first token: both are cancelled, from the engine thread
            if not started.is_set():
                ids["cancelled"] = engine.cancel(ids["waiting"]) and engine.cancel(ids["running"])
            on_output(out)

        with engine._cond:  # both reach the scheduler before it runs a step
            ids["running"] = running = engine.submit(PROMPTS[0], SamplingParams(max_tokens=400), on_running)
            ids["waiting"] = engine.submit(PROMPTS[1], SamplingParams(max_tokens=400), on_output)
        wait_for(started, "the first token")
        wait_for(ended, "the cancellation")
        assert ids["cancelled"]
        assert engine.generate([PROMPTS[2]], SamplingParams(max_tokens=4))[0].finish_reason == "length"
        stats = engine.stats()
    assert [f.finish_reason for f in finals] == ["cancelled", "cancelled"]
    assert stats["cancelled"] == 2 and stats["running"] == 0
    assert stats["kv_bytes_allocated"] == 64 * Manifest.load(engine_dir).kv_bytes_per_token
    assert stats["generated_tokens"] == 1 + 4  # its first token, then the later request's 4
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


def test_encoding_releases_the_gil(engine_dir):
    """While a long prompt is tokenized, the process's other Python threads (the engine's step
    loop, the response sender) keep running. With a switch interval far longer than the encoding,
    the watcher can only run during it if the tokenizer let the GIL go (tokenizers' encode holds it
    throughout: the watcher would then first run after `done`)."""
    tokenizer = Tokenizer(engine_dir, Manifest.load(engine_dir))
    text = "def f(x):\n    return [x * i for i in range(10)]\n" * 40000
    encoding, seen, done = threading.Event(), threading.Event(), threading.Event()

    def watcher():
        encoding.wait()
        if not done.is_set():
            seen.set()

    interval = sys.getswitchinterval()
    thread = threading.Thread(target=watcher)
    thread.start()
    sys.setswitchinterval(60.0)
    try:
        encoding.set()
        ids = tokenizer.encode(text)
        done.set()
    finally:
        sys.setswitchinterval(interval)
    thread.join(30)
    assert len(ids) > 100000 and seen.is_set()


def test_a_prompt_being_tokenized_never_holds_a_running_stream(engine_dir):
    """Admission work (tokenizing, checking) runs on the submitting thread: while one request's
    tokenization is held, a running stream generates to its end."""
    with LLMEngine(engine_dir, slots=4) as engine:
        held, release = threading.Event(), threading.Event()
        encode = engine.tokenizer.encode

        def held_encode(text, add_special_tokens=True):
            if text == "held":
                held.set()
                assert release.wait(120)
            return encode(text, add_special_tokens)

        engine.tokenizer.encode = held_encode
        started, finished = threading.Event(), threading.Event()
        engine.submit(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True),
                      lambda out: (started.set(), out.finished and finished.set()))
        wait_for(started, "the stream's first token")
        late = threading.Thread(target=lambda: engine.generate(["held"], SamplingParams(max_tokens=2)))
        late.start()
        wait_for(held, "the held tokenization")
        wait_for(finished, "the stream to finish while another prompt is being tokenized")
        assert not release.is_set()
        release.set()
        late.join(120)
