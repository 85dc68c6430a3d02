"""Continuous batching over the runner's KV slots: the policy of what runs next. It only decides;
the KV manager (runtime/kv/manager.py) moves rows, sizes buffers and copies prefix-cache blocks
in and out, and the engine (runtime/llm_engine.py) runs each step: schedule -> run -> postprocess.

Running sequences occupy runner rows 0..n-1 (`running[i]` is row i). Between steps, finished
and cancelled sequences leave (the last row moves into the hole) and waiting ones join, placed
in front of the decoding rows (so prompt rows come first, in arrival order). A step feeds each
row num_new[b] of its pending tokens (as a right-padded [rows, S] Batch; the runner packs the
real tokens); a row samples when it has consumed all it had.

Stall-free (the default; Sarathi-Serve): every step runs every decoding row (one token each)
plus prompt chunks up to `prefill_budget` tokens, oldest prompt first, so a stream's next token
waits for at most one budget of prompt compute and no prompt waits behind decode steps (a later
prompt's chunk shares the step only when its span is like the others': similar_spans). The
in-place graph takes packed tokens, so mixing costs what the tokens cost. The budget trades the
streams' inter-token latency against the long prompt's TTFT; measured with
`python -m bench --sections mixed_load` (small-llama, 4K context, fp32, 2 threads, an otherwise
idle machine, two runs; one stream decoding while two fresh 2,000-token prompts arrive together,
medians of 3 rounds per run):

    scheduler                    alternate  stall-free 32  stall-free 48  stall-free 256
    stream ITL p50 alone, ms      22.6/23.2     26.0/23.8      25.0/27.6      25.7/29.3
    ITL p99 during prefill, ms   487.0/476.2   148.5/152.6    183.4/251.9    725.8/780.6
    p99 / p50                     21.5/20.5x     5.7/6.4x       7.3/9.1x      28.2/26.6x
    long prompts' TTFT median, s   5.89/5.96     8.22/8.29      7.07/7.96      5.38/5.75

That was export format 3, where a decode row's attention followed the buffer's capacity, which
the two prompts grow to their 2K-token bucket (one decode row: 31 ms at capacity 2,560, 45 ms at
4,096, ~22 ms in a small bucket). Format 4 attends over the decode rows' own span, the capacity
grows once per prompt and prompt rows stay before decoding rows (runtime/kv/manager.py); the same
section, two full runs:

    scheduler                    alternate  stall-free 32  stall-free 48  stall-free 256
    stream ITL p50 alone, ms      19.8/18.4     19.5/19.0      19.2/19.2      19.1/19.2
    ITL p99 during prefill, ms   334.6/320.6     77.9/78.8    120.4/115.8    462.0/514.2
    p99 / p50                     16.9/17.4x      4.0/4.2x       6.3/6.0x      24.2/26.8x
    long prompts' TTFT median, s   4.40/4.27     4.89/5.00      4.26/4.01      3.23/3.40

Every 16 prompt tokens add ~15-20 ms to the step (weight matmuls and the chunk's attention). 32
tokens keep a stream's p99 gap near 4x its own for ~1.1-1.2x the alternate policy's TTFT (which
prefills both prompts side by side in 256-token steps and stalls streams ~330 ms per step): the
default. With the KV reservation mapped at startup (runtime/runners/ort.py: first-touched pages
had added 5-260 ms stalls), one more full run gave 32: 5.6x at 1.09x TTFT, 24: 4.8x at 1.34x:
24 trades past the TTFT bound without reaching 4x served. Since a fresh prompt's chunk no longer
shares a step with a long prompt's last one (similar_spans) and a decoding row rotates through a
spare row holding the least KV (runtime/kv/manager.py prompts_first), three full runs gave

    scheduler                    alternate       stall-free 32     stall-free 24
    stream ITL p50 alone, ms      17.2/17.1/18.2  17.0/17.0/17.7    17.3/16.2/17.2
    ITL p99 during prefill, ms   324/336/347     58.4/61.0/62.7    54.2/52.0/54.9
    p99 / p50                     18.9/19.7/19.1x  3.4/3.6/3.5x      3.1/3.2/3.2x
    long prompts' TTFT median, s  4.32/4.43/4.65   4.59/4.67/4.81    5.58/5.42/5.61

(docs/benchmarks.md has the tables): 32 meets both bounds (<= 4x, TTFT <= 1.3x: 1.03-1.06x);
24 costs 1.2-1.3x TTFT for 0.3x less.
When no row decodes, prompts go in chunks of `solo_prefill_tokens`: nobody waits on the chunk.

Speculation (runtime/speculation.py): in a step where every row decodes and at most
`speculation.max_rows` do, a row that speculates feeds its pending token plus tokens
drafted from its own context; postprocess keeps those the model agrees with (`_verified`).

Alternate (`stall_free=False`; with prefill_budget=256, the policy before issue 20): prompt-chunk
steps take turns with decode steps, mixed only when padding both into one [rows, S] block wasted at most
MIX_PADDING_TOKENS (the padded graph made a 1-prompt + 8-decode step at S=16 cost 294 ms mixed
vs 108 ms apart). Its chunk size, measured with `python -m bench.prefill EXPORT --rounds 2` on
small-llama-32k, fp32, 2 threads (load 8-9, so absolute times ~4x an idle machine's):

    chunk tokens               128    256    512   1024   2048
    1K prompt alone, TTFT s   8.24   8.04   7.63   7.41      -
    2K prompt alone, TTFT s  19.91  16.05  14.20  15.02  17.22
    2K prompt with 1 decoding row:
      TTFT s                 21.61  18.58  16.22  15.06  16.40
      longest decode gap s    1.78   2.85   4.74   7.67  16.27

Alone, chunks help up to 512 tokens (attention costs follow the capacity bucket, so a chunk in a
small bucket is cheaper than the whole prompt in the big one): SOLO_PREFILL_TOKENS.
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from kvforge.errors import QueueFullError
from runtime.kv.manager import KVManager
from runtime.runners.base import Batch
from runtime.sequence import RequestOutput, Sequence, Status
from runtime.speculation import Speculation, continuations, draft_length, pause_after

MIX_PADDING_TOKENS = 16
PREFILL_BUDGET = 32
SOLO_PREFILL_TOKENS = 512
MAX_PREFILL_BUDGET = 8192
# A request loading its prefix from disk / Redis waits at most as long as recomputing it is
# estimated to take (from the measured prefill rate), but never less than this (thread hand-offs);
# before any prefill was measured, up to the longer bound.
LOAD_DEADLINE_FLOOR, LOAD_DEADLINE_UNMEASURED = 0.01, 2.0


def check_prefill_budget(budget: int) -> None:
    if not isinstance(budget, int) or not 2 <= budget <= MAX_PREFILL_BUDGET:
        raise ValueError(f"the prefill budget must be a whole number of prompt tokens per step in "
                         f"2..{MAX_PREFILL_BUDGET}, got {budget!r}")


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
                 prefill_budget: int = PREFILL_BUDGET, solo_prefill_tokens: int = SOLO_PREFILL_TOKENS,
                 stall_free: bool = True, speculation: Speculation = Speculation()):
        check_prefill_budget(prefill_budget)
        speculation.check()
        self.speculation = speculation
        self.max_seq_len = max_seq_len
        self.kv = kv
        self.max_waiting = max_waiting
        self.prefill_budget = prefill_budget  # prompt tokens per step beside the decoding rows
        self.solo_prefill_tokens = max(prefill_budget, solo_prefill_tokens)  # when no row decodes
        self.stall_free = stall_free
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[int, Sequence] = {}
        self.cancelled: set[int] = set()
        self.last_kind = "decode"
        self.counters = dict(steps=0, prefill_steps=0, decode_steps=0, mixed_steps=0, max_rows=0,
                             multi_row_steps=0, prompt_tokens=0, generated_tokens=0, finished=0,
                             cancelled=0, expired=0, prefix_waits=0, tier_loads_expired=0, preempted_swap=0,
                             preempted_recompute=0, row_steps=0, spec_verify_rows=0, spec_draft_tokens=0,
                             spec_accepted_tokens=0)
        self.prefill_tokens_per_second: float | None = None  # measured, for the load-or-recompute choice

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

    def schedule(self) -> tuple[list[tuple[Sequence, RequestOutput]], Batch | None]:
        """Apply cancellations, admit what fits, and pick the next step (None when idle).
        Admission is first come, first served, except that a request whose prefix a running
        sequence is computing right now lets the ones behind it go first and waits for it."""
        outputs = [(seq, self._cancel(seq)) for seq in map(self.requests.get, self.cancelled) if seq]
        self.cancelled.clear()
        outputs += self._expire(time.perf_counter())
        while len(self.running) > 1 and not self.kv.fits(self.running):
            self._preempt()
        for request_id in self.kv.finish_loads():
            if request_id in self.requests:
                self.requests[request_id].load_deadline = None
        now = time.monotonic()
        for seq in list(self.waiting):
            if seq.swapped_blocks is not None:  # preempted: it resumes first, with its own KV
                if not self.kv.can_admit(seq, self.running):
                    break
                self.waiting.remove(seq)
                self._place(seq, [])
                continue
            if seq.load_deadline is not None:  # its prefix is coming from disk / Redis
                if now < seq.load_deadline:
                    continue
                seq.load_deadline = None  # slower than recomputing it: go without
                self.counters["tier_loads_expired"] += 1
            hit, wait = self.kv.match(seq)
            if wait:
                self.counters["prefix_waits"] += 1
                continue
            recompute = self._recompute_seconds(seq, len(hit))
            if self.kv.start_load(seq, hit, recompute):
                seq.load_deadline = now + (LOAD_DEADLINE_UNMEASURED if recompute is None
                                           else max(recompute, LOAD_DEADLINE_FLOOR))
                continue
            if not self.kv.can_admit(seq, self.running):
                break
            self.waiting.remove(seq)
            self._place(seq, hit)
        return outputs, (self._next_batch() if self.running else None)

    def _recompute_seconds(self, seq: Sequence, hit_blocks: int) -> float | None:
        rate = self.prefill_tokens_per_second
        return None if rate is None else (seq.num_prompt - hit_blocks * self.kv.block_tokens) / rate

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
            self._shrink()
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
        """Add seq as a row in front of the first decoding row (so a prefill step covers a short
        prefix of rows)."""
        seq.status, seq.admitted = Status.RUNNING, time.perf_counter()
        row = next((i for i, s in enumerate(self.running) if s.pending == 1), len(self.running))
        self.kv.insert_row(self.running, row, seq)
        if seq.swapped_blocks is not None:
            self.kv.swap_in(seq, row, seq.swapped_blocks, len(self.running))
            seq.swapped_blocks = None
        else:
            self.kv.admit(seq, row, hit, len(self.running))

    def _preempt(self) -> None:
        """The youngest running sequence goes back to the front of the queue (its KV swapped to
        the host pool, or dropped for recompute beyond the swap reserve)."""
        seq = max(self.running, key=lambda s: s.request_id)
        row = self.running.index(seq)
        seq.swapped_blocks = self.kv.preempt(seq, row)
        self.counters["preempted_swap" if seq.swapped_blocks is not None else "preempted_recompute"] += 1
        self.kv.remove_row(self.running, row)
        self.kv.refit(self.running)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def _next_batch(self) -> Batch:
        self.kv.prompts_first(self.running)
        pending = [s.pending for s in self.running]
        decoding = 1 in pending
        budget = self.prefill_budget if decoding else self.solo_prefill_tokens
        room = self.kv.step_room(self.running)
        if max(pending) == 1 and (drafted := self._speculative_batch(room)) is not None:
            return drafted
        if not self.stall_free:
            return self._alternating_batch(pending, budget, room)
        num_new, left, spans = [], budget, []
        for seq, p in zip(self.running, pending):  # prompts in row order (arrival order) share the budget
            take = 1 if p == 1 else min(p, left, room)
            if p > 1:
                if take > 1 and spans and not similar_spans(spans + [seq.num_cached + take], budget):
                    take = 0
                spans += [seq.num_cached + take] if take > 1 else []
                left -= take
            num_new.append(take)
        width = max(num_new)
        kind = "decode" if width == 1 else "mixed" if decoding else "prefill"
        self.kv.fit_capacity(max(s.num_cached for s in self.running) + width, len(self.running),
                             self.kv.ends(self.running))
        return Batch.of(kind, self.running, width, num_new)

    def _speculative_batch(self, room: int) -> Batch | None:
        """A decode step in which the rows that speculate feed drafted tokens after their own
        (None: no row drafted any). Drafts stay within the buffers' capacity, the request's
        max_tokens and a few decoding rows."""
        if len(self.running) > self.speculation.max_rows or not any(s.ngrams for s in self.running):
            return None
        room = min(room, self.kv.runner.capacity - max(s.num_cached for s in self.running))
        drafts = [s.ngrams.propose(s.tokens, min(s.draft_limit, s.max_tokens_total - len(s.tokens) - 1, room - 1))
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
        self.kv.fit_capacity(max(s.num_cached for s in seqs) + width, len(self.running), self.kv.ends(self.running))
        return Batch.of(kind, seqs, width)

    # ------------------------------------------------------------------ after a step

    def measured(self, batch: Batch, seconds: float) -> None:
        """How long the runner took for `batch`: steps with prompt chunks give the rate that tells
        loading a prefix from disk / Redis from recomputing it (a mixed step's decode rows make it
        slightly pessimistic: loads are then tried a little longer). A decode step has no prompt
        chunk, even when its rows verify drafted tokens."""
        if batch.kind == "decode":
            return
        chunks = batch.num_new[batch.num_new > 1]
        if len(chunks):
            rate = int(chunks.sum()) / max(seconds, 1e-6)
            old = self.prefill_tokens_per_second
            self.prefill_tokens_per_second = rate if old is None else 0.7 * old + 0.3 * rate

    def postprocess(self, batch: Batch, logits: np.ndarray) -> list[tuple[Sequence, RequestOutput]]:
        rows = len(batch.num_new)
        self._count_step(batch)
        outputs = []
        for b, seq in enumerate(self.running[:rows]):
            if batch.drafts[b]:
                outputs.append((seq, self._verified(seq, b, batch, logits[b])))
                continue
            seq.num_cached += int(batch.num_new[b])
            self.kv.store(seq, b)
            if seq.num_cached <= seq.num_prompt:
                self.counters["prompt_tokens"] += int(batch.num_new[b])
            if seq.pending:
                continue  # a prompt chunk: nothing to sample yet
            self.counters["generated_tokens"] += 1
            # logits[b, 0]: its last real position, the only one execute() asks for
            outputs.append((seq, seq.append(*seq.choose(logits[b, 0]))))
        self._drop_finished()
        return outputs

    def _verified(self, seq: Sequence, row: int, batch: Batch, logits: np.ndarray) -> RequestOutput:
        """The tokens a drafting row keeps (every drafted token before the first the model
        disagrees with, plus the model's own next one); only those are cached and stored."""
        proposed = int(batch.drafts[row])
        out, accepted = seq.verify(logits, batch.input_ids[row, 1:1 + proposed].tolist())
        self.kv.store(seq, row)
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
        return out

    def fail_running(self, message: str) -> list[tuple[Sequence, RequestOutput]]:
        """End every running sequence with an error (the step itself failed)."""
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
            self._shrink()

    def _remove(self, row: int) -> None:
        seq = self.kv.remove_row(self.running, row)
        self.kv.release(seq)
        del self.requests[seq.request_id]

    def _shrink(self) -> None:
        self.kv.shrink(self.running)
