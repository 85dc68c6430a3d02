"""One request's state: its tokens, how many are in the KV cache, its text stream and its end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import numpy as np

from kvforge.errors import RequestError
from runtime.grammar import Constraint
from runtime.sampling import (SamplingParams, adjust_logits, find_stop, log_softmax, sample, stop_hold_back,
                              top_logprobs)
from runtime.speculation import NgramIndex
from runtime.tokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a request produced since its previous output; the last one has finished=True."""

    request_id: int
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0  # generated so far, this output's tokens included
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    queue_seconds: float | None = None  # on the last output: how long the request waited for a slot
    handoff_seconds: float | None = None  # on the last output, if prefilled remotely: writing its hand-off
    logprobs: list[float] | None = None  # log p of each of token_ids, when the request asked for them
    # per token of token_ids, its top_logprobs most likely alternatives [(id, log p)], when asked for
    top_logprobs: list[list[tuple[int, float]]] | None = None
    cum_logprob: float = 0.0  # sum of the log-probs of every token generated so far

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by the request's next one, as a single output."""
        def joined(mine: list | None, theirs: list | None) -> list | None:
            return mine + theirs if mine is not None and theirs is not None else None

        return RequestOutput(self.request_id, self.text + later.text, self.token_ids + later.token_ids,
                             later.finished, later.finish_reason, later.error, later.prompt_tokens,
                             later.output_tokens, later.cached_tokens, later.queue_seconds, later.handoff_seconds,
                             joined(self.logprobs, later.logprobs), joined(self.top_logprobs, later.top_logprobs),
                             later.cum_logprob)


