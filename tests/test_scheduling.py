"""Stall-free scheduling over packed steps (issue 20): a step runs every decoding row plus prompt
chunks up to the prefill budget; the packed in-place graph makes that cost only the real tokens.
The budget follows an inter-token-latency target over the measured step costs (issue 37): its
arithmetic is pinned with stand-in costs. (How rows rotate and move, KV and all, is
tests/test_kv_rows.py's, over the arithmetic stand-in runner.)

Asserted through what the scheduler and runner did (spies on the real runner), never how fast."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from kvforge.engine_config import EngineConfig
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners import open_runner
from runtime.runners.base import last_positions
from runtime.scheduler import (ITL_TARGET_DECODE_STEPS, MAX_PREFILL_BUDGET, MIN_PREFILL_BUDGET, PREFILL_BUDGET,
                               StepCosts, check_prefill_budget)
from tests.test_hardening import refusal
from launcher.tritonserver import free_ports


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 250, n).tolist() for n in lengths]


def test_a_mixed_packed_step_equals_separate_steps(exports):
    """Row 0 decodes one token while row 1 feeds a 7-token chunk, in one step: the same logits as
    running each row alone (the padded layout would have fed row 0 seven positions)."""
    directory = exports("inplace", "fp32")
    a, b = prompts(1, (12, 12))
    mixed = open_runner(directory, threads=1)
    mixed.allocate(2, 64)
    ids = np.zeros((2, 12), np.int64)
    ids[0], ids[1, :5] = a, b[:5]
    mixed.step(ids, np.zeros(2, np.int64), np.array([12, 5]), last_positions(np.array([12, 5])))
    step = np.zeros((2, 7), np.int64)
    step[0, 0], step[1] = 7, b[5:]
    num_new = np.array([1, 7])
    together = mixed.step(step, np.array([12, 5]), num_new, last_positions(num_new))

    alone = []
    for row, (prompt, chunk, start) in enumerate(((a, [7], 12), (b[:5], b[5:], 5))):
        runner = open_runner(directory, threads=1)
        runner.allocate(1, 64)
        runner.step(np.array([prompt]), np.zeros(1, np.int64), np.array([len(prompt)]))
        n = np.array([len(chunk)])
        alone.append(runner.step(np.array([chunk]), np.array([start]), n, last_positions(n))[0])
    assert np.abs(together - np.stack(alone)).max() < 1e-5


class StepSpy:
    """Records, for every step, each row's pending tokens before it and the tokens it was fed."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.steps, self.fits = engine, [], []  # fits: the capacity held every row's end
        self.chunk_spans = []  # per step, the cache position each prompt chunk ends at
        self.step = engine.runner.step
        engine.runner.step = self

    def __call__(self, input_ids, write_positions, num_new, logit_positions=None, prompt_lengths=None):
        running = self.engine.scheduler.running[:len(num_new)]
        pending = [s.pending for s in running]
        self.steps.append((pending, list(map(int, num_new))))
        self.chunk_spans.append([s.num_cached + n for s, n in zip(running, num_new) if n > 1])
        self.fits.append(self.engine.runner.capacity >= max(s.num_cached + s.pending + 1 for s in running))
        return self.step(input_ids, write_positions, num_new, logit_positions, prompt_lengths)


