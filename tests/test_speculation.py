"""Prompt-lookup speculation (issue 23): drafted tokens verified in one step through the in-place
cache give exactly the greedy (and seeded) tokens of decoding one token per step, cache only
what was accepted, and bad settings are refused. Asserted on tokens, counters and
cached KV, never on how fast anything ran."""
from __future__ import annotations

import urllib.request

import numpy as np
import openai
import pytest

from kvforge.engine_config import EngineConfig
from kvforge.errors import RequestError
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners.base import Batch
from runtime.speculation import (FIRST_PAUSE_TOKENS, MAX_PAUSE_TOKENS, MISSES_BEFORE_PAUSE, NgramIndex, Speculation,
                                 continuations, draft_length, pause_after)
from tests.test_hardening import refusal
from tests.waiting import wait_for
from launcher.tritonserver import free_ports

GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


BATCH = prompts(3, (40, 23, 61))


def propose(tokens: list[int], k: int) -> list[int]:
    return NgramIndex().propose(tokens, k)


def test_propose_continues_the_most_recent_occurrence_of_the_longest_tail():
    assert propose([5, 6, 7, 8, 1, 5, 6, 9, 2, 5, 6], 3) == [9, 2, 5]  # "5 6" last seen before "9 2"
    assert propose([1, 2, 3, 9, 9, 4, 2, 3], 2) == [9, 9]  # the 2-gram "2 3" wins over the 1-gram "3"
    assert propose([4, 1, 7, 7, 1], 4) == [7, 7, 1]  # a 1-gram; the draft ends where the tokens do
    assert propose([1, 2, 3, 4], 4) == [] and propose([1, 2, 1], 0) == [] and propose([3], 2) == []
    index, tokens = NgramIndex(), [1, 2, 3, 1, 2]
    assert index.propose(tokens, 2) == [3, 1]
    tokens += [3, 7, 1, 2]  # kept up to date as tokens arrive: the latest occurrence wins
    assert index.propose(tokens, 2) == [3, 7] and index.propose(tokens, 2) == [3, 7]
    rng = np.random.default_rng(0)  # incremental equals indexing from scratch
    tokens = rng.integers(0, 6, 40).tolist()
    grown = NgramIndex()
    for end in range(2, 41):
        assert grown.propose(tokens[:end], 3) == NgramIndex().propose(tokens[:end], 3)
    assert continuations(proposed=4, accepted=4) == (3, 3) and continuations(proposed=4, accepted=2) == (1, 2)
    assert continuations(proposed=3, accepted=0) == (0, 0) and continuations(proposed=1, accepted=1) == (0, 0)
    assert draft_length(0, 0, max_draft_tokens=4) == 4  # no history: the maximum
    assert draft_length(0, 0, max_draft_tokens=16) == 4  # 0.5 ** 3 >= MIN_REACH > 0.5 ** 4
    assert draft_length(90, 100, max_draft_tokens=16) == 16  # runs that hold: long drafts
    assert draft_length(0, 30, max_draft_tokens=4) == 1  # second tokens never hold: only the first
    assert draft_length(30, 100, max_draft_tokens=4) == 2
    assert pause_after(MISSES_BEFORE_PAUSE - 1) == 0 and pause_after(MISSES_BEFORE_PAUSE) == FIRST_PAUSE_TOKENS
    assert pause_after(MISSES_BEFORE_PAUSE + 1) == 2 * FIRST_PAUSE_TOKENS and pause_after(100) == MAX_PAUSE_TOKENS


