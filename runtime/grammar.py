"""Constrained decoding (issue 42): a request's guide (a JSON schema, a regex, a grammar, a list of
choices) compiled by llguidance into a matcher that says, before each token, which tokens may come
next.

llguidance reads the engine's own tokenizer.json (the runtime's tokenizer is `tokenizers`, no
transformers, no torch), so its token ids are the model's. Compiling a grammar builds its lexer
and parser: bounded by llguidance's fuel and size limits (LIMITS), done on the requesting thread
(never under the engine's lock: a slow schema holds no step), and cached (the last
CACHE_SIZE grammars; a request copies the cached matcher). Each step, `Constraint.mask` sets
every token the grammar forbids to -inf in the row's logits, after the request's penalties and
bans; the request's end tokens are allowed exactly where the grammar accepts, and a grammar
that can take no more tokens ends the request ("stop").

The matcher only ever advances over tokens that became output: a drafted token
(runtime/speculation.py) is first cut from the draft if the grammar forbids it, and a verified
one is chosen under the mask like any other, so a guided request's text is the same with and
without speculation.

Jump-forward (issue 42 item 2; EngineConfig.jump_forward): where the mask allows exactly one token
(and the grammar does not accept, so no end is allowed either), sampling could take no other, so
`Constraint.forced` names it and the sequence takes it at once (runtime/sequence.py force); the
scheduler then feeds the forced tokens as one chunk, as it feeds a prompt chunk. The decision is
the mask's own, token by token: never a retokenized forced string (llguidance's compute_ff_tokens
tokenizes forced bytes, which may differ from the tokens the model would have chosen under the mask).
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import llguidance
import numpy as np

from kvforge.errors import RequestError, quote

# guided_decoding_guide_type's values (TensorRT-LLM's, and `choice` for vLLM's guided_choice)
KINDS = ("json", "json_schema", "regex", "ebnf_grammar", "choice")
MAX_GUIDE_CHARS = 64 << 10
MAX_ERROR_CHARS = 600  # of llguidance's message, in the request's error
CACHE_SIZE = 64
# llguidance's bounds on one grammar: its lexer's fuel to build (~50K per ms) and per token mask
# (~14K per ms), Earley items per step, lexer states (1-2 kB each) and grammar symbols. A schema
# past them is refused when compiled, or ends its request when a step would exceed them.
LIMITS = dict(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
              max_lexer_states=50_000, max_grammar_size=500_000)
# JSON as one canonical layout, as Python's json.dumps writes it: with llguidance's default
# (any whitespace between tokens) a small model can pad a document with whitespace until
# max_tokens. A schema's own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
# vLLM's guided decoding keys (guided_decoding, structured_outputs) -> their guide kind
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf_grammar",
              "json_object": "json"}


@dataclass(frozen=True)
class Guide:
    """What a request's output must match. kind: json (any JSON object; no text), json_schema
    (text: the schema), regex, ebnf_grammar (llguidance's Lark syntax or GBNF, as llama.cpp and
    TensorRT-LLM's xgrammar write EBNF), choice (text: a JSON list of the allowed outputs)."""

    kind: str
    text: str = ""

    @classmethod
    def of_value(cls, kind: str, value) -> "Guide":
        """A guide from a JSON request's value: a schema or a choice list as an object or JSON
        text, a json guide has none."""
        return cls(kind, "" if kind == "json" else value if isinstance(value, str) else json.dumps(value))

    def check(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"the guide type must be one of {', '.join(KINDS)}, got {quote(self.kind)}")
        if not isinstance(self.text, str) or len(self.text) > MAX_GUIDE_CHARS:
            raise RequestError(f"a guide is a text of at most {MAX_GUIDE_CHARS} characters")
        if self.kind == "json" and self.text:
            raise RequestError("a json guide takes no text (it allows any JSON object); send the schema as a "
                               "json_schema guide")
        if self.kind != "json" and not self.text:
            raise RequestError(f"a {self.kind} guide needs its text")

    def grammar(self) -> str:
        """llguidance's grammar for the guide (checked only when a matcher is built from it)."""
        try:
            if self.kind == "json":
                return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)
            if self.kind == "json_schema":
                schema = json.loads(self.text)
                if not isinstance(schema, dict):
                    raise RequestError("a json_schema guide must be a JSON object (a JSON Schema)")
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(self.text)
            if self.kind == "choice":
                return llguidance.grammar_from("choice", json.dumps(choices(self.text)))
            return llguidance.grammar_from("ebnf", self.text)
        except ValueError as e:  # not JSON, or a grammar llguidance's GBNF reader cannot read
            if isinstance(e, RequestError):
                raise
            raise RequestError(f"the {self.kind} guide is invalid: {str(e)[:MAX_ERROR_CHARS]}") from None

    def error(self) -> str | None:
        """Why the guide does not compile (None if it does), checked without a tokenizer in a few
        ms: the OpenAI front names the request's field before the engine sees it. What only the
        tokenizer can tell (a lexer past LIMITS) the engine still says when it compiles."""
        try:
            self.check()
            problem = llguidance.LLMatcher.validate_grammar(self.grammar())
        except RequestError as e:
            return str(e)
        return f"the {self.kind} guide is invalid: {problem[:MAX_ERROR_CHARS]}" if problem else None


