"""Continuous batching over the runner's KV slots: the policy of what runs next. It only decides,
and returns what to copy: the packed rows (runtime/kv/rows.py, behind the KV manager
runtime/kv/manager.py) record the row moves, resizes and prefix-cache copies its decisions
imply, and the engine (runtime/llm_engine.py) runs each step: schedule -> copies, run ->
postprocess -> copies.

Running sequences occupy runner rows 0..n-1 (`running[i]` is row i, a read-only view of the
packed rows). Between steps, finished and cancelled sequences leave (the last row moves into the
hole) and waiting ones join, placed in front of the decoding rows (so prompt rows come first, in
arrival order). A step feeds each
row num_new[b] of its pending tokens (as a right-padded [rows, S] Batch; the runner packs the
real tokens); a row samples when it has consumed all it had.

Stall-free (the default; Sarathi-Serve): every step runs every decoding row (one token each)
plus prompt chunks up to a budget of prompt tokens, oldest prompt first, so a stream's next token
waits for at most one budget of prompt compute and no prompt waits behind decode steps (a later
prompt's chunk shares the step only when its span is like the others': similar_spans).

The budget follows an inter-token-latency target, as Sarathi-Serve derives its token budget from
the TBT SLO: StepCosts measures, as the engine runs, what a decode step takes and what each
prompt token adds to a step, and each step beside decoding rows gets the prompt tokens that keep
it within the target: ITL_TARGET_DECODE_STEPS measured decode steps (1.3), or an absolute
`itl_target` (seconds). A step costs about a decode step (the weights read once) plus ~1.2-2 ms
per prompt token on small-llama with 2 threads, so a fixed budget tuned one day (32 tokens:
~3.5x a decode step on 2026-12-04) lands elsewhere on another; the target holds on both. At
long context a chunk step also pays a fixed part (its span's copy) that alone passes the target:
there the chunk grows until it pays that off (StepCosts), and the streams' ITL grows. Until
both costs were measured, PREFILL_BUDGET is the budget; a fixed `prefill_budget` turns the
target off. The trade-off (stream ITL p99 vs long prompts' TTFT per target) is measured by
`python -m bench --sections stream_gaps`; docs/benchmarks.md keeps the tables of every
generation of this scheduler. When no row decodes, prompts go in chunks of
`solo_prefill_tokens`: nobody waits on the chunk.

At long context every step's chunk is also narrowed so that its attention scores (chunk rows x
chunk x keys x heads x 4 B, one layer at a time) stay within `scores_bytes`
(kvforge/limits.py prefill_chunk): the chunk shrinks as the prompt's cached part grows.

Speculation (runtime/speculation.py): in a step where every row decodes and at most
`speculation.max_rows` do, a row that speculates feeds its pending token plus tokens
drafted from its own context; postprocess keeps those the model agrees with (`_verified`).

Jump-forward (`EngineConfig.jump_forward`, runtime/grammar.py): when a guided request is admitted
and after its row samples, the tokens its grammar forces next are taken at once (`_forced`); the
row then has several pending tokens and is fed like a prompt chunk (the first ones with the
prompt; a step with such a chunk drafts for no row), its next token sampled from the chunk's
last position.

Alternate (`stall_free=False`; with prefill_budget=256, the policy before issue 20): prompt-chunk
steps take turns with decode steps, mixed only when padding both into one [rows, S] block wasted
at most MIX_PADDING_TOKENS.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from kvforge.engine_config import (DEFAULT_SCORES_BYTES, ITL_TARGET_DECODE_STEPS, MAX_PREFILL_BUDGET,
                                   MIN_PREFILL_BUDGET, SOLO_PREFILL_TOKENS, bounds_problem, setting_named)
from kvforge.errors import QueueFullError
from kvforge.limits import prefill_chunk
from runtime.kv.manager import KVManager
from runtime.kv.rows import KVCopies
from runtime.runners.base import Batch
from runtime.sequence import RequestOutput, Sequence, Status
from runtime.speculation import Speculation, continuations, draft_length, pause_after

MIX_PADDING_TOKENS = 16
PREFILL_BUDGET = 32  # prompt tokens beside decoding rows before the step costs are measured
# how much one step's measurement moves the running estimates (exponentially weighted)
COST_WEIGHT = 0.3
# what a cost line is fitted over (chunk widths, key spans) spreads over at least this share of
# its mean (a standard deviation) before the line has a slope
SPREAD = 0.05
# a prompt chunk beside decoding rows does at least this many times its step's fixed part in
# per-token work (so it runs at >= 2/3 of the speed its fixed part allows at any width)
EFFICIENT_CHUNK_WORK = 2
# A request loading its prefix from disk / Redis waits at most as long as recomputing it is
# estimated to take (from the measured prefill rate), but never less than this (thread hand-offs);
# before any prefill was measured, up to the longer bound.
LOAD_DEADLINE_FLOOR, LOAD_DEADLINE_UNMEASURED = 0.01, 2.0


def check_prefill_budget(budget: int) -> None:
    """The budget as kvforge/engine_config.py declares it (prompt tokens per step)."""
    if problem := bounds_problem(setting_named("prefill_budget"), budget):
        raise ValueError(f"the prefill budget (prompt tokens per step) {problem}")


def check_itl_target(seconds: float | None, decode_steps: float | None) -> None:
    """The target as kvforge/engine_config.py declares it (itl_target_ms, itl_target_steps)."""
    if seconds is not None and decode_steps is not None:
        raise ValueError("give the inter-token latency target in seconds or in decode steps, not both")
    milliseconds = seconds * 1000 if isinstance(seconds, (int, float)) else seconds
    for name, value in (("itl_target_ms", milliseconds), ("itl_target_steps", decode_steps)):
        if problem := bounds_problem(setting_named(name), value):
            raise ValueError(f"the inter-token latency target {problem}")


class WeightedLine:
    """y = intercept + slope x, fitted by least squares over the points seen, each new point
    weighted COST_WEIGHT and the older ones fading by 1 - COST_WEIGHT per point (an estimate that
    follows the host as a running mean does)."""

    def __init__(self):
        self.moments = np.zeros(5)  # weighted sums of 1, x, x^2, y, x y

    def add(self, x: float, y: float) -> None:
        self.moments = (1 - COST_WEIGHT) * self.moments + COST_WEIGHT * np.array([1, x, x * x, y, x * y])

    @property
    def empty(self) -> bool:
        return self.moments[0] == 0

    def means(self) -> tuple[float, float]:
        n, x, _, y, _ = self.moments
        return x / n, y / n

    def spread(self, share: float) -> bool:
        """Whether the xs' standard deviation exceeds `share` of their mean (a slope means something)."""
        n, x, xx = self.moments[:3]
        return xx / n - (x / n) ** 2 > (share * x / n) ** 2

    def slope(self) -> float:
        n, x, xx, y, xy = self.moments
        return (xy / n - x * y / n ** 2) / (xx / n - (x / n) ** 2)


