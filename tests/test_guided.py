"""Constrained decoding (issue 42): a guide (JSON schema, JSON object, regex, EBNF grammar, choice
list) decides which tokens may come next, in the engine, through the llm model's TensorRT-LLM
inputs and through the OpenAI API. The tiny preset's weights are random: whatever it would write,
the guide makes it valid, so every output that ends with "stop" must match its guide."""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Literal

import httpx
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from clients.api import GenerationError, LLMClient
from kvforge.errors import RequestError
from runtime.grammar import CACHE_SIZE, Grammars, Guide
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.speculation import Speculation

PROMPT = "def fibonacci(n):"
MAX_TOKENS = 200  # every guide below ends well within this
# nested objects, enums, bounded arrays, anyOf and string patterns
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "kind": {"enum": ["leaf", "node"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
        "parent": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                    "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                                     {"const": "none"}]}},
                   "required": ["ok", "id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "size", "tags", "parent"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe not"]
GRAMMARS = {  # the same language as llguidance's Lark and as GBNF (TensorRT-LLM's and llama.cpp's EBNF)
    'start: "x" DIGIT "+" DIGIT\nDIGIT: /[0-9]/': r"x[0-9]\+[0-9]",
    'root ::= "x" digit "+" digit\ndigit ::= [0-9]': r"x[0-9]\+[0-9]",
}


@pytest.fixture(scope="module")
def engine(fp32):
    with LLMEngine(fp32) as engine:
        yield engine


def guided(kind: str, text: str = "", **options) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, guide=Guide(kind, text), **options)


def test_every_guide_holds_greedy_and_sampled_beside_free_requests(engine):
    """One batch: each guide greedy and seeded-sampled, beside unguided requests, whose text the
    guided rows beside them leave as it is alone."""
    free = SamplingParams(max_tokens=24)
    alone = engine.generate([PROMPT], free)[0]
    guides = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("choice", json.dumps(CHOICES)),
              *(("ebnf_grammar", grammar) for grammar in GRAMMARS)]
    params = [free] + [guided(kind, text, **sampling) for kind, text in guides
                       for sampling in ({}, {"temperature": 1.0, "seed": 7})] + [free]
    results = engine.generate([PROMPT] * len(params), params)
    assert results[0].token_ids == results[-1].token_ids == alone.token_ids
    for p, result in zip(params[1:-1], results[1:-1]):
        assert result.finish_reason == "stop", (p.guide, result)
        kind, text = p.guide.kind, p.guide.text
        if kind == "json_schema":
            jsonschema.validate(json.loads(result.text), SCHEMA)
        elif kind == "choice":
            assert result.text in CHOICES
        else:
            assert re.fullmatch(REGEX if kind == "regex" else GRAMMARS[text], result.text), (kind, result.text)
    stats = engine.stats()
    assert stats["grammar_compiles"] >= len(guides) and stats["grammar_cache_hits"] >= len(guides)


def test_a_json_guide_makes_any_json_object(engine):
    """Any JSON object has unbounded strings, which the random model may never close: an answer
    that ends is an object, one cut at max_tokens is a prefix the grammar accepts token by token."""
    result = engine.generate([PROMPT], guided("json"))[0]
    assert result.text.startswith("{"), result
    if result.finish_reason == "stop":
        assert isinstance(json.loads(result.text), dict), result
    else:
        fresh = engine.grammars.constraint(Guide("json"), frozenset(engine.tokenizer.eos_token_ids))
        assert fresh.valid_prefix(result.token_ids) == len(result.token_ids), result