def choices(text: str) -> list[str]:
    try:
        values = json.loads(text)
    except ValueError:
        values = None
    if not isinstance(values, list) or not values or not all(isinstance(v, str) and v for v in values):
        raise RequestError(f"a choice guide is a JSON list of non-empty strings, got {quote(text)}")
    return values


class Grammars:
    """The engine's compiler of guides: llguidance's tokenizer over the engine's tokenizer.json
    (built once, on the first guided request) and the cache of compiled grammars. Thread-safe:
    requests are prepared on their callers' threads."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer_json = Path(tokenizer_json)
        self.vocab_size = vocab_size  # the model's logits; a tokenizer's may be smaller
        self.eos_token_ids = tuple(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Guide, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict(grammar_compiles=0, grammar_cache_hits=0)

    def constraint(self, guide: Guide, end_ids: frozenset[int]) -> "Constraint":
        """A fresh matcher for one request (RequestError if the guide does not compile);
        end_ids: the tokens that end this request's text."""
        with self._lock:
            cached = self._compiled.get(guide)
            if cached is not None:
                self._compiled.move_to_end(guide)
                self.counters["grammar_cache_hits"] += 1
                return Constraint(cached.deep_copy(), self._tokenizer, end_ids, self.vocab_size)
            tokenizer = self._tokenizer = self._tokenizer or self._load_tokenizer()
        matcher = compile_matcher(guide, tokenizer)  # outside the lock: llguidance drops the GIL meanwhile
        with self._lock:
            self.counters["grammar_compiles"] += 1
            self._compiled[guide] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
            return Constraint(matcher.deep_copy(), tokenizer, end_ids, self.vocab_size)

    def _load_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer without the added tokens that are text (Qwen3's <think>,
        <tool_call>): llguidance reads every added token as special, yet spells a grammar's
        literal "<tool_call>" with that token, then fails to consume it ("forced bytes: got '<'").
        Without them a literal is written out of ordinary tokens (the same text), and their ids,
        unknown to llguidance, are never allowed."""
        import tokenizers

        size = tokenizers.Tokenizer.from_file(str(self.tokenizer_json)).get_vocab_size(with_added_tokens=True)
        spec = json.loads(self.tokenizer_json.read_text(encoding="utf-8"))
        spec["added_tokens"] = [t for t in spec.get("added_tokens") or [] if t.get("special")]
        return llguidance.LLTokenizer(json.dumps(spec), n_vocab=max(size, self.vocab_size),
                                      eos_token=list(self.eos_token_ids) or None)


def compile_matcher(guide: Guide, tokenizer: llguidance.LLTokenizer) -> llguidance.LLMatcher:
    matcher = llguidance.LLMatcher(tokenizer, guide.grammar(), log_level=0,
                                   limits=llguidance.LLParserLimits(**LIMITS, verbose_errors=False))
    if matcher.is_error():
        raise RequestError(f"the {guide.kind} guide is invalid: {matcher.get_error()[:MAX_ERROR_CHARS]}")
    return matcher


class Constraint:
    """One request's place in its grammar: which tokens may come next, advanced over each token
    of its output (only on the engine's thread)."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer, end_ids: frozenset[int],
                 vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        # the grammar's own end (llguidance's EOS) gives way to the request's end tokens
        self.grammar_ends = np.array(tokenizer.eos_tokens, np.int64)
        self.end_ids = np.array(sorted(end_ids), np.int64)
        self._allowed: np.ndarray | None = None  # for the matcher's present state

    def allowed(self) -> np.ndarray:
        """Which tokens may come next [vocab] bool: the grammar's, the end tokens where it accepts.
        Kept until the next accepted token: jump-forward's check and the next sample share it."""
        if self._allowed is None:
            bits = np.frombuffer(self.matcher.compute_bitmask(), np.uint8)
            allowed = np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)
            allowed[self.grammar_ends] = False
            allowed[self.end_ids] = self.matcher.is_accepting()
            self._allowed = allowed
        return self._allowed

    def forced(self) -> int | None:
        """The next token if the grammar allows no other and no end (None otherwise)."""
        allowed = self.allowed()
        if np.count_nonzero(allowed) != 1 or self.matcher.is_accepting():
            return None
        return int(np.flatnonzero(allowed)[0])

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """The row's logits with every token the grammar forbids at -inf; the end tokens are
        allowed where the grammar accepts. RequestError if nothing allowed is left (the request's
        bans removed every token the grammar allows)."""
        masked = np.where(self.allowed(), logits, -np.inf)
        if not np.isfinite(masked).any():
            raise RequestError(self.error() or "the guide allows no token that the request's bans (bad_words, "
                                               "min_tokens) leave")
        return masked

    def accept(self, token: int) -> None:
        """Advance over an output token (one the mask allowed)."""
        self.matcher.consume_token(token)
        self._allowed = None

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of these tokens, in order, the grammar allows from here (the matcher stays)."""
        return self.matcher.validate_tokens(tokens)

    @property
    def done(self) -> bool:
        """No token can follow: the output is complete (or the matcher failed: see error)."""
        return self.matcher.is_stopped()

    def error(self) -> str | None:
        """Why the matcher failed (a step past LIMITS), or None."""
        return f"the guide failed: {self.matcher.get_error()[:MAX_ERROR_CHARS]}" if self.matcher.is_error() else None