class StepCosts:
    """What steps cost on this host, as measured: a decode step (every decoding row, one token
    each) and what prompt chunks add to a step, fixed + tokens x per_token, and from them the
    prompt tokens a step beside decoding rows carries.

    The fixed part is what a chunk step pays whatever its width: the copy of the chunk rows'
    cached span (export/model/steps.py). It grows with the context, as the per-token part does:
    long-llama beside a short stream, 2 threads, a 2-token chunk added 26 ms at 8K cached tokens
    and 50 ms at 16K, a 512-token one 0.21 s and 0.40 s. Priced per token (as this model did
    before 2026-12-07), those 2-token steps looked 25 ms a token, the budget fell to its floor
    and a 16K prompt beside one stream took 258 s, against 7 s with 512-token chunks: at 64K it
    gave no first token in 10 minutes. So the costs are fitted as a line over the chunk widths
    measured (least squares, each step weighted like the decode estimate: COST_WEIGHT). Where
    the fixed part alone takes more than the target leaves for prompt tokens (and more than a
    decode step: fit()), no chunk meets the target, and a chunk is then as wide as makes its
    per-token work EFFICIENT_CHUNK_WORK times its fixed part: the prompt makes progress and the streams' ITL grows with the context. A line
    needs more than one width: while the recent chunks were all alike, every step widens its
    chunk by a quarter (a probe) until they spread again."""

    def __init__(self, itl_target: float | None = None, itl_target_steps: float | None = None):
        check_itl_target(itl_target, itl_target_steps)
        self.itl_target = itl_target  # seconds; None: itl_target_steps measured decode steps
        self.itl_target_steps = itl_target_steps or ITL_TARGET_DECODE_STEPS
        self.decode_seconds: float | None = None
        self.chunks = WeightedLine()  # seconds a prompt step adds over a decode step, by its tokens

    def measured(self, prompt_tokens: int, decoding_rows: int, seconds: float) -> None:
        """One step's time: a step without prompt tokens is a decode step; a step with them adds
        (its tokens, seconds - a decode step) to the fit (a prompt-only step counts its weight
        read as a decode step's, which every step pays)."""
        if prompt_tokens == 0:
            if decoding_rows:
                self.decode_seconds = seconds if self.decode_seconds is None else \
                    (1 - COST_WEIGHT) * self.decode_seconds + COST_WEIGHT * seconds
            return
        if self.decode_seconds is not None:
            self.chunks.add(prompt_tokens, max(seconds - self.decode_seconds, 0.0))

    def _spread(self) -> bool:
        """Whether the chunk widths measured differ enough to fit a line through them."""
        return self.chunks.spread(SPREAD)

    def fit(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds a prompt chunk adds to a step; None before one was measured.
        All per token unless the widths spread and the line through them leaves a fixed part
        longer than what the target leaves a step for prompt tokens and than a decode step: a
        shorter one changes the budget little, and one fitted to noise widens short-context steps
        (trusted past the target's room alone, the stream_gaps section's worst gap went from
        4.8x to 40x a decode step)."""
        if self.chunks.empty:
            return None
        mean_tokens, mean_added = self.chunks.means()
        if self._spread():
            fixed = mean_added - max(self.chunks.slope(), 0.0) * mean_tokens
            if fixed > max(self._allowance(), self.decode_seconds):
                return fixed, max((mean_added - fixed) / mean_tokens, 1e-6)
        return 0.0, max(mean_added / mean_tokens, 1e-6)

    @property
    def prompt_token_seconds(self) -> float | None:
        return None if (fitted := self.fit()) is None else fitted[1]

    @property
    def prompt_step_fixed_seconds(self) -> float | None:
        return None if (fitted := self.fit()) is None else fitted[0]

    def target_seconds(self) -> float | None:
        if self.itl_target is not None:
            return self.itl_target
        return None if self.decode_seconds is None else self.itl_target_steps * self.decode_seconds

    def _allowance(self) -> float:
        """What the target leaves a step beside the decoding rows for prompt tokens."""
        return self.target_seconds() - self.decode_seconds

    def budget(self, widest: int = MAX_PREFILL_BUDGET) -> int:
        """Prompt tokens for a step beside decoding rows, within MIN..MAX_PREFILL_BUDGET (a
        quarter more while probing: the class docstring); PREFILL_BUDGET until both costs are
        known. What fits in the allowance, or where the fixed part alone passes it (no chunk
        meets the target), EFFICIENT_CHUNK_WORK fixed parts' worth, up to `widest` (the chunk a
        prompt alone gets)."""
        fitted = self.fit()
        if self.decode_seconds is None or fitted is None:
            return PREFILL_BUDGET
        fixed, per_token = fitted
        tokens = min(EFFICIENT_CHUNK_WORK * fixed, widest * per_token) if fixed else self._allowance()
        tokens = max(int(tokens / per_token + 1e-9), MIN_PREFILL_BUDGET)  # + float noise
        if not self._spread():
            tokens += max(1, tokens // 4)
        return min(tokens, MAX_PREFILL_BUDGET)


class RecomputeCost:
    """What recomputing prompt tokens costs, as measured: per prompt token of a step, a + b x the
    keys its chunk attends over (the weight matmuls, then attention, which grows with the
    context), fitted by least squares over the prefill steps seen, each weighted like StepCosts'
    estimates (COST_WEIGHT). Recomputing tokens first..last then costs the integral,
    a (last - first) + b (last^2 - first^2) / 2: a 100K-token prefix is quadratic in its length,
    where a rate measured on short chunks would price it linearly (many times too cheap)."""

    def __init__(self):
        self.per_token = WeightedLine()  # a step's seconds per prompt token, by the keys its chunk attends over

    def measured(self, tokens: int, keys: int, seconds: float) -> None:
        """A step whose prompt chunks held `tokens` tokens attending over up to `keys` keys."""
        self.per_token.add(keys, seconds / tokens)

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b), or None before any measurement; b = 0 (a flat rate) until the steps measured
        spread over different key spans."""
        if self.per_token.empty:
            return None
        keys, seconds = self.per_token.means()
        b = max(0.0, self.per_token.slope()) if self.per_token.spread(SPREAD) else 0.0
        return max(seconds - b * keys, 0.0), b

    def seconds(self, first: int, last: int) -> float | None:
        """Estimated seconds to prefill prompt tokens first..last-1 (None: nothing measured yet)."""
        fitted = self.coefficients()
        if fitted is None:
            return None
        a, b = fitted
        return a * (last - first) + b * (last * last - first * first) / 2


