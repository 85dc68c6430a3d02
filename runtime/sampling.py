"""Sampling parameters, their validation, and choosing the next token from one row of logits.

Stop strings are matched on the detokenized text; `stop_hold_back` tells the streamer how much
of the text's tail could still turn into a stop string and must not be sent yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64


class RequestError(ValueError):
    """A request that cannot be served as given; the message says what to change."""


def quote(value, limit: int = 80) -> str:
    """What an error may echo of user input: at most `limit` characters, and its length."""
    text = value if isinstance(value, str) else repr(value)
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # None = fresh entropy; an int makes the request reproducible
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default=())

    def validate(self) -> None:
        """Checks that need no model; the engine adds the context-length checks."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, (int, np.integer)):
            raise RequestError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float, np.floating)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float, np.floating)) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if self.seed is not None and not (isinstance(self.seed, (int, np.integer)) and 0 <= self.seed < 2**64):
            raise RequestError(f"seed must be an unsigned 64-bit integer, got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise RequestError(f"each stop string must be 1..{MAX_STOP_CHARS} characters, got {quote(s)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits [vocab]."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if 0 < params.top_k < scaled.shape[0]:
        candidates = np.argpartition(-scaled, params.top_k - 1)[:params.top_k]
    if params.top_p < 1:
        # a stable sort keeps equal logits in token order, so a seed always picks the same token
        candidates = candidates[np.argsort(-scaled[candidates], kind="stable")]
    probs = np.exp(scaled[candidates] - scaled[candidates].max())
    probs /= probs.sum()
    if params.top_p < 1:
        # the smallest head of the sorted distribution whose mass reaches top_p
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        candidates, probs = candidates[:keep], probs[:keep] / probs[:keep].sum()
    return int(candidates[rng.choice(len(probs), p=probs)])


def find_stop(text: str, stops: tuple[str, ...], start: int) -> int:
    """Index of the earliest stop string in text that ends after `start`, or -1."""
    found = [i for s in stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(found, default=-1)


def stop_hold_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1)
                if s.startswith(text[-k:])), default=0)