def test_decoding_rows_are_in_every_step_and_prompts_always_advance(fp32):
    budget = 32
    with LLMEngine(fp32, slots=8, prefill_budget=budget) as engine:  # 8: a spare row to move rows through
        spy = StepSpy(engine)
        done, started = threading.Semaphore(0), []
        streams, long_prompts = prompts(2, (20, 24)), prompts(3, (300, 200))

        def watch(out):
            if out.finished:
                done.release()

        def stream_started(out):
            if out.token_ids and out.request_id not in started:
                started.append(out.request_id)
                if len(started) == len(streams):  # both decode: the long prompts arrive at this step
                    for p in long_prompts:  # (the engine thread, between two steps: whatever the speed)
                        engine.submit(p, SamplingParams(max_tokens=4, ignore_eos=True), watch)
            watch(out)

        for p in streams:  # two streams decoding long answers
            engine.submit(p, SamplingParams(max_tokens=120, ignore_eos=True), stream_started)
        for _ in streams + long_prompts:
            assert done.acquire(timeout=300)
        stats = engine.stats()
    mixed = 0
    for pending, fed in spy.steps:
        # prompt rows first (pack_step's chunk rows are a prefix): no decoding row before a prompt row
        assert not any(a == 1 < b for a, b in zip(pending, pending[1:])), pending
        decoding = [f for p, f in zip(pending, fed) if p == 1]
        prompt = [(p, f) for p, f in zip(pending, fed) if p > 1]
        assert all(f == 1 for f in decoding), (pending, fed)  # no decoding row waits for a prompt
        if prompt:
            assert sum(f for _, f in prompt) <= (budget if decoding else engine.scheduler.solo_prefill_tokens)
            first_pending, first_fed = prompt[0]  # the oldest prompt gets its full share: bounded wait
            assert first_fed == min(first_pending, budget if decoding else engine.scheduler.solo_prefill_tokens)
            mixed += bool(decoding)
    assert mixed >= (300 + 200) // budget  # the long prompts prefilled beside the streams
    assert stats["mixed_steps"] == mixed
    assert stats["row_moves"] >= 1  # the 300-token prompt decoded ahead of the 200-token one: moved behind it
    # the 200-token prompt never shared a step with the 300-token one's last chunk (its queries
    # would have attended over 300 positions)
    assert not any(len(spans) > 1 and max(spans) > 100 for spans in spy.chunk_spans), spy.chunk_spans
    # the capacity grew at once to hold each prompt's end, not bucket by bucket as the prompt advanced
    assert all(fit for (pending, _), fit in zip(spy.steps, spy.fits) if max(pending) > 1)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_stall_free_gives_the_tokens_the_alternating_scheduler_gives(exports, dtype):
    directory = exports("inplace", dtype)
    batch = prompts(4, (5, 40, 90, 17, 130, 3))
    # different lengths, so later prompts join while earlier ones decode
    greedy = [SamplingParams(max_tokens=8 + 6 * i, ignore_eos=True) for i in range(6)]
    seeded = [SamplingParams(max_tokens=8 + 6 * i, temperature=0.9, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(6)]
    outputs = {}
    for stall_free in (True, False):
        with LLMEngine(directory, slots=4, prefill_budget=48, scheduler="stall-free" if stall_free else "alternate",
                       prefix_cache=False) as engine:
            outputs[stall_free] = [[r.token_ids for r in engine.generate(batch, params)] for params in (greedy, seeded)]
            steps = engine.stats()
        if stall_free:
            assert steps["mixed_steps"] > 0
    assert outputs[True] == outputs[False]


def test_the_prefill_budget_is_checked_at_start(tmp_path):
    for bad in (0, 1, MAX_PREFILL_BUDGET + 1):
        with pytest.raises(ValueError, match="prefill budget"):
            check_prefill_budget(bad)
    with pytest.raises(ValueError, match="KVFORGE_PREFILL_BUDGET must be a whole number"):
        EngineConfig.served({}, {"KVFORGE_PREFILL_BUDGET": "lots"})
    with pytest.raises(ValueError, match="KVFORGE_SCHEDULER must be one of stall-free, alternate"):
        EngineConfig.served({}, {"KVFORGE_SCHEDULER": "fifo"})
    assert EngineConfig.served({}, {"KVFORGE_PREFILL_BUDGET": "128", "KVFORGE_SCHEDULER": "alternate"}) == \
        EngineConfig(prefill_budget=128, scheduler="alternate")
    ports = sum((["--" + f, str(p)] for f, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])
    line = refusal("--repo", str(tmp_path), *ports, "--prefill-budget", "1")
    assert "--prefill-budget" in line and "2..8192" in line


def test_the_budget_fills_the_itl_target_beyond_a_decode_step():
    """Stand-in costs: a decode step of 20 ms, 2 ms per prompt token beside it."""
    costs = StepCosts()
    assert costs.budget() == PREFILL_BUDGET  # nothing measured yet: the fallback
    costs.measured(0, 1, 0.020)  # a decode step
    assert costs.decode_seconds == pytest.approx(0.020) and costs.budget() == PREFILL_BUDGET
    costs.measured(32, 1, 0.020 + 32 * 0.002)  # 32 prompt tokens beside one decoding row
    assert costs.prompt_token_seconds == pytest.approx(0.002)
    # (1.3 x 20 - 20) / 2 = 3, and a quarter more (at least one) while only one width was seen
    assert ITL_TARGET_DECODE_STEPS == 1.3 and costs.budget() == 3 + 1
    costs.measured(4, 1, 0.020 + 4 * 0.002)
    assert costs.fit() == pytest.approx((0.0, 0.002)) and costs.budget() == 3  # two widths, one line through 0
    costs.measured(64, 0, 0.020 + 64 * 0.004)  # a prompt-only step pays a decode step's weight read too
    assert 0.002 < costs.prompt_token_seconds < 0.004  # the estimate moves, smoothly
    for target, budget in ((dict(itl_target=0.060), 20), (dict(itl_target_steps=4.0), 30),
                           (dict(itl_target=0.015), MIN_PREFILL_BUDGET), (dict(itl_target=9.0), 4490)):
        pinned = StepCosts(**target)
        pinned.measured(0, 1, 0.020)
        pinned.measured(10, 1, 0.020 + 10 * 0.002)
        pinned.measured(20, 1, 0.020 + 20 * 0.002)
        assert pinned.budget() == budget, target
    cheap = StepCosts(itl_target=9.0)
    cheap.measured(0, 1, 0.020)
    cheap.measured(10, 1, 0.020)  # prompt tokens that seemed free: the budget stops at its bound
    assert cheap.budget() == MAX_PREFILL_BUDGET
    idle = StepCosts()
    idle.measured(0, 0, 0.5)  # a step with no decoding row and no prompt token is no decode step
    assert idle.decode_seconds is None


def long_context_step(tokens: int, keys: int) -> float:
    """A step beside one short stream at long context, as long-llama measured (2026-12-07): a
    4 ms decode step, a fixed 3 us per cached key (the chunk's span copy) and 42 ns per key per
    prompt token (50 ms and 0.68 ms a token at 16K keys)."""
    return 0.004 + keys * 3e-6 + tokens * keys * 42e-9


def test_a_chunk_pays_its_fixed_part_off_where_no_chunk_meets_the_itl_target():
    """The starved prompt of 2026-12-07: priced per token, 2-token steps at 16K keys looked 25 ms a
    token and the budget sat at its floor (a 64K prompt beside one stream: no first token in 10
    minutes). Fitted as fixed + per token, the chunk does twice its fixed part's work."""
    costs = StepCosts()
    costs.measured(0, 1, 0.004)
    for tokens in (2, 3):
        costs.measured(tokens, 1, long_context_step(tokens, 16384))
    fixed, per_token = costs.fit()
    assert fixed == pytest.approx(16384 * 3e-6, rel=1e-6) and per_token == pytest.approx(16384 * 42e-9, rel=1e-6)
    assert costs.budget() == int(2 * fixed / per_token)  # 72: the target's share (1.2 ms) buys none
    assert costs.budget(widest=64) == 64  # never past the chunk a prompt alone gets
    # closed loop from the old floor: the prompt reaches 64K keys in a few hundred steps, not 32,000
    costs, keys, steps = StepCosts(), 2048, 0
    costs.measured(0, 1, 0.004)
    while keys < 65536:
        tokens = costs.budget(512)
        costs.measured(tokens, 1, long_context_step(tokens, keys))
        keys, steps = keys + tokens, steps + 1
    assert steps < 1000 and costs.budget(512) >= 2 * costs.prompt_step_fixed_seconds / costs.prompt_token_seconds - 1


def test_a_fixed_part_shorter_than_a_decode_step_is_priced_per_token():
    """A fixed part shorter than a decode step changes the budget little, and one fitted to noise
    widens short-context steps: there the chunk is all per token, as before."""
    costs = StepCosts()
    costs.measured(0, 1, 0.020)
    for tokens in (2, 4):
        costs.measured(tokens, 1, 0.020 + 0.005 + tokens * 0.002)  # 5 ms fixed, within the target's 6 ms
    fixed, per_token = costs.fit()
    assert fixed == 0.0 and per_token > 0.002
    assert costs.budget() == MIN_PREFILL_BUDGET  # (26 - 20) / per_token, under 2
    past_room = StepCosts()  # 10 ms fixed: past the target's 6 ms of room, short of the 20 ms decode step
    past_room.measured(0, 1, 0.020)
    for tokens in (2, 4):
        past_room.measured(tokens, 1, 0.020 + 0.010 + tokens * 0.002)
    assert past_room.fit()[0] == 0.0


class StandInCosts(StepCosts):
    """Fixed costs: the engine's own measurements do not move them."""

    def __init__(self, decode: float, per_token: float, itl_target: float):
        super().__init__(itl_target)
        self.decode_seconds, self.per_token = decode, per_token

    def fit(self) -> tuple[float, float]:
        return 0.0, self.per_token

    def _spread(self) -> bool:
        return True  # nothing to probe

    def measured(self, prompt_tokens: int, decoding_rows: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("target, budget", [(0.050, 15), (0.030, 5)])
def test_steps_beside_decoding_rows_carry_the_budget_of_the_target(fp32, target, budget):
    with LLMEngine(fp32, slots=4) as engine:
        engine.scheduler.costs = StandInCosts(0.020, 0.002, target)
        spy = StepSpy(engine)
        started = threading.Event()
        stream = engine.submit(prompts(5, (10,))[0], SamplingParams(max_tokens=200, ignore_eos=True),
                               lambda out: started.set())
        assert started.wait(120)
        engine.generate(prompts(6, (150,)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.cancel(stream)
        assert engine.stats()["step_budget"] == budget
    beside = [sum(f for p, f in zip(pending, fed) if p > 1) for pending, fed in spy.steps if 1 in pending]
    prompt_steps = [n for n in beside if n]
    # every chunk beside the stream is the budget, but the prompt's last one (what was left of it)
    assert prompt_steps and all(n == budget for n in prompt_steps[:-1]) and 0 < prompt_steps[-1] <= budget
    assert len(prompt_steps) == -(-150 // budget)


def test_the_itl_target_is_checked_at_start(tmp_path):
    for bad in (dict(itl_target=0), dict(itl_target=11.0), dict(itl_target_steps=1.0), dict(itl_target_steps=101),
                dict(itl_target=0.05, itl_target_steps=2.0)):
        with pytest.raises(ValueError, match="inter-token latency target"):
            StepCosts(**bad)
    assert EngineConfig.served({}, {"KVFORGE_ITL_TARGET_MS": "40", "KVFORGE_ITL_TARGET_STEPS": ""}) == \
        EngineConfig(itl_target_ms=40.0)
    with pytest.raises(ValueError, match="KVFORGE_ITL_TARGET_STEPS must be a number of decode steps"):
        EngineConfig.served({}, {"KVFORGE_ITL_TARGET_STEPS": "fast"})
    ports = sum((["--" + f, str(p)] for f, p in zip(("http-port", "grpc-port", "metrics-port"), free_ports(3))), [])
    line = refusal("--repo", str(tmp_path), *ports, "--itl-target-ms", "40", "--prefill-budget", "32")
    assert "--prefill-budget" in line and "--itl-target-ms" in line
    line = refusal("--repo", str(tmp_path), *ports, "--itl-target-steps", "0.5")
    assert "--itl-target-steps" in line and "decode steps" in line
