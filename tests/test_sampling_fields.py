"""Issue 42's sampling fields: top log-probs, min_p, logit_bias, allowed_token_ids, stop_token_ids
(and vllm_model's guided_decoding), in the engine, through the llm model's inputs and outputs and
through the OpenAI API. The engine tests check exact effects on greedy or seeded outputs; the
served ones that each field arrives and that a bad value is a 400 naming it."""
from __future__ import annotations

import json

import numpy as np
import openai
import pytest

from kvforge.errors import RequestError
from kvforge.manifest import Manifest
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.sampling import log_softmax
from runtime.scorer import Scorer
from runtime.tokenizer import Tokenizer
from tests.conftest import SERVING_CONTEXT

PROMPT = "def fibonacci(n):"
TOKENS = 12


@pytest.fixture(scope="module")
def engine(fp32):
    with LLMEngine(fp32) as engine:
        yield engine


def tokens(engine, **options) -> list[int]:
    return engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, **options))[0].token_ids


def test_bias_mask_min_p_and_stop_ids_change_tokens_exactly(engine):
    greedy = tokens(engine)
    assert len(greedy) == TOKENS
    assert tokens(engine, logit_bias=((greedy[0], -100.0),))[0] != greedy[0]
    favourite = next(t for t in range(100, 200) if t not in engine.tokenizer.eos_token_ids and t not in greedy)
    assert tokens(engine, logit_bias=((favourite, 100.0),)) == [favourite] * TOKENS
    allowed = tuple(sorted({*greedy[1:4], favourite}))
    for seed in range(3):
        assert set(tokens(engine, allowed_token_ids=allowed, temperature=1.0, seed=seed)) <= set(allowed)
    # only the most likely token has p >= 1.0 * p_max: sampling becomes greedy
    assert tokens(engine, min_p=1.0, temperature=1.5, seed=4) == greedy
    sampled = [tokens(engine, min_p=0.0, temperature=1.5, seed=seed) for seed in range(3)]
    assert any(s != greedy for s in sampled)  # without it the same seeds do not
    stop = greedy[6]
    cut = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, stop_token_ids=(stop,)))[0]
    assert cut.token_ids == greedy[:greedy.index(stop)] and cut.finish_reason == "stop"
    assert cut.text == engine.tokenizer.decode(cut.token_ids)  # the stop token is not in the text


def test_top_logprobs_are_the_raw_models_and_only_for_rows_that_ask(engine, fp32):
    asked, plain = engine.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=TOKENS, logprobs=True, top_logprobs=5),
                                                      SamplingParams(max_tokens=TOKENS, logprobs=True)])
    assert plain.top_logprobs is None and asked.token_ids == plain.token_ids
    prompt_ids = engine.tokenizer.encode(PROMPT)
    logits = Scorer(fp32, max_rows=1).score([np.array(prompt_ids + asked.token_ids)])[0]
    assert len(asked.top_logprobs) == len(asked.token_ids)
    for i, (token, logprob, top) in enumerate(zip(asked.token_ids, asked.logprobs, asked.top_logprobs)):
        assert len(top) == 5 and top[0] == (token, logprob)  # greedy: the chosen token is the most likely
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        reference = log_softmax(logits[len(prompt_ids) - 1 + i])
        assert [t for t, _ in top] == list(np.argsort(-reference, kind="stable")[:5])
        assert np.allclose([v for _, v in top], reference[[t for t, _ in top]], atol=1e-4)
    # with a bias the chosen token changes, its log-prob stays the model's own
    biased = engine.generate([PROMPT], SamplingParams(max_tokens=1, logprobs=True, top_logprobs=2,
                                                      logit_bias=((asked.token_ids[0], -100.0),)))[0]
    assert biased.token_ids[0] == asked.top_logprobs[0][1][0]
    assert biased.logprobs[0] == pytest.approx(asked.top_logprobs[0][1][1], abs=1e-6)
    assert biased.top_logprobs[0] == asked.top_logprobs[0][:2]


@pytest.mark.parametrize("options, message", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in 0..20"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ({"logit_bias": ((1, 101.0),)}, r"logit_bias of token 1 must be in \[-100, 100\]"),
    ({"logit_bias": tuple((t, 1.0) for t in range(301))}, "logit_bias holds at most 300 tokens"),
    ({"logit_bias": ((99999, 1.0),)}, r"logit_bias names token 99999, which is not in the vocabulary"),
    ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias names token 3 twice"),
    ({"allowed_token_ids": (-1,)}, "allowed_token_ids holds -1, which is no token id"),
    ({"allowed_token_ids": (99999,)}, "allowed_token_ids names token 99999"),
    ({"stop_token_ids": (99999,)}, "stop_token_ids names token 99999"),
])
def test_bad_values_raise_request_error_naming_the_field(engine, options, message):
    with pytest.raises(RequestError, match=message):
        engine.submit(PROMPT, SamplingParams(max_tokens=2, **options))