def test_the_mask_allows_the_grammar_and_the_end_only_where_it_accepts(engine):
    """The tokens allowed first are those that begin the language; the request's end tokens (here
    a stop token id besides EOS) only once the grammar accepts; a drafted token the grammar
    forbids is cut; a grammar that can take no more tokens is done."""
    end_ids = frozenset(engine.tokenizer.eos_token_ids) | {7}
    constraint = engine.grammars.constraint(Guide("regex", "ab+"), end_ids)
    zeros = np.zeros(engine.limits.vocab_size)
    masked = constraint.mask(zeros)
    assert (masked[sorted(end_ids)] == -np.inf).all()  # nothing written yet: no end
    allowed = np.flatnonzero(masked == 0)
    decoded = {t: engine.tokenizer.decode([int(t)]) for t in range(engine.limits.vocab_size)}
    # llguidance may leave out a token that only a non-canonical split would follow ("a" then "b" where "ab" is one token)
    assert 0 < len(allowed) and set(allowed) <= {t for t, text in decoded.items() if re.fullmatch("ab*", text)}
    a, b = (engine.tokenizer.encode(c, add_special_tokens=False) for c in ("a", "b"))
    for token in a + b:
        constraint.accept(token)
    assert (constraint.mask(zeros)[sorted(end_ids)] == 0).all() and not constraint.done  # "ab": may end or go on
    assert constraint.valid_prefix(b + b + a) == 2  # a draft is cut before the token the grammar forbids
    single = engine.grammars.constraint(Guide("choice", '["ab"]'), end_ids)
    for token in engine.tokenizer.encode("ab", add_special_tokens=False):
        single.accept(token)
    assert single.done


def test_bad_guides_are_refused_alone_naming_the_problem(engine):
    done, outputs = threading.Event(), []

    def collect(out):
        outputs.append(out)
        if out.finished:
            done.set()

    engine.submit(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), collect)
    for guide, options, message in [
            (Guide("yaml", "a: b"), {}, "the guide type must be one of"),
            (Guide("json_schema", '{"type": "nonsense"}'), {}, "the json_schema guide is invalid"),
            (Guide("json_schema", "{not json"), {}, "the json_schema guide is invalid"),
            (Guide("json_schema", "[1, 2]"), {}, "must be a JSON object"),
            (Guide("regex", "(unclosed"), {}, "the regex guide is invalid"),
            (Guide("ebnf_grammar", "start: undefined_rule"), {}, "the ebnf_grammar guide is invalid"),
            (Guide("choice", "[]"), {}, "a JSON list of non-empty strings"),
            (Guide("json", "{}"), {}, "takes no text"),
            (Guide("regex", ""), {}, "needs its text"),
            (Guide("regex", "a" * 70000), {}, "at most"),
            (Guide("regex", "a+"), {"ignore_eos": True}, "ignore_eos cannot go with a guide")]:
        with pytest.raises(RequestError, match=re.escape(message)):
            engine.submit(PROMPT, SamplingParams(max_tokens=8, guide=guide, **options))
    # bad_words that ban every token the guide allows end that request with an error, not the engine
    with pytest.raises(RequestError, match="the guide allows no token"):
        engine.generate([PROMPT], guided("choice", '["x"]', bad_words=("x",)))
    assert engine.generate([PROMPT], guided("choice", json.dumps(CHOICES)))[0].text in CHOICES
    assert done.wait(120)  # the request submitted before them was served to its end
    assert outputs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outputs) == 8


def test_the_grammar_cache_is_bounded_and_reused(fp32):
    grammars = Grammars(fp32 / "tokenizer.json", 4096, (2,))
    for n in range(CACHE_SIZE + 1):
        grammars.constraint(Guide("regex", f"a{{{n + 1}}}"), frozenset({2}))
    grammars.constraint(Guide("regex", f"a{{{CACHE_SIZE + 1}}}"), frozenset({2}))  # the newest: cached
    grammars.constraint(Guide("regex", "a{1}"), frozenset({2}))  # the oldest: evicted, compiled again
    assert grammars.counters == dict(grammar_compiles=CACHE_SIZE + 2, grammar_cache_hits=1)


# long keys, every one required, in order, and no other: the grammar forces each `, "key": ` token by token
FIXED_KEYS = {"type": "object", "additionalProperties": False,
              "properties": {"identification_number": {"type": "integer", "minimum": 0, "maximum": 9},
                             "classification_category": {"enum": ["alpha_leaf", "beta_node"]},
                             "is_currently_available_for_use": {"type": "boolean"}},
              "required": ["identification_number", "classification_category", "is_currently_available_for_use"]}
FORCED_PROMPT = "record = "


def same(got, expected) -> None:
    assert (got.token_ids, got.text, got.finish_reason) == (expected.token_ids, expected.text,
                                                           expected.finish_reason), (got, expected)