@dataclass
class Sequence:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    detokenizer: IncrementalDetokenizer
    stop_token_ids: frozenset[int]  # the end tokens and the request's stop token ids
    status: Status = Status.WAITING
    cache_salt: bytes | None = None  # mixed into the prefix cache's hash chain: shares only with the same salt
    num_cached: int = 0  # leading tokens whose K/V are in the runner's slot
    cached_tokens: int = 0  # of those, prompt tokens copied in from the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full blocks so far
    pool_blocks: list[int] = field(default_factory=list)  # host pool blocks it holds a reference on
    num_stored_blocks: int = 0  # leading full blocks that are in the pool
    stores_blocks: bool = True
    swapped_blocks: list[int] | None = None  # preempted: its row's KV in these pool blocks
    tiers_checked: bool = False  # its prompt blocks were asked of the disk / Redis tiers
    load_deadline: float | None = None  # waiting for a load until then (monotonic seconds); None: not loading
    finish_reason: str | None = None
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None  # when it got a slot
    handoff_seconds: float | None = None  # prefilled by the prefill worker: how long its hand-off took to write
    queue_deadline: float | None = None  # perf_counter time by which it must have a slot
    deadline: float | None = None  # perf_counter time by which it must have finished
    constraint: Constraint | None = None  # its guide's matcher (runtime/grammar.py)
    ngrams: NgramIndex | None = None  # set when decoding steps may verify drafted tokens (runtime/speculation.py)
    draft_limit: int = 0  # how many tokens its next draft may hold
    draft_continued: int = 0  # drafted tokens after a held one that held (runtime/speculation.draft_length)
    draft_tried: int = 0  # drafted tokens verified after a held one
    draft_misses: int = 0  # its drafts in a row that failed outright
    draft_resumes: int = 0  # the output length from which it drafts again
    # longrope: the sequence's length when it passed original_max_position_embeddings and was
    # recomputed on the long factors (kvforge.manifest.ModelSpec.long_factors); None: its prompt's decides
    recomputed_at: int | None = None

    def __post_init__(self):
        self.tokens = list(self.prompt_ids)
        self.rng = np.random.default_rng(self.params.seed)
        self.text = ""
        self.sent_chars = 0
        self.unsent_ids: list[int] = []
        self.unsent_logprobs: list[float] = []
        self.unsent_top: list[list[tuple[int, float]]] = []
        self.cum_logprob = 0.0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def rope_length(self) -> int:
        """The length a longrope model picks this sequence's factors from (Batch.prompt_lengths)."""
        return self.recomputed_at or self.num_prompt

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens the next steps must feed before a new token can be sampled."""
        return len(self.tokens) - self.num_cached

    @property
    def max_tokens_total(self) -> int:
        return self.num_prompt + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def advance(self, logits: np.ndarray) -> RequestOutput:
        """Choose the next token from the last position's logits and take it."""
        try:
            return self.append(*self.choose(logits))
        except RequestError as e:  # its guide allows no token its bans leave
            return self.finish("error", str(e))

    def choose(self, logits: np.ndarray) -> tuple[int, float | None, list[tuple[int, float]] | None]:
        """The next token from the last position's logits, its log-prob and the most likely
        tokens' if the request wants them (the model's own: before penalties, bans and the
        guide's mask; the whole row's log-softmax only for a row that asks)."""
        params = self.params
        adjusted = adjust_logits(logits, params, self.tokens, self.num_prompt, self.stop_token_ids) \
            if params.adjusts_logits else logits
        if self.constraint is not None:
            adjusted = self.constraint.mask(adjusted)
        token = sample(adjusted, params, self.rng)
        if not params.logprobs:
            return token, None, None
        logprobs = log_softmax(logits)
        top = top_logprobs(logprobs, params.top_logprobs) if params.top_logprobs else None
        return token, float(logprobs[token]), top

    def draft(self, k: int) -> list[int]:
        """Up to k tokens drafted from its own context (speculation), cut before the first its
        guide forbids: that one would be rejected anyway."""
        drafted = self.ngrams.propose(self.tokens, k)
        if drafted and self.constraint is not None:
            return drafted[:self.constraint.valid_prefix(drafted)]
        return drafted

    def append(self, token: int, logprob: float | None = None,
               top: list[tuple[int, float]] | None = None) -> RequestOutput:
        """Take a sampled token; the output carries it (one token per output), its text may be
        empty while the tail is held back (an unfinished character or a possible stop string)."""
        if token in (self.params.stop_token_ids if self.params.ignore_eos else self.stop_token_ids):
            return self.finish("stop")
        self.tokens.append(token)
        self.unsent_ids.append(token)
        if self.constraint is not None:
            self.constraint.accept(token)
        if logprob is not None:
            self.unsent_logprobs.append(logprob)
            self.cum_logprob += logprob
        if top is not None:
            self.unsent_top.append(top)
        before = len(self.text)
        self.text += self.detokenizer.push(token)
        stop_at = find_stop(self.text, self.params.stop, before) if self.num_output >= self.params.min_tokens else -1
        if stop_at >= 0:
            self.text = self.text[:stop_at]
            return self.finish("stop", flush=False)
        if self.constraint is not None and self.constraint.done:  # the grammar takes no more tokens
            error = self.constraint.error()
            return self.finish("error", error) if error else self.finish("stop")
        if self.num_output >= self.params.max_tokens:
            return self.finish("length")
        ready = len(self.text) - stop_hold_back(self.text, self.params.stop)
        return self._output(max(ready, self.sent_chars))

    def verify(self, logits: np.ndarray, draft: list[int]) -> tuple[RequestOutput, int]:
        """After a step that fed the pending token and then `draft`: the request's own choices
        from logits [1 + len(draft), vocab] while they equal the draft (each such draft is now
        cached: its K/V came from the same token), then the first that differs or follows them all.
        Each choice sees the context and draws from the request's generator exactly as decoding
        one token per step would, so greedy and seeded outputs do not change. Returns one output
        for them and how many drafts held."""
        self.num_cached += 1
        out, accepted = None, 0
        for i, row in enumerate(logits[:len(draft) + 1]):
            step = self.advance(row)
            out = step if out is None else out.merge(step)
            if self.finished or i == len(draft) or self.tokens[-1] != draft[i]:
                break
            self.num_cached += 1
            accepted += 1
        return out, accepted

    def finish(self, reason: str, error: str | None = None, flush: bool = True) -> RequestOutput:
        if flush:  # text cut at a stop string ends there; otherwise held-back bytes go out now
            self.text += self.detokenizer.flush()
        self.status, self.finish_reason = Status.FINISHED, reason
        out = self._output(len(self.text))
        out.finished, out.finish_reason, out.error = True, reason, error
        out.queue_seconds = (self.admitted or time.perf_counter()) - self.arrived
        out.handoff_seconds = self.handoff_seconds
        return out

    def _output(self, upto: int) -> RequestOutput:
        out = RequestOutput(self.request_id, self.text[self.sent_chars:upto], self.unsent_ids,
                            prompt_tokens=self.num_prompt, output_tokens=self.num_output,
                            cached_tokens=self.cached_tokens,
                            logprobs=self.unsent_logprobs if self.params.logprobs else None,
                            top_logprobs=self.unsent_top if self.params.top_logprobs else None,
                            cum_logprob=self.cum_logprob)
        self.sent_chars, self.unsent_ids, self.unsent_logprobs, self.unsent_top = upto, [], [], []
        return out
