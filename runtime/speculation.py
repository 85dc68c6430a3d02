"""Prompt-lookup speculation (issue 23): a decoding row proposes the tokens that followed the
last occurrence of its newest n-gram in its own prompt and output, and one step verifies them.

At batch 1 a decode step reads every weight for one token; feeding the newest token plus k
drafted ones costs nearly the same step (the weights are read once for all of them) and yields
1 + (accepted drafts) tokens. The row's step runs as a chunk of 1 + k tokens through the in-place
cache; the logits of every position say how many drafts the request's sampler agrees with
(greedy: the argmax equals the draft), the first disagreement is replaced by its own token, and the
positions written for rejected drafts are simply overwritten by the next step (rollback is
`num_cached`, a length). Only accepted tokens count as cached, so only they reach the prefix cache.

Every position's token is chosen exactly as decoding one token per step would choose it (the
same context, the request's own generator drawn in the same order), and a draft holds only
while it equals that choice: greedy and seeded outputs are those without speculation, whatever
the batch around them; a sampled draft holds with the probability the sampler gives it. The
draft length adapts to each row's acceptance: how often a drafted token held once the one before
it had (drafts hold or fail in runs, so one miss says little about the next draft); a row whose
drafts keep failing outright pauses drafting for exponentially longer; speculation stops when
more than `max_rows` rows decode together (the batch already reads each weight for many tokens)
or when a step carries prompt chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvforge.engine_config import MAX_DRAFT_TOKENS
from kvforge.engine_config import MAX_SPECULATION as LIMIT  # the largest max_draft_tokens / max_ngram accepted

MAX_NGRAM = 3
MAX_ROWS = 4  # decoding rows beyond which a step does not speculate
# Drafts in a row that failed outright before a row pauses drafting. A failed one-token draft
# costs a step ~1-5% wider, and code alternates runs it repeats with runs it does not: tokens
# per step on held-out stdlib code with stdlib-llama (bench speculative's prompts, 4 x 128
# tokens) were 1.49 pausing after 1 miss, 1.64 after 3, 1.80 after 6, 1.93 after 12, 1.95 never.
MISSES_BEFORE_PAUSE = 12
# A drafted token is worth its place in the step while the chance that it is reached and held is
# at least this. On stdlib-llama at batch 1 a verifying step of width 2 costs ~20% more than a
# decode step and each token beyond ~3% (0.49 / 0.60 / 0.61 / 0.62 / 0.65 ms at widths 1-5, a
# probe timing runner.step on bench speculative's code prompts): past the first drafted token
# tokens are cheap. Steps per 128 tokens there: 68.5 shrinking a draft to one past its accepted
# tokens after each miss (the rule before), 61.5 with this rule or with every draft at the maximum.
MIN_REACH = 0.1
FIRST_PAUSE_TOKENS, MAX_PAUSE_TOKENS = 4, 64


@dataclass(frozen=True)
class Speculation:
    """How decoding rows draft tokens from their own context."""

    max_draft_tokens: int = MAX_DRAFT_TOKENS
    max_ngram: int = MAX_NGRAM
    max_rows: int = MAX_ROWS

    def check(self) -> None:
        for name in ("max_draft_tokens", "max_ngram", "max_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= LIMIT:
                raise ValueError(f"speculation {name} must be a whole number in 1..{LIMIT}, got {value!r}")


class NgramIndex:
    """Where each n-gram (n = 1..max_ngram) of a sequence's tokens last ended, kept up to date as
    tokens are appended, so a draft costs a few dict lookups instead of a scan of the context."""

    def __init__(self, max_ngram: int = MAX_NGRAM):
        self.max_ngram = max_ngram
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest tail
        n-gram (n = max_ngram .. 1) of `tokens`; [] when no tail occurs earlier."""
        for end in range(self.indexed, len(tokens) - 1):  # every n-gram but the tail's
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.ends[tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(tokens) - 1), 0, -1):
            start = self.ends.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start:start + k]
        return []


def draft_length(continued: int, tried: int, max_draft_tokens: int) -> int:
    """A row's next draft length: the first drafted token, then as many more as each have a chance
    >= MIN_REACH of being reached and held, given that `continued` of the `tried` drafted tokens
    that followed a held one held too (one held and one failed assumed: without history, a chance
    of 0.5 each, 4 tokens)."""
    held = (continued + 1) / (tried + 2)
    return max(1, min(max_draft_tokens, 1 + int(math.log(MIN_REACH) / math.log(held))))


def continuations(proposed: int, accepted: int) -> tuple[int, int]:
    """(held, tried) of a verified draft's tokens after its first: a token is tried when the one
    before it held."""
    return max(accepted - 1, 0), min(accepted, proposed - 1)


def pause_after(misses: int) -> int:
    """Output tokens a row decodes without drafting after `misses` drafts in a row failed
    outright: none for the first few, then doubling (a text that does not repeat itself would
    pay a wider step for nothing)."""
    if misses < MISSES_BEFORE_PAUSE:
        return 0
    return min(MAX_PAUSE_TOKENS, FIRST_PAUSE_TOKENS << (misses - MISSES_BEFORE_PAUSE))
