"""Sampling parameters, their validation, and choosing the next token from one row of logits.

The logits pass through the request's penalties and bans first (repetition penalty over prompt
and output as in Hugging Face / TensorRT-LLM; presence and frequency penalties over the output
as in OpenAI / vLLM; end tokens banned until min_tokens; bad words banned; OpenAI's logit_bias
added; vLLM's allowed_token_ids as a mask), then the request's guide (runtime/grammar.py: what
its grammar forbids), then temperature, min-p (vLLM's: tokens below min_p times the most likely
one's probability go), top-k and top-p. Requested log-probs, the chosen token's and the
top_logprobs most likely ones, are the log-softmax of the model's own logits (before any of
that, like vLLM's default `raw_logprobs`), so they measure the model, not the sampling settings:
a token the request's bias, mask or guide forbids may be among the most likely. Stop strings
are matched on the detokenized text; `stop_hold_back` tells the streamer how much of the text's
tail could still turn into a stop string.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kvforge.errors import RequestError, quote
from runtime.grammar import Guide

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_PENALTY = 2.0  # presence/frequency penalties, OpenAI's range [-2, 2]
MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit (its completions allow 5)
MAX_LOGIT_BIAS = 300  # entries, OpenAI's limit
MAX_BIAS = 100.0  # OpenAI's range [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # None = fresh entropy; an int makes the request reproducible
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = field(default=())
    end_id: int | None = None  # the token that ends the text; None = the tokenizer's EOS tokens
    ignore_eos: bool = False  # vLLM's: end tokens are ordinary output; stop strings and stop_token_ids still end
    repetition_penalty: float = 1.0  # > 1 discourages every token already in prompt or output
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_tokens: int = 0  # no end token and no stop string before this many output tokens
    bad_words: tuple[str, ...] = ()  # texts the output never contains as tokens (TensorRT-LLM's bad_words)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # bad_words tokenized by the engine
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: also the log-probs of this many most likely tokens
    min_p: float = 0.0  # vLLM's: keep tokens whose probability is >= min_p * the most likely one's
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: when given, no other token is chosen
    speculative: str | None = None  # "ngram" | "off"; None = the server's default
    guide: Guide | None = None  # what the output must match (constrained decoding)

    @property
    def adjusts_logits(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_tokens > 0 or bool(self.bad_word_ids) or bool(self.logit_bias)
                or bool(self.allowed_token_ids))

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
        _check_texts(self.stop, "stop strings", "each stop string")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}")
        _check_ids(self.stop_token_ids, "stop_token_ids")
        if self.end_id is not None and (isinstance(self.end_id, bool) or not isinstance(self.end_id, (int, np.integer))):
            raise RequestError(f"end_id must be a token id, got {self.end_id!r}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise RequestError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or abs(value) > MAX_PENALTY:
                raise RequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 = off), got {value!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, (int, np.integer)) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise RequestError(f"min_tokens must be an integer in 0..max_tokens ({self.max_tokens}), got {self.min_tokens!r}")
        _check_texts(self.bad_words, "bad words", "each bad word")
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, (int, np.integer)) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs!r}")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: the chosen token's log-prob comes with them")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise RequestError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(f"logit_bias holds at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        biased = [token for token, _ in self.logit_bias]
        _check_ids(biased, "logit_bias")
        if len(set(biased)) < len(biased):  # one bias per token: numpy would apply only the last
            raise RequestError(f"logit_bias names token {next(t for t in biased if biased.count(t) > 1)} twice")
        for token, bias in self.logit_bias:
            if not _finite(bias) or abs(bias) > MAX_BIAS:
                raise RequestError(f"logit_bias of token {token} must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                   f"got {bias!r}")
        _check_ids(self.allowed_token_ids, "allowed_token_ids")
        if self.speculative not in (None, "off", "ngram"):
            raise RequestError(f"speculative must be 'ngram' or 'off', got {quote(self.speculative)}")
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise RequestError(f"guide must be a Guide(kind, text), got {type(self.guide).__name__}")
            self.guide.check()
            if self.ignore_eos:
                raise RequestError("ignore_eos cannot go with a guide: the grammar decides where the text ends")


def _check_texts(texts: tuple[str, ...], plural: str, each: str) -> None:
    if len(texts) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} {plural}, got {len(texts)}")
    for s in texts:
        if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
            raise RequestError(f"{each} must be 1..{MAX_STOP_CHARS} characters, got {quote(s)}")


def _check_ids(ids, name: str) -> None:
    """Token ids are integers >= 0; the engine checks them against its vocabulary (check_vocabulary)."""
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, (int, np.integer)) or token < 0:
            raise RequestError(f"{name} holds {token!r}, which is no token id")


def check_vocabulary(params: SamplingParams, vocab: int) -> None:
    """Every token id the request names is one of the model's (0..vocab-1)."""
    for name, ids in (("end_id", () if params.end_id is None else (params.end_id,)),
                      ("stop_token_ids", params.stop_token_ids), ("allowed_token_ids", params.allowed_token_ids),
                      ("logit_bias", [token for token, _ in params.logit_bias])):
        check_in_vocabulary(name, ids, vocab)


def check_in_vocabulary(name: str, ids, vocab: int) -> None:
    bad = next((token for token in ids if not 0 <= token < vocab), None)
    if bad is not None:
        raise RequestError(f"{name} names token {bad}, which is not in the vocabulary (0..{vocab - 1})")


def _finite(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) \
        and math.isfinite(value)


def adjust_logits(logits: np.ndarray, params: SamplingParams, tokens: list[int], num_prompt: int,
                  end_ids: frozenset[int]) -> np.ndarray:
    """The logits after the request's penalties and bans; `tokens` is prompt + output so far."""
    adjusted = logits.astype(np.float64)
    output = tokens[num_prompt:]
    if params.repetition_penalty != 1:
        seen = np.unique(np.asarray(tokens, np.int64))
        values = adjusted[seen]
        adjusted[seen] = np.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output, np.int64), return_counts=True)
        adjusted[ids] -= params.presence_penalty + params.frequency_penalty * counts
    if len(output) < params.min_tokens and end_ids:
        adjusted[list(end_ids)] = -np.inf
    for word in params.bad_word_ids:
        # a word's last token is banned where the output so far ends with the word's other tokens
        if len(word) == 1 or (len(output) >= len(word) - 1 and tuple(output[len(output) - len(word) + 1:]) == word[:-1]):
            adjusted[word[-1]] = -np.inf
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias)
        adjusted[list(ids)] += biases
    if params.allowed_token_ids:
        allowed = np.full(adjusted.shape, -np.inf)
        allowed[list(params.allowed_token_ids)] = 0.0
        adjusted += allowed
    return adjusted


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p of every token under the distribution one row of logits defines."""
    row = logits.astype(np.float64)
    row -= row.max()
    return row - np.log(np.exp(row).sum())


def top_logprobs(logprobs: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of a log_softmax row and their log-probs, most likely first
    (equal log-probs in token order)."""
    head = np.argpartition(logprobs, -k)[-k:]  # no negated copy of the row
    head = head[np.lexsort((head, -logprobs[head]))]
    return [(int(t), float(logprobs[t])) for t in head]


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of (adjusted) logits [vocab]."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / params.temperature
    candidates = np.arange(scaled.shape[0])
    if params.min_p > 0:  # p >= min_p * p_max, in log space: no softmax over the whole vocabulary
        candidates = np.flatnonzero(scaled >= scaled.max() + np.log(params.min_p))
    if 0 < params.top_k < len(candidates):
        candidates = candidates[np.argpartition(-scaled[candidates], params.top_k - 1)[:params.top_k]]
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