@pytest.mark.parametrize("kv_dtype", ["fp32", "int8"])
def test_speculative_greedy_tokens_equal_plain_greedy_tokens(exports, kv_dtype):
    directory = exports("inplace", kv_dtype)
    with LLMEngine(directory) as plain:
        expected = [r.token_ids for r in plain.generate(BATCH, GREEDY)]
    with LLMEngine(directory, speculation=Speculation()) as engine:
        first = engine.generate(BATCH, GREEDY)
        again = engine.generate(BATCH, GREEDY)  # now each prompt's blocks are prefix hits
        stats = engine.stats()
    assert [r.token_ids for r in first] == [r.token_ids for r in again] == expected
    assert [r.cached_tokens for r in again] == [(r.prompt_tokens - 1) // 16 * 16 for r in again]
    # the tiny model's greedy text repeats itself: drafts were proposed, and most of them held
    assert stats["spec_draft_tokens"] > 0 and 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["steps"] < stats["generated_tokens"]  # fewer steps than tokens: what speculation is for


def test_a_verifying_step_is_not_taken_for_prompt_throughput(exports):
    """The prefill cost decides loading a prefix from disk / Redis against recomputing it: a
    decode step feeding drafted tokens must not pass for a fast prompt chunk."""
    with LLMEngine(exports("inplace", "fp32"), speculation=Speculation()) as engine:
        engine.generate(BATCH[:1], GREEDY)
        scheduler = engine.scheduler  # the engine thread is idle: no request is live
        moments = scheduler.recompute.per_token.moments.copy()
        assert scheduler.recompute.seconds(0, 64) is not None  # the prompt's step measured it
        verifying = Batch("decode", np.zeros((1, 5), np.int64), np.array([60]), np.array([5]), np.array([4]))
        scheduler.measured(verifying, 1e-6)
        np.testing.assert_array_equal(scheduler.recompute.per_token.moments, moments)
        chunk = Batch("prefill", np.zeros((1, 64), np.int64), np.array([0]), np.array([64]), np.array([0]))
        scheduler.measured(chunk, 1.0)
        assert scheduler.recompute.per_token.moments[3] == pytest.approx(0.7 * moments[3] + 0.3 / 64)


def test_max_tokens_and_stop_strings_cut_a_verified_run_where_plain_decoding_would(exports):
    directory = exports("inplace", "fp32")
    prompt = BATCH[0]
    with LLMEngine(directory) as plain:
        full = plain.generate([prompt], GREEDY)[0]
        text = full.text
        stops = [text[i:i + 3] for i in range(6, len(text) - 3, max(1, len(text) // 8))]
        cut = [SamplingParams(max_tokens=n, ignore_eos=True) for n in range(1, 20)]
        stopped = [SamplingParams(max_tokens=48, ignore_eos=True, stop=(s,)) for s in stops]
        expected = [(r.token_ids, r.text, r.finish_reason) for r in plain.generate([prompt] * len(cut + stopped),
                                                                                    cut + stopped)]
    with LLMEngine(directory, speculation=Speculation(max_rows=1)) as engine:  # one row at a time: every one drafts
        got = [engine.generate([prompt], p)[0] for p in cut + stopped]
        stats = engine.stats()
    assert [(r.token_ids, r.text, r.finish_reason) for r in got] == expected
    assert stats["spec_accepted_tokens"] > 0


def test_the_prefix_cache_holds_only_accepted_tokens(exports):
    """Every block stored while speculating is the block plain decoding computes for the same
    tokens: a rejected draft's K/V never reaches the pool."""
    directory = exports("inplace", "fp32")
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    with LLMEngine(directory, speculation=Speculation()) as engine:
        out = engine.generate([BATCH[2]], params)[0]
        assert engine.stats()["spec_draft_tokens"] > engine.stats()["spec_accepted_tokens"] > 0  # some rejected
        tokens = BATCH[2] + out.token_ids
        hashes, blocks = engine.cached_blocks(tokens, None)
    with LLMEngine(directory) as plain:
        plain.generate([BATCH[2]], params)
        plain_hashes, plain_blocks = plain.cached_blocks(tokens, None)
    assert hashes == plain_hashes and len(hashes) == (len(tokens) - 1) // 16
    for name, array in blocks.items():
        assert np.abs(array.astype(np.float32) - plain_blocks[name].astype(np.float32)).max() < 1e-4, name


def test_seeded_sampling_draws_the_same_tokens_with_and_without_speculation(exports):
    """Each position is sampled as decoding one token per step samples it (same context, the
    request's generator in the same order): a seed reproduces its output, speculation or not."""
    directory = exports("inplace", "fp32")
    sampled = [SamplingParams(max_tokens=48, temperature=t, top_p=p, seed=seed, ignore_eos=True)
               for t, p, seed in ((0.05, 1.0, 1), (0.1, 0.9, 2), (0.2, 1.0, 3))]  # low: the tiny model repeats itself
    with LLMEngine(directory) as plain:
        expected = [r.token_ids for r in plain.generate(BATCH, sampled)]
    with LLMEngine(directory, speculation=Speculation()) as engine:
        got = [r.token_ids for r in engine.generate(BATCH, sampled)]
        stats = engine.stats()
    assert got == expected and stats["spec_accepted_tokens"] > 0


def test_speculation_stops_beyond_max_rows(exports):
    directory = exports("inplace", "fp32")
    with LLMEngine(directory, speculation=Speculation(max_rows=1)) as engine:
        engine.generate(BATCH[:2], SamplingParams(max_tokens=24, ignore_eos=True))  # two rows, finishing together
        assert engine.stats()["spec_verify_rows"] == 0
    with LLMEngine(directory) as engine:  # off by default, but a request may ask
        engine.generate([BATCH[0]], SamplingParams(max_tokens=24, ignore_eos=True, speculative="ngram"))
        assert engine.stats()["spec_verify_rows"] > 0


def test_a_request_cancelled_while_it_speculates_ends_alone(exports):
    directory = exports("inplace", "fp32")
    with LLMEngine(directory, speculation=Speculation()) as engine:
        outputs = []

        def on_output(out):
            outputs.append(out)
            if len(outputs) == 3:
                engine.cancel(out.request_id)

        request_id = engine.submit(BATCH[0], SamplingParams(max_tokens=400, ignore_eos=True), on_output)
        other = engine.generate([BATCH[1]], GREEDY)[0]
        wait_for(lambda: outputs and outputs[-1].finished, "the cancelled request to end")
        assert outputs[-1].finish_reason == "cancelled" and outputs[-1].request_id == request_id
        assert sum(len(o.token_ids) for o in outputs) < 400 and len(other.token_ids) == GREEDY.max_tokens
        assert engine.stats()["running"] == 0


def test_bad_speculative_settings_are_refused_clearly(exports, tmp_path):
    with pytest.raises(RequestError, match="speculative must be 'ngram' or 'off'"):
        SamplingParams(speculative="medusa").validate()
    with pytest.raises(ValueError, match="max_draft_tokens must be a whole number in 1..16"):
        LLMEngine(exports("inplace", "fp32"), speculation=Speculation(max_draft_tokens=0))
    with pytest.raises(ValueError, match="KVFORGE_SPECULATIVE must be one of off, ngram"):
        EngineConfig.served({}, {"KVFORGE_SPECULATIVE": "eagle"})
    config = EngineConfig.served({}, {"KVFORGE_SPECULATIVE": "ngram", "KVFORGE_SPECULATIVE_TOKENS": "6"})
    with LLMEngine(exports("inplace", "fp32"), config) as engine:
        assert engine.speculates_by_default and engine.scheduler.speculation.max_draft_tokens == 6
    ports = sum((["--" + f, str(p)] for f, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])
    common = ["--repo", str(tmp_path), *ports]
    assert "add --speculative ngram" in refusal(*common, "--speculative-tokens", "3")
    assert "1..16" in refusal(*common, "--speculative", "ngram", "--speculative-tokens", "40")


def test_through_triton_a_request_asks_for_speculation_and_gets_the_same_text(triton):
    from clients.api import GenerationError, LLMClient

    client = LLMClient(triton.grpc_url)
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    plain = client.generate(prompt, max_tokens=40, ignore_eos=True)
    drafted = client.generate(prompt, max_tokens=40, ignore_eos=True, speculative="ngram")
    assert drafted.text == plain.text and len(drafted.token_ids) == 40


    def drafted_tokens() -> float:  # the metrics are published every METRICS_SECONDS
        with urllib.request.urlopen(triton.metrics_url, timeout=10) as response:
            return sum(float(line.rsplit(" ", 1)[1]) for line in response.read().decode().splitlines()
                       if line.startswith("kvforge_spec_draft_tokens_total{"))

    wait_for(lambda: drafted_tokens() > 0, "the server to count the request's drafted tokens")
    with pytest.raises(GenerationError, match="speculative must be 'ngram' or 'off'"):
        client.generate(prompt, max_tokens=4, speculative="lookahead")
    assert client.generate(prompt, max_tokens=4).text  # the server kept serving
    api = openai.OpenAI(base_url=triton.openai_url, api_key="unused", max_retries=0)
    completion = api.completions.create(model="llm", prompt=prompt, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True, "speculative": "ngram"})
    assert completion.choices[0].text == plain.text
    with pytest.raises(openai.BadRequestError, match="speculative"):
        api.completions.create(model="llm", prompt=prompt, max_tokens=4, extra_body={"speculative": "eagle"})