def test_jump_forward_gives_the_same_output_in_fewer_steps(fp32, engine):
    """Forced runs (keys, quotes, separators) taken at once and fed as chunks (the default):
    greedy and seeded output, alone and beside an unguided row, is step-by-step decoding's, and
    alone it saves one step per forced token; max_tokens and a stop string cut inside a forced run
    where they did."""
    schema = guided("json_schema", json.dumps(FIXED_KEYS))
    def since(before: dict) -> dict:  # the module's engine counted earlier tests' requests too
        now = engine.stats()
        return {key: now[key] - before[key] for key in ("steps", "forced_tokens", "prompt_tokens")}

    with LLMEngine(fp32, jump_forward=False) as stepwise:
        before = stepwise.stats()["steps"], engine.stats()
        expected, got = (e.generate([FORCED_PROMPT], schema)[0] for e in (stepwise, engine))
        stats = since(before[1])
        same(got, expected)
        assert got.finish_reason == "stop"
        jsonschema.validate(json.loads(got.text), FIXED_KEYS)
        assert stats["forced_tokens"] > 0
        assert (stepwise.stats()["steps"] - before[0]) - stats["steps"] == stats["forced_tokens"]
        # the forced tokens that begin the output go with the prompt's chunk and are not counted as prompt
        assert stats["prompt_tokens"] == len(engine.tokenizer.encode(FORCED_PROMPT))

        mixed = [SamplingParams(max_tokens=24), schema, guided("json_schema", json.dumps(FIXED_KEYS),
                                                               temperature=1.0, seed=3), SamplingParams(max_tokens=24)]
        for got, expected in zip(engine.generate([FORCED_PROMPT] * 4, mixed), stepwise.generate([FORCED_PROMPT] * 4,
                                                                                                mixed)):
            same(got, expected)
        assert since(before[1])["forced_tokens"] > 2 * stats["forced_tokens"]  # both guided rows jumped

        # cut at every length within the first forced run, and by a stop string inside a key
        for params in [*(dataclasses.replace(schema, max_tokens=n) for n in range(1, 8)),
                       dataclasses.replace(schema, stop=("category",))]:
            expected, got = (e.generate([FORCED_PROMPT], params)[0] for e in (stepwise, engine))
            same(got, expected)
            assert len(got.token_ids) <= params.max_tokens
        assert got.finish_reason == "stop" and got.text.endswith('"classification_')
        # a request asking for log-probs decodes step by step: its forced tokens' log-probs are the model's
        counted = engine.stats()["forced_tokens"]
        expected, got = (e.generate([FORCED_PROMPT], dataclasses.replace(schema, logprobs=True))[0]
                         for e in (stepwise, engine))
        same(got, expected)
        assert got.logprobs == expected.logprobs and engine.stats()["forced_tokens"] == counted


def test_speculation_gives_a_guided_request_the_same_text(fp32):
    """Drafts come from the prompt's own JSON, some of whose tokens the grammar forbids (cut from
    the draft); greedy guided text with speculation equals it without."""
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 8, "maxItems": 8}
    prompt = '["alpha", "beta", "gamma", "alpha", "beta", "gamma"] ["alpha", "beta", "gamma", "alpha"] '
    params = guided("json_schema", json.dumps(schema))
    with LLMEngine(fp32, jump_forward=False) as plain:
        expected = plain.generate([prompt], params)[0]
    with LLMEngine(fp32, speculation=Speculation(), jump_forward=False) as engine:
        got = engine.generate([prompt], params)[0]
        stats = engine.stats()
    assert expected.finish_reason == "stop" and len(json.loads(expected.text)) == 8
    assert got.token_ids == expected.token_ids and got.text == expected.text
    assert stats["spec_draft_tokens"] > 0 and stats["spec_accepted_tokens"] > 0  # speculation did run
    # with jump-forward too (the default): a row drafts only in steps without a forced chunk
    with LLMEngine(fp32, speculation=Speculation()) as engine:
        same(engine.generate([prompt], params)[0], expected)
        assert engine.stats()["forced_tokens"] > 0


# ---------------------------------------------------------------------- through Triton

@pytest.fixture(scope="module")
def client(triton):
    return openai.OpenAI(base_url=triton.openai_url, api_key="unused", max_retries=0)


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,8}$")
    kind: Literal["leaf", "node"]
    size: int = pydantic.Field(ge=0, le=99)
    tags: list[Literal["red", "green"]] = pydantic.Field(min_length=1, max_length=3)


