"""The OpenAI-compatible API, driven by the official `openai` client, in front of a real tritonserver."""
from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn

from clients.api import LLMClient
from frontend.chat_template import ChatTemplate
from frontend.config import FrontConfig
from frontend.openai_api import create_openai_app, engine_dir_of
from runtime.tokenizer import Tokenizer
from launcher.harness import free_ports

PROMPT = "def fibonacci(n):"


@contextmanager
def serve(app):
    """An app made here (another config than the launcher's) on a free loopback port, served by
    uvicorn on a thread."""
    port, = free_ports(1)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


def config(triton, **fields) -> FrontConfig:
    return FrontConfig(triton_http=triton.http_url, triton_grpc=triton.grpc_url, model_repository=triton.repo, **fields)


@pytest.fixture(scope="module")
def base_url(triton):
    return triton.openai_url  # the launcher's front serves the API, as `make serve` does


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def grpc(triton):
    return LLMClient(triton.grpc_url, "grpc")


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["llm"]


def test_completions_equal_the_llm_model(client, grpc):
    expected = grpc.generate(PROMPT, max_tokens=24)
    got = client.completions.create(model="llm", prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0)
    choice = got.choices[0]
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert got.id.startswith("cmpl-") and got.usage.completion_tokens == 24
    # a prompt of at most one block: never a cached block (the last prompt token is always computed)
    assert 0 < got.usage.prompt_tokens <= 16 and got.usage.prompt_tokens_details.cached_tokens == 0
    assert len(choice.logprobs.token_logprobs) == 24 and all(lp < 0 for lp in choice.logprobs.token_logprobs)
    streamed = client.completions.create(model="llm", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text
    echoed = client.completions.create(model="llm", prompt=PROMPT, max_tokens=24, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text
    stop = expected.text[8:12]
    cut = client.completions.create(model="llm", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert cut.choices[0].text == expected.text[:expected.text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(client):
    prompt = "def usage_probe(rows):\n" + "".join(f"    rows[{i}] = rows[{i - 1}] + {i}\n" for i in range(1, 30))
    cold, warm = (client.completions.create(model="llm", prompt=prompt, max_tokens=4, temperature=0) for _ in range(2))
    full = (cold.usage.prompt_tokens - 1) // 16 * 16
    assert full >= 64 and cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == full and warm.choices[0].text == cold.choices[0].text


def test_seeded_sampling_and_n_choices(client):
    def run():
        return client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=11, n=3)

    first, again = run(), run()
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 36  # seed, seed+1, seed+2 differ


def test_chat_completions_render_the_chat_template(client, grpc):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fibonacci"}]
    rendered = "system: You write Python.\nuser: fibonacci\nassistant:"  # the presets' template
    expected = grpc.generate(rendered, max_tokens=16)
    got = client.chat.completions.create(model="llm", messages=messages, max_completion_tokens=16, temperature=0,
                                         logprobs=True)
    assert got.choices[0].message.content == expected.text and got.choices[0].message.role == "assistant"
    assert got.usage.completion_tokens == 16 and len(got.choices[0].logprobs.content) == 16
    chunks = list(client.chat.completions.create(model="llm", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert chunks[-1].usage.total_tokens == got.usage.total_tokens
    assert all(c.id == chunks[0].id for c in chunks) and chunks[0].id.startswith("chatcmpl-")


@pytest.mark.parametrize("call, status, message", [
    (dict(extra_body={"best_effort": True}), 400, "unknown field best_effort"),
    (dict(model="gpt-4"), 404, "does not exist"),
    (dict(max_tokens=100000), 400, "exceeds the context"),
    (dict(top_p=2), 400, "top_p"),
    (dict(logprobs=6), 400, "logprobs"),
    (dict(extra_body={"top_k": -1}), 400, "top_k"),
    (dict(prompt=""), 400, "the prompt is empty"),
    (dict(prompt=["def f():"] * 9), 400, "send 1..8 prompts, got 9"),
])
def test_bad_completions_get_openai_shaped_errors(client, call, status, message):
    with pytest.raises(openai.APIStatusError) as error:
        client.completions.create(**{"model": "llm", "prompt": PROMPT, "max_tokens": 4, **call})
    assert error.value.status_code == status
    body = error.value.body
    assert message in body["message"] and body["type"] in ("invalid_request_error",) and "param" in body


def test_a_list_of_prompts_gets_a_choice_for_each(client):
    """`prompt` as a list (docs/openai-api.md): one choice per prompt, in order, each the answer
    that prompt gets alone; usage counts them all."""
    prompts = [PROMPT, "class Stack:", "import os\n"]
    alone = [client.completions.create(model="llm", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    together = client.completions.create(model="llm", prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_vllm_sampling_fields_with_their_meaning(client):
    # seeded sampled choices, of which one ends at the end token (seed 10, after 404 tokens: the
    # tiny model rarely emits it)
    def choices(**extra):
        got = client.completions.create(model="llm", prompt=PROMPT, max_tokens=600, temperature=1.0, seed=8, n=8,
                                        extra_body=extra)
        return sorted(got.choices, key=lambda c: c.index)

    plain = choices()
    ended = [c.index for c in plain if c.finish_reason == "stop"]
    assert ended, "no seed of 8..15 reached the end token within 600 tokens"
    ignoring = choices(ignore_eos=True, skip_special_tokens=True, include_stop_str_in_output=False)
    for i in ended:  # the same tokens up to the end token, which no longer ends the text
        assert ignoring[i].finish_reason == "length" and ignoring[i].text.startswith(plain[i].text)
        assert len(ignoring[i].text) > len(plain[i].text)
    for field, value in (("skip_special_tokens", False), ("include_stop_str_in_output", True)):
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model="llm", prompt=PROMPT, max_tokens=4, extra_body={field: value})
        assert error.value.body["param"] == field, error.value.body


def test_text_that_is_no_unicode_is_a_400_naming_the_field(base_url):
    # sent as bytes: a client's JSON encoder would refuse the lone surrogate itself
    chat = b'{"model": "llm", "max_tokens": 4, "messages": [{"role": "user", "content": "hi \\udfff"}]}'
    for path, body, param in (("completions", b'{"model": "llm", "prompt": "\\ud800", "max_tokens": 4}', "prompt"),
                              ("chat/completions", chat, "messages.0.content")):
        response = httpx.post(f"{base_url}/{path}", content=body, headers={"Content-Type": "application/json"},
                              timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and "not valid Unicode" in error["message"], error


def test_llm_errors_get_their_kinds_status():
    from tritonclient.utils import InferenceServerException

    from frontend.openai_api import triton_error

    for message, status, kind in (("UNAVAILABLE: the waiting queue is full (0 requests)", 503, "server_busy"),
                                  ("INTERNAL: the engine step failed: boom", 500, "server_error"),
                                  ("the prompt is empty", 400, "invalid_request_error")):
        error = triton_error(InferenceServerException(message))
        assert (error.status, error.kind, error.message) == (status, kind, message)
        assert error.headers() == ({"Retry-After": "1"} if status == 503 else {})


def test_bad_chat_requests_get_openai_shaped_errors(client):
    for call, param in [(dict(messages=[]), "messages"),
                        (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools.0.function.name"),
                        (dict(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(**{"model": "llm", "messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 4, **call})
        assert error.value.body["param"] == param, error.value.body
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_api_key_is_required_when_configured(triton):
    with serve(create_openai_app(config(triton, api_key="s3cret"))) as url:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert openai.OpenAI(base_url=url, api_key="s3cret").models.list().data[0].id == "llm"


def test_a_model_without_chat_template_serves_completions_and_refuses_chat(triton, tmp_path):
    # the same Triton model, described by an engine dir whose tokenizer_config.json has no template
    engine = engine_dir_of(triton.repo, "llm")
    plain = tmp_path / "engine"
    plain.mkdir()
    for name in ("manifest.json", "tokenizer.json"):
        shutil.copy(engine / name, plain / name)
    settings = json.loads((engine / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    (tmp_path / "llm").mkdir()
    (tmp_path / "llm" / "config.pbtxt").write_text(f'parameters [ {{ key: "engine_dir" value: {{ string_value: "{plain}" }} }} ]')
    with serve(create_openai_app(FrontConfig(triton.http_url, triton.grpc_url, tmp_path))) as url:
        plain_client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            plain_client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "x"}])
        assert plain_client.completions.create(model="llm", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_a_client_that_disconnects_cancels_its_triton_stream(triton, base_url):
    from tests.test_serving import settled_metrics, wait_for_metrics

    before = settled_metrics(triton)
    # min_tokens: the sampled stream cannot end on an end token, only by its length or the cancel
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 2000, "min_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{base_url}/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # leave after the first event: the connection closes
    after = wait_for_metrics(triton, lambda m: m["kvforge_cancelled_requests_total"]
                             == before["kvforge_cancelled_requests_total"] + 1 and m["kvforge_running_sequences"] == 0,
                             "the cancellation")
    assert after["kvforge_finished_requests_total"] == before["kvforge_finished_requests_total"]
    assert after["kvforge_generated_tokens_total"] - before["kvforge_generated_tokens_total"] < 2000


@pytest.mark.parametrize("held", ["chat template", "tokenizer"])
def test_a_prompt_being_prepared_never_holds_the_front(triton, monkeypatch, held):
    """Rendering a chat template and tokenizing a prompt (for its max_tokens) run off the front's
    event loop: while one request's preparation is held, another request is answered in full."""
    holding, release = threading.Event(), threading.Event()

    def hold():
        holding.set()
        assert release.wait(120)

    render, encode = ChatTemplate.render, Tokenizer.encode
    if held == "chat template":
        monkeypatch.setattr(ChatTemplate, "render", lambda self, messages, *args, **kwargs: (
            hold() if messages[-1]["content"] == "held" else None) or render(self, messages, *args, **kwargs))
    else:
        # a chat without max_tokens is tokenized for the rest of the context
        monkeypatch.setattr(Tokenizer, "encode", lambda self, text, *args, **kwargs: (
            hold() if "held" in text else None) or encode(self, text, *args, **kwargs))
    with serve(create_openai_app(config(triton))) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        late = threading.Thread(target=lambda: client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": "held"}]))
        late.start()
        assert holding.wait(60), "the held request never reached its preparation"
        chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=8, stream=True, temperature=0))
        answered_while_held = not release.is_set()
        release.set()
        late.join(120)
    assert answered_while_held and sum(bool(c.choices[0].text) for c in chunks) >= 1