def similar_spans(spans: list[int], budget: int) -> bool:
    """Whether prompt chunks ending at these cache positions may share a step: the chunk rows'
    queries all attend over the longest span (pack_step), so a chunk joins only while that at
    most doubles its own, give or take one budget (fresh prompts pack together; a fresh prompt
    waits for the step after a long one's last chunk: small-llama 4K, 2 threads, 16 tokens at
    1,984 plus 16 fresh: 63 ms, against 35 + 25 ms as two steps and 51 ms for 32 at 1,968)."""
    return max(spans) <= 2 * min(spans) + budget


class Scheduler:
    """Not thread-safe: the engine serializes calls (schedule and postprocess under its lock)."""

    def __init__(self, kv: KVManager, max_seq_len: int, max_waiting: int,
                 prefill_budget: int | None = None, itl_target: float | None = None,
                 itl_target_steps: float | None = None, solo_prefill_tokens: int = SOLO_PREFILL_TOKENS, stall_free: bool = True,
                 speculation: Speculation = Speculation(), scores_bytes: int = DEFAULT_SCORES_BYTES):
        """prefill_budget: a fixed number of prompt tokens per step beside the decoding rows;
        None (the default): the budget follows the ITL target (itl_target seconds, or
        itl_target_steps measured decode steps; neither: ITL_TARGET_DECODE_STEPS).
        scores_bytes: the attention scores a step's prompt chunks may make (prefill_chunk)."""
        if prefill_budget is not None:
            check_prefill_budget(prefill_budget)
            if itl_target is not None or itl_target_steps is not None:
                raise ValueError("give a fixed prefill budget or an inter-token latency target, not both")
        speculation.check()
        self.speculation = speculation
        self.max_seq_len = max_seq_len
        self.kv = kv
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget
        self.costs = StepCosts(itl_target, itl_target_steps)
        self.solo_prefill_tokens = max(prefill_budget or PREFILL_BUDGET, solo_prefill_tokens)  # when no row decodes
        self.stall_free = stall_free
        self.scores_bytes = scores_bytes
        self.heads = kv.rows.runner.manifest.model.num_heads
        self.waiting: deque[Sequence] = deque()
        self.requests: dict[int, Sequence] = {}
        self.cancelled: set[int] = set()
        self.last_kind = "decode"
        self.counters = dict(steps=0, prefill_steps=0, decode_steps=0, mixed_steps=0, max_rows=0,
                             multi_row_steps=0, prompt_tokens=0, generated_tokens=0, finished=0,
                             cancelled=0, expired=0, prefix_waits=0, tier_loads_expired=0, preempted_swap=0,
                             preempted_recompute=0, row_steps=0, spec_verify_rows=0, spec_draft_tokens=0,
                             spec_accepted_tokens=0, longrope_recomputes=0, forced_tokens=0)
        self.recompute = RecomputeCost()  # measured, for the load-or-recompute choice

    @property
    def running(self) -> tuple[Sequence, ...]:
        """The sequences in runner rows 0..n-1, in row order."""
        return self.kv.rows.running

    def check_room(self, elsewhere: int = 0) -> None:
        """Refuse a request when the queue is full; `elsewhere` requests waiting outside the
        scheduler (being prefilled by the prefill worker) count against its bound too."""
        if len(self.waiting) + elsewhere >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests); retry later")

    def add(self, seq: Sequence, elsewhere: int | None = 0) -> None:
        """Queue seq (elsewhere=None: a hand-off coming back, whose place was checked when it arrived)."""
        if elsewhere is not None:
            self.check_room(elsewhere)
        self.waiting.append(seq)
        self.requests[seq.request_id] = seq

    def cancel(self, request_id: int) -> bool:
        if request_id not in self.requests:
            return False
        self.cancelled.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.cancelled)

    # ------------------------------------------------------------------ before a step

    def schedule(self) -> tuple[list[tuple[Sequence, RequestOutput]], Batch | None, KVCopies]:
        """Apply cancellations, admit what fits, and pick the next step (None when idle); returns
        the outputs of requests that ended, the step and the KV copies to run before it.
        Admission is first come, first served, except that a request whose prefix a running
        sequence is computing right now lets the ones behind it go first and waits for it."""
        self.kv.copies_done()
        outputs = [(seq, self._cancel(seq)) for seq in map(self.requests.get, self.cancelled) if seq]
        self.cancelled.clear()
        outputs += self._expire(time.perf_counter())
        self._pass_longrope_original()
        while len(self.running) > 1 and not self.kv.rows.fits():
            self._preempt()
        for request_id in self.kv.loads.finish():
            if request_id in self.requests:
                self.requests[request_id].load_deadline = None
        now = time.monotonic()
        for seq in list(self.waiting):
            if seq.swapped_blocks is not None:  # preempted: it resumes first, with its own KV
                if not self.kv.rows.can_admit(seq):
                    break
                self.waiting.remove(seq)
                self._place(seq, [])
                continue
            if seq.load_deadline is not None:  # its prefix is coming from disk / Redis
                if now < seq.load_deadline:
                    continue
                seq.load_deadline = None  # slower than recomputing it: go without
                self.counters["tier_loads_expired"] += 1
            hit, wait = self.kv.prefix.match(seq)
            if wait:
                self.counters["prefix_waits"] += 1
                continue
            recompute = self._recompute_seconds(seq, len(hit))
            if self.kv.loads.start(seq, hit, recompute):
                seq.load_deadline = now + (LOAD_DEADLINE_UNMEASURED if recompute is None
                                           else max(recompute, LOAD_DEADLINE_FLOOR))
                continue
            if not self.kv.rows.can_admit(seq):
                break
            self.waiting.remove(seq)
            self._place(seq, hit)
            if not seq.num_output and (first := self._forced(seq)) is not None:  # joins the prompt's chunks
                outputs.append((seq, first))
        self._drop_finished()  # a request that its forced tokens ended (max_tokens, a stop string)
        batch = self._next_batch() if self.running else None
        return outputs, batch, self.kv.rows.take_copies()

    def _recompute_seconds(self, seq: Sequence, hit_blocks: int) -> float | None:
        return self.recompute.seconds(hit_blocks * self.kv.block_tokens, seq.num_prompt)

    @property
    def loading(self) -> int:
        return sum(s.load_deadline is not None for s in self.waiting)

    def _cancel(self, seq: Sequence) -> RequestOutput:
        if seq.status is Status.WAITING:
            self.waiting.remove(seq)
            self.kv.release(seq)  # a loading request's held blocks
            del self.requests[seq.request_id]
        else:
            self._remove(self.running.index(seq))
            self.kv.rows.shrink()
        self.counters["cancelled"] += 1
        return seq.finish("cancelled")

    def _expire(self, now: float) -> list[tuple[Sequence, RequestOutput]]:
        """End requests past their deadline: still waiting for a slot, or running too long."""
        outputs = []
        for seq in [s for s in self.waiting if s.queue_deadline is not None and now > s.queue_deadline]:
            self.waiting.remove(seq)
            self.kv.release(seq)  # what a loading or preempted request holds
            del self.requests[seq.request_id]
            outputs.append((seq, seq.finish("timeout", f"the request waited {now - seq.arrived:.1f} s for a "
                                                       "free slot (the queue timeout); retry later")))
        for seq in [s for s in self.running if s.deadline is not None and now > s.deadline]:
            outputs.append((seq, seq.finish("timeout", f"the request ran {now - seq.arrived:.1f} s, past the "
                                                       "server's request timeout, and was ended")))
        self.counters["expired"] += len(outputs)
        self._drop_finished()
        return outputs

    def _place(self, seq: Sequence, hit: list[int]) -> None:
        seq.status, seq.admitted = Status.RUNNING, time.perf_counter()
        self.kv.place(seq, hit)

    def _preempt(self) -> None:
        """The youngest running sequence goes back to the front of the queue (its KV swapped to
        the host pool, or dropped for recompute beyond the swap reserve)."""
        seq = max(self.running, key=lambda s: s.request_id)
        self.kv.preempt(seq)
        self.counters["preempted_swap" if seq.swapped_blocks is not None else "preempted_recompute"] += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _pass_longrope_original(self) -> None:
        """A longrope row on the short factors whose next token passes original_max_position_embeddings
        is recomputed from its tokens on the long ones, as transformers' generate() recomputes its
        cache there (kvforge.manifest.ModelSpec.long_factors): it goes back to the front of the queue without
        its KV, its chain hashes restart from the long factors' root, and it prefills again."""
        original = self.kv.rows.runner.manifest.model.longrope_original
        if original is None:
            return
        for seq in [s for s in self.running if s.rope_length <= original < len(s.tokens)]:
            self.kv.preempt(seq, recompute=True)
            seq.recomputed_at = len(seq.tokens)
            seq.block_hashes.clear()
            seq.tiers_checked = False  # its blocks under the long root may be on disk / Redis
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
            self.counters["longrope_recomputes"] += 1

    def _longrope_room(self, seq: Sequence) -> int:
        """Drafted tokens seq may verify in one step without passing longrope's original length on
        the short factors (the step after recomputes it first: _pass_longrope_original)."""
        original = self.kv.rows.runner.manifest.model.longrope_original
        if original is None or seq.rope_length > original:
            return self.max_seq_len
        return max(0, original - len(seq.tokens))

    def _next_batch(self) -> Batch:
        rows = self.kv.rows
        rows.prompts_first()
        running = rows.running
        pending = [s.pending for s in running]
        decoding = 1 in pending
        budget = self.step_budget() if decoding else self.solo_prefill_tokens
        room = min(rows.step_room(), self._scores_room(running, pending))
        if max(pending) == 1 and (drafted := self._speculative_batch(room)) is not None:
            return drafted
        if not self.stall_free:
            return self._alternating_batch(pending, budget, room)
        num_new, left, spans = [], budget, []
        for seq, p in zip(running, pending):  # prompts in row order (arrival order) share the budget
            take = 1 if p == 1 else min(p, left, room)
            if p > 1:
                if take > 1 and spans and not similar_spans(spans + [seq.num_cached + take], budget):
                    take = 0
                spans += [seq.num_cached + take] if take > 1 else []
                left -= take
            num_new.append(take)
        width = max(num_new)
        kind = "decode" if width == 1 else "mixed" if decoding else "prefill"
        rows.fit_capacity(max(s.num_cached for s in running) + width, rows.ends())
        return Batch.of(kind, running, width, num_new)

    def _scores_room(self, running: tuple[Sequence, ...], pending: list[int]) -> int:
        """The widest chunk per row whose attention scores stay within scores_bytes: over the
        rows feeding prompt chunks (every row, when none does: drafts are chunks too), each
        attending over the longest of their spans (pack_step)."""
        chunk_rows = [s for s, p in zip(running, pending) if p > 1] or running
        return prefill_chunk(max(s.num_cached for s in chunk_rows), len(chunk_rows), self.heads, self.scores_bytes)

    def step_budget(self) -> int:
        """Prompt tokens for the next step beside decoding rows."""
        return self.prefill_budget if self.prefill_budget is not None else self.costs.budget(self.solo_prefill_tokens)

    def _speculative_batch(self, room: int) -> Batch | None:
        """A decode step in which the rows that speculate feed drafted tokens after their own
        (None: no row drafted any). Drafts stay within the buffers' capacity, the request's
        max_tokens and a few decoding rows."""
        if len(self.running) > self.speculation.max_rows or not any(s.ngrams for s in self.running):
            return None
        room = min(room, self.kv.rows.capacity - max(s.num_cached for s in self.running))
        drafts = [s.draft(min(s.draft_limit, s.max_tokens_total - len(s.tokens) - 1, room - 1, self._longrope_room(s)))
                  if s.ngrams and s.num_output >= s.draft_resumes else [] for s in self.running]
        if not any(drafts):
            return None
        num_new = [1 + len(d) for d in drafts]
        return Batch.of("decode", self.running, max(num_new), num_new, drafts)

    def _alternating_batch(self, pending: list[int], budget: int, room: int) -> Batch:
        """The policy before stall-free steps: a prompt chunk and the decode rows take turns,
        mixed only when padding them into one [rows, S] block wastes at most MIX_PADDING_TOKENS."""
        prefill_rows = max((i + 1 for i, p in enumerate(pending) if p > 1), default=0)
        if prefill_rows == 0:
            kind, rows, width = "decode", len(pending), 1
        else:
            width = min(max(pending[:prefill_rows]), max(1, budget // prefill_rows))
            waste = sum(width - min(p, width) for p in pending)
            if waste <= MIX_PADDING_TOKENS:
                kind, rows = "mixed" if 1 in pending else "prefill", len(pending)
            elif self.last_kind == "prefill" and 1 in pending:
                kind, rows, width = "decode", len(pending), 1
            else:
                kind, rows = "prefill", prefill_rows
        seqs = self.running[:rows]
        width = min(width, room)
        self.kv.rows.fit_capacity(max(s.num_cached for s in seqs) + width, self.kv.rows.ends())
        return Batch.of(kind, seqs, width)

    # ------------------------------------------------------------------ after a step

    def measured(self, batch: Batch, seconds: float) -> None:
        """How long the runner took for `batch`: the step costs the budget follows, and from steps
        with prompt chunks the recompute cost (RecomputeCost) that tells loading a prefix from disk /
        Redis from recomputing it (a mixed step's decode rows make it slightly pessimistic: loads are then tried a little
        longer). A decode step has no prompt chunk, even when its rows verify drafted tokens (such
        a step measures neither cost)."""
        if batch.kind == "decode":
            if not batch.drafts.any():
                self.costs.measured(0, len(batch.num_new), seconds)
            return
        multi = batch.num_new > 1
        chunks = batch.num_new[multi]
        self.costs.measured(int(chunks.sum()), int((batch.num_new == 1).sum()), seconds)
        if len(chunks):  # the chunk rows attend over the longest of their spans (pack_step)
            self.recompute.measured(int(chunks.sum()), int((batch.write_positions[multi] + chunks).max()), seconds)

    def postprocess(self, batch: Batch, logits: np.ndarray) -> tuple[list[tuple[Sequence, RequestOutput]], KVCopies]:
        """The step's tokens taken (its filled blocks stored); returns the outputs and the KV copies
        to run after it (the rows of finished sequences refilled, the buffers shrunk)."""
        rows = len(batch.num_new)
        self._count_step(batch)
        outputs = []
        for b, seq in enumerate(self.running[:rows]):
            if batch.drafts[b]:
                outputs.append((seq, self._verified(seq, b, batch, logits[b])))
                continue
            fed = int(batch.num_new[b])
            seq.num_cached += fed
            self.kv.prefix.store(seq, b)
            # of them, prompt tokens (a prompt's last chunk may carry the tokens its guide forces first)
            self.counters["prompt_tokens"] += max(0, min(fed, seq.num_prompt - (seq.num_cached - fed)))
            if seq.pending:
                continue  # a prompt chunk: nothing to sample yet
            self.counters["generated_tokens"] += 1
            # logits[b, 0]: its last real position, the only one execute() asks for
            outputs.append((seq, self._forced(seq, seq.advance(logits[b, 0]))))
        self._drop_finished()
        self.kv.copies_done()  # the step's copies have run; the ones to come read no pool block
        return outputs, self.kv.rows.take_copies()

    def _verified(self, seq: Sequence, row: int, batch: Batch, logits: np.ndarray) -> RequestOutput:
        """The tokens a drafting row keeps (every drafted token before the first the model
        disagrees with, plus the model's own next one); only those are cached and stored."""
        proposed = int(batch.drafts[row])
        out, accepted = seq.verify(logits, batch.input_ids[row, 1:1 + proposed].tolist())
        self.kv.prefix.store(seq, row)
        held, tried = continuations(proposed, accepted)
        seq.draft_continued, seq.draft_tried = seq.draft_continued + held, seq.draft_tried + tried
        seq.draft_limit = draft_length(seq.draft_continued, seq.draft_tried, self.speculation.max_draft_tokens)
        seq.draft_misses = 0 if accepted else seq.draft_misses + 1
        seq.draft_resumes = seq.num_output + pause_after(seq.draft_misses)
        c = self.counters
        c["spec_verify_rows"] += 1
        c["spec_draft_tokens"] += proposed
        c["spec_accepted_tokens"] += accepted
        c["generated_tokens"] += accepted + 1
        return self._forced(seq, out)

    def _forced(self, seq: Sequence, out: RequestOutput | None = None) -> RequestOutput | None:
        """When a request is admitted and after its row sampled: the tokens its guide forces next
        join its pending tokens (jump-forward), and the next steps feed them as they feed a prompt
        chunk, within the budget. Returns `out` followed by their output."""
        if not seq.jump_forward or seq.finished:
            return out
        before = len(seq.tokens)
        forced = seq.force()
        self.counters["forced_tokens"] += len(seq.tokens) - before
        self.counters["generated_tokens"] += len(seq.tokens) - before
        return out if forced is None else forced if out is None else out.merge(forced)

    def fail_running(self, message: str) -> list[tuple[Sequence, RequestOutput]]:
        """End every running sequence with an error (the step itself failed); the copies that
        frees go with the next schedule()'s."""
        outputs = [(seq, seq.finish("error", message)) for seq in self.running if not seq.finished]
        self._drop_finished()
        return outputs

    def _count_step(self, batch: Batch) -> None:
        rows = len(batch.num_new)
        c = self.counters
        c["steps"] += 1
        c[f"{batch.kind}_steps"] += 1
        c["max_rows"] = max(c["max_rows"], rows)
        c["row_steps"] += rows  # over steps: the mean running batch
        c["multi_row_steps"] += rows > 1
        self.last_kind = batch.kind

    def _drop_finished(self) -> None:
        done = [i for i, s in enumerate(self.running) if s.finished]
        for i in reversed(done):  # from the end, so each hole is filled by a live row
            self._remove(i)
        self.counters["finished"] += len(done)
        if done:
            self.kv.rows.shrink()

    def _remove(self, row: int) -> None:
        seq = self.kv.rows.remove(row)
        self.kv.release(seq)
        del self.requests[seq.request_id]