# ---------------------------------------------------------------------- served


@pytest.fixture(scope="module")
def client(triton):
    return openai.OpenAI(base_url=triton.openai_url, api_key="unused", max_retries=0)


def test_openai_top_logprobs_on_chat_and_completions_streamed_and_not(client):
    messages = [{"role": "user", "content": "count"}]
    chat = client.chat.completions.create(model="llm", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob and entry.bytes == list(entry.token.encode())
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    streamed = client.chat.completions.create(model="llm", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, stream=True)
    assert [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
            for e in chunk.choices[0].logprobs.content] == content
    completion = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.top_logprobs) == len(logprobs.tokens) == 6
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == logprob == max(top.values()) and len(top) <= 3
    streamed = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                         stream=True)
    assert [top for chunk in streamed for top in chunk.choices[0].logprobs.top_logprobs] == logprobs.top_logprobs


@pytest.fixture(scope="module")
def served_tokenizer(exports):
    engine_dir = exports(max_seq_len=SERVING_CONTEXT)
    return Tokenizer(engine_dir, Manifest.load(engine_dir))


def test_openai_bias_mask_min_p_and_stop_ids(client, served_tokenizer):
    def completion(**extra):
        return client.completions.create(model="llm", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                         extra_body=extra).choices[0]

    greedy = completion()
    ids = served_tokenizer.encode(PROMPT + greedy.text, add_special_tokens=False)[len(served_tokenizer.encode(
        PROMPT, add_special_tokens=False)):]
    assert served_tokenizer.decode(ids) == greedy.text
    assert not completion(logit_bias={str(ids[0]): -100}).text.startswith(served_tokenizer.decode(ids[:1]))
    favourite = next(t for t in range(100, 200) if t not in served_tokenizer.eos_token_ids and t not in ids)
    chat = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, temperature=0, logit_bias={str(favourite): 100})
    assert chat.choices[0].message.content == served_tokenizer.decode([favourite] * 4)
    masked = completion(allowed_token_ids=[favourite], temperature=1.0, seed=1)
    assert masked.text == served_tokenizer.decode([favourite] * TOKENS)
    assert completion(min_p=1.0, temperature=1.5, seed=2).text == greedy.text
    stopped = completion(stop_token_ids=[favourite], logit_bias={str(favourite): 100})
    assert stopped.text == "" and stopped.finish_reason == "stop"


@pytest.mark.parametrize("endpoint, fields, param, message", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs"),
    ("completions", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("chat", {"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
    ("completions", {"logit_bias": {"five": 1}}, "logit_bias", "keys are token ids, got 'five'"),
    ("chat", {"logit_bias": {"99999": 1}}, "logit_bias", "logit_bias names token 99999"),
    ("chat", {"logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias", "at most 300"),
    ("completions", {"allowed_token_ids": [99999]}, "allowed_token_ids", "allowed_token_ids names token 99999"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids.0", "greater than or equal to 0"),
])
def test_bad_sampling_fields_are_a_400_naming_the_field(client, endpoint, fields, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        if endpoint == "chat":
            client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                           extra_body=fields)
        else:
            client.completions.create(model="llm", prompt=PROMPT, max_tokens=2, extra_body=fields)
    assert error.value.body["param"] == param and message in error.value.body["message"], error.value.body


def test_the_router_reads_the_prompt_of_a_body_with_these_fields(triton):
    """The router's request models are the front's: a body with the new fields is routed by its prompt."""
    from frontend.router.prompts import Prompts

    prompts = Prompts(triton.repo)
    fields = {"min_p": 0.1, "logit_bias": {"5": -100}, "allowed_token_ids": [5, 6], "stop_token_ids": [7]}
    for path, body in (("/v1/completions", {"model": "llm", "prompt": PROMPT, "logprobs": 5}),
                       ("/v1/chat/completions", {"model": "llm", "messages": [{"role": "user", "content": "x"}],
                                                 "logprobs": True, "top_logprobs": 20})):
        plain = prompts.of_openai(path, json.dumps(body).encode())[0]
        assert plain and prompts.of_openai(path, json.dumps({**body, **fields}).encode())[0] == plain