def test_openai_response_formats_are_enforced(client):
    messages = [{"role": "user", "content": "describe an item"}]
    parsed = client.chat.completions.parse(model="llm", messages=messages, response_format=Item, max_tokens=MAX_TOKENS,
                                           temperature=0)
    assert parsed.choices[0].finish_reason == "stop" and isinstance(parsed.choices[0].message.parsed, Item)
    schema_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        got = client.chat.completions.create(model="llm", messages=messages, response_format=schema_format,
                                             max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    streamed = client.chat.completions.create(model="llm", messages=messages, response_format={"type": "json_object"},
                                              max_tokens=MAX_TOKENS, temperature=0, stream=True)
    chunks = list(streamed)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)


def test_vllm_guided_fields_on_completions_and_chat(client):
    def completion(**extra) -> str:
        got = client.completions.create(model="llm", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body=extra)
        assert got.choices[0].finish_reason == "stop", got
        return got.choices[0].text

    assert re.fullmatch(REGEX, completion(guided_regex=REGEX))
    assert completion(guided_choice=CHOICES) in CHOICES
    assert completion(structured_outputs={"choice": CHOICES}) in CHOICES
    for grammar, language in GRAMMARS.items():
        assert re.fullmatch(language, completion(guided_grammar=grammar))
    jsonschema.validate(json.loads(completion(guided_json=SCHEMA)), SCHEMA)
    jsonschema.validate(json.loads(completion(structured_outputs={"json": json.dumps(SCHEMA)})), SCHEMA)
    chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "pick"}],
                                          max_tokens=MAX_TOKENS, extra_body={"guided_choice": CHOICES})
    assert chat.choices[0].message.content in CHOICES


@pytest.mark.parametrize("call, param, message", [
    (dict(extra_body={"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice", "both constrain the output"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_json": {"type": "object"}}), "guided_json",
     "both constrain the output"),
    (dict(extra_body={"structured_outputs": {"whitespace_pattern": " "}}), "structured_outputs.whitespace_pattern",
     "unknown field"),
    (dict(extra_body={"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend", "unknown field"),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema", "goes with type json_schema"),
    (dict(response_format={"type": "yaml"}), "response_format.type", "response_format.type"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format.json_schema.schema", "the json_schema guide is invalid"),
    (dict(extra_body={"guided_json": {"type": "nonsense"}}), "guided_json", "the json_schema guide is invalid"),
    (dict(extra_body={"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex",
     "the regex guide is invalid"),
])
def test_bad_or_conflicting_guides_are_a_400_and_the_server_keeps_serving(client, call, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(**{"model": "llm", "messages": [{"role": "user", "content": "x"}],
                                          "max_tokens": 4, **call})
    assert error.value.body["param"] == param and message in error.value.body["message"], error.value.body
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"guided_choice": CHOICES}).choices[0].text in CHOICES


def test_tensorrt_llm_guided_inputs_over_grpc_and_generate(triton):
    grpc = LLMClient(triton.grpc_url, "grpc")
    got = grpc.generate(PROMPT, max_tokens=MAX_TOKENS, guided_decoding_guide_type="json_schema",
                        guided_decoding_guide=json.dumps(SCHEMA))
    jsonschema.validate(json.loads(got.text), SCHEMA)
    response = httpx.post(f"http://{triton.http_url}/v2/models/llm/generate", timeout=120,
                          json={"text_input": PROMPT, "max_tokens": MAX_TOKENS, "guided_decoding_guide_type": "regex",
                                "guided_decoding_guide": REGEX})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["finish_reason"] == "stop" and re.fullmatch(REGEX, body["text_output"]), body
    with pytest.raises(GenerationError, match="guided_decoding_guide needs guided_decoding_guide_type"):
        grpc.generate(PROMPT, max_tokens=4, guided_decoding_guide=REGEX)
    with pytest.raises(GenerationError, match="the regex guide is invalid"):
        grpc.generate(PROMPT, max_tokens=4, guided_decoding_guide_type="regex", guided_decoding_guide="(")
    assert grpc.generate(PROMPT, max_tokens=4).token_ids  # served on
