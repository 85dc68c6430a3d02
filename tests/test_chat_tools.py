"""Chat requests rendered by public chat templates (tests/fixtures/chat_templates: Llama 3.1,
Qwen3, Gemma 3, Granite 3.3, Command R7B) as apply_chat_template renders them: plain chats,
system prompts, multi-turn, tools with assistant tool_calls and tool messages, documents,
chat_template_kwargs (Qwen3's enable_thinking), earlier reasoning, the templates' own refusals;
the front's refusals. Tool calls (frontend/tool_calls.py): each family's format, its grammar and
its reader agreeing; served through the front with the `openai` client and LangChain: tool_choice
required and named enforced by the grammar, the round trip, streamed calls, parallel_tool_calls,
bad schemas, auto. The tiny preset's weights are random: whatever it writes, an enforced call
parses and validates."""
import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest

from frontend.chat_template import TEMPLATE_FILE, ChatTemplate
from frontend.tool_calls import HERMES, LLAMA3_JSON, ToolCalls, arguments_schema, format_of, grammar, message_of
from runtime.grammar import Grammars, Guide

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = {"llama3.1": "meta-llama-Llama-3.1-8B-Instruct.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja",
             "gemma3": "google-gemma-3-1b-it.jinja", "granite3.3": "ibm-granite-granite-3.3-2B-Instruct.jinja",
             "command-r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja"}

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city <now>",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]},
            {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"},
            {"role": "user", "content": "And so?"}]
DOCUMENTS = [{"doc_id": 1, "title": "forecast", "text": "sun > rain"}]
# name -> an OpenAI chat body's template fields
CHATS = {
    "plain": {"messages": [{"role": "user", "content": "Hi there"}]},
    "system": {"messages": [{"role": "system", "content": "Be brief. <&>'é"}, {"role": "user", "content": "Hi"}]},
    "multi-turn": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Bye"}]},
    "tools": {"messages": MESSAGES, "tools": TOOLS},
    "documents": {"messages": MESSAGES[:2], "documents": DOCUMENTS},
}


def template_directory(tmp_path_factory, name: str) -> Path:
    """A directory named `name`: models/stdlib-llama's tokenizer, and the public template as
    chat_template.jinja (over the one tokenizer_config.json holds)."""
    directory = tmp_path_factory.mktemp("templates") / name
    directory.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "stdlib-llama" / file, directory / file)
    shutil.copy(ROOT / "tests" / "fixtures" / "chat_templates" / TEMPLATES[name], directory / TEMPLATE_FILE)
    return directory


@pytest.fixture(scope="module", params=list(TEMPLATES))
def template_dir(request, tmp_path_factory):
    return template_directory(tmp_path_factory, request.param)


def front_prompt(directory: Path, body: dict) -> str:
    """The prompt the front renders for a chat body (the parser and render path it serves with)."""
    from frontend.openai_api import ChatRequest, render_chat

    return render_chat(ChatTemplate(directory), ChatRequest.model_validate({"model": "llm", **body}))


def transformers_messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers documents them for templates: a tool call's arguments an object,
    where OpenAI sends JSON text."""
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if "tool_calls" in m else m for m in messages]


def assert_renders_as_transformers(directory: Path, body: dict) -> str | None:
    """The front's prompt equals apply_chat_template's, or both fail: where the template refuses
    (raise_exception) or breaks, the front's 400 says what the template said; returns the prompt."""
    import re

    from jinja2 import TemplateError
    from transformers import AutoTokenizer

    from frontend.openai_api import APIError

    try:
        expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
            transformers_messages(body["messages"]), tools=body.get("tools"), documents=body.get("documents"),
            add_generation_prompt=True, tokenize=False, **body.get("chat_template_kwargs", {}))
    except Exception as failure:  # noqa: BLE001 - whatever the template raises
        how = "refused the messages" if isinstance(failure, TemplateError) else "failed on these messages"
        with pytest.raises(APIError, match=f"the chat template {how}: {re.escape(str(failure))}") as refused:
            front_prompt(directory, body)
        assert refused.value.status == 400
        return None
    text = front_prompt(directory, body)
    assert text == expected
    return text


@pytest.mark.parametrize("chat", list(CHATS))
def test_public_templates_render_as_apply_chat_template(template_dir, chat):
    text = assert_renders_as_transformers(template_dir, CHATS[chat])
    family = template_dir.name
    if (family, chat) in (("gemma3", "tools"), ("command-r7b", "documents")):
        # a tool message breaks the user/model alternation Gemma's template demands (raise_exception);
        # Command R7B's loops over the tools, None when documents come alone
        assert text is None
        return
    assert "Hi" in text or "Paris" in text
    if chat == "tools" and family in ("llama3.1", "qwen3", "command-r7b"):
        # tools written with tojson: keys in order, nothing escaped, and the call's arguments an object
        assert "get_weather" in text and "Zürich" in text and "<now>" in text and "clear" in text
        assert '{"city": "Paris"}' in text and '"{\\"city' not in text
    if chat == "documents" and family in ("granite3.3", "command-r7b"):
        assert "sun > rain" in text


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_qwen3_thinking_as_apply_chat_template(tmp_path_factory, kwargs):
    """enable_thinking's empty <think> block, and an earlier turn's reasoning (vLLM's
    reasoning_content or reasoning) written back after the last query; tool_choice "none" offers
    no tools."""
    directory = template_directory(tmp_path_factory, "qwen3")
    reasoning = [{"role": "user", "content": "Weather in Paris?"},
                 {"role": "assistant", "content": "", "reasoning_content": "I should call it.", "tool_calls": [CALL]},
                 {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_1"}]
    body = {"messages": reasoning, "tools": TOOLS, "chat_template_kwargs": kwargs}
    text = assert_renders_as_transformers(directory, body)
    assert text.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)
    assert "<think>\nI should call it.\n</think>" in text
    renamed = [{k.replace("reasoning_content", "reasoning"): v for k, v in m.items()} for m in reasoning]
    assert front_prompt(directory, {**body, "messages": renamed}) == text
    unoffered = front_prompt(directory, {**body, "tool_choice": "none"})
    assert unoffered == assert_renders_as_transformers(directory, {"messages": reasoning, "chat_template_kwargs": kwargs})
    assert "<tools>" in text and "<tools>" not in unoffered


def test_without_generation_prompt_as_apply_chat_template(template_dir):
    from transformers import AutoTokenizer

    messages = CHATS["multi-turn"]["messages"]
    text = ChatTemplate(template_dir).render(messages, add_generation_prompt=False)
    assert text == AutoTokenizer.from_pretrained(template_dir).apply_chat_template(messages, tokenize=False)
    if template_dir.name != "command-r7b":  # whose template opens the chatbot's turn in every prompt
        assert text != ChatTemplate(template_dir).render(messages)


def test_template_fields_are_refused_by_name(template_dir):
    from pydantic import ValidationError

    from frontend.openai_api import APIError

    messages = MESSAGES[1:2]
    for key in ("messages", "add_generation_prompt", "bos_token"):
        with pytest.raises(APIError, match=f"chat_template_kwargs may not set {key}"):
            front_prompt(template_dir, {"messages": messages, "chat_template_kwargs": {key: 1}})
    with pytest.raises(ValidationError, match="tools.0.function.name"):
        front_prompt(template_dir, {"messages": messages, "tools": [{"type": "function", "function": {}}]})
    with pytest.raises(ValidationError, match="chat_template_kwargs"):
        front_prompt(template_dir, {"messages": messages, "chat_template_kwargs": {f"k{i}": i for i in range(33)}})
    broken = {**CALL, "function": {"name": "get_weather", "arguments": '{"city": '}}
    with pytest.raises(ValidationError, match="messages.2.tool_calls.0.function.arguments"):
        front_prompt(template_dir, {"messages": [*MESSAGES[:2], {**MESSAGES[2], "tool_calls": [broken]}]})


def test_served_chat_takes_tools_and_kwargs(triton):
    """Through the launcher's front with the official client: a request with tools and
    enable_thinking answers; a malformed tools list is a 400 naming it, and the server serves on."""
    client = openai.OpenAI(base_url=triton.openai_url, api_key="unused", max_retries=0)
    ask = dict(model="llm", messages=[{"role": "user", "content": "weather?"}], max_tokens=4, temperature=0)
    answer = client.chat.completions.create(**ask, tools=TOOLS, extra_body={"chat_template_kwargs":
                                                                            {"enable_thinking": False}})
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask, tools=[{"type": "function", "function": {"description": "no name"}}])
    assert refused.value.status_code == 400 and "tools.0.function.name" in refused.value.message
    assert client.chat.completions.create(**ask).usage.completion_tokens == 4


# ---------------------------------------------------------------------- tool calls

# bounded arguments: a random model under the grammar always finishes a call
FORECAST = {"type": "object", "properties": {"city": {"enum": ["Paris", "Zürich"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"]}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
         "additionalProperties": False}
CALL_TOOLS = [{"type": "function", "function": {"name": "get_forecast", "description": "The weather ahead",
                                                "parameters": FORECAST, "strict": True}},
              {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_forecast": arguments_schema(FORECAST, strict=True), "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days, and the time?"}]


def test_tool_formats_follow_the_template():
    formats = {name: format_of((ROOT / "tests" / "fixtures" / "chat_templates" / file).read_text())
               for name, file in TEMPLATES.items()}
    assert formats == {"llama3.1": LLAMA3_JSON, "qwen3": HERMES, "gemma3": HERMES, "granite3.3": HERMES,
                       "command-r7b": HERMES}
    assert format_of(ChatTemplate(ROOT / "models" / "stdlib-llama").source) == HERMES  # the presets' simple one


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON], ids=lambda f: f.name)
def test_each_format_grammar_and_reader_agree(fmt):
    """What the grammar lets a model write, the reader reads back exactly, whole or streamed in
    pieces; strict fills in additionalProperties false; one call only without parallel calls."""
    from tokenizers import Tokenizer

    grammars = Grammars(ROOT / "models" / "stdlib-llama" / "tokenizer.json", 4096, (2,))
    tokenizer = Tokenizer.from_file(str(ROOT / "models" / "stdlib-llama" / "tokenizer.json"))
    assert SCHEMAS["get_forecast"]["additionalProperties"] is False
    first = fmt.write([("get_forecast", '{"city": "Zürich", "days": 3}')])
    both = fmt.write([("get_forecast", '{"city": "Zürich", "days": 3}'), ("get_time", '{"zone": "CET"}')])
    for parallel in (True, False):
        tools = grammar(fmt, list(SCHEMAS.items()), parallel)
        for text, allowed in ((first, True), (both, parallel), (first.replace("3", "9"), False)):
            constraint = grammars.constraint(Guide("ebnf_grammar", tools), frozenset({2}))
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            assert (constraint.valid_prefix(ids) == len(ids)) == allowed, (parallel, text)
    for enforced in (True, False):
        content, calls = message_of(ToolCalls(fmt, set(SCHEMAS), enforced), both)
        assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
            == [("get_forecast", {"city": "Zürich", "days": 3}), ("get_time", {"zone": "CET"})]
        reader, streamed = ToolCalls(fmt, set(SCHEMAS), enforced), {}
        for i in range(0, len(both), 5):
            for delta in reader.feed(both[i:i + 5], finished=i + 5 >= len(both))[1]:
                streamed.setdefault(delta["index"], []).append(delta["function"]["arguments"])
        assert ["".join(parts) for parts in streamed.values()] == [c["function"]["arguments"] for c in calls]
        if enforced:  # the arguments stream out as they are written
            assert len(streamed[0]) > 1


@pytest.mark.parametrize("text", [
    "Plain text, no call",
    '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',  # names no offered tool
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": }\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> and then more',
    '<tool_call>\n{"name": "get_time", "arguments": {}}',  # never closed
])
def test_auto_reads_a_malformed_call_as_content(text):
    reader = ToolCalls(HERMES, set(SCHEMAS), enforced=False)
    pieces = [reader.feed(text[i:i + 4], finished=i + 4 >= len(text)) for i in range(0, len(text), 4)]
    assert "".join(content for content, _ in pieces) == text and not any(calls for _, calls in pieces)
    assert message_of(ToolCalls(HERMES, set(SCHEMAS), enforced=False), text) == (text, [])
    called = 'Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
    content, calls = message_of(ToolCalls(HERMES, set(SCHEMAS), enforced=False), called)
    assert content == "Let me look." and calls[0]["function"]["arguments"] == '{"zone": "UTC"}'


@pytest.fixture(scope="module")
def served(triton):
    return openai.OpenAI(base_url=triton.openai_url, api_key="unused", max_retries=0)


def assert_valid_calls(message, names=tuple(SCHEMAS)) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_forced_tool_calls_round_trip(served):
    """required and a named function: the answer is calls (finish_reason tool_calls) whose
    arguments validate; the calls and their results go back, and the model answers."""
    ask = dict(model="llm", messages=ASK, tools=CALL_TOOLS, max_tokens=200, temperature=0)
    required = served.chat.completions.create(**ask, tool_choice="required")
    assert required.choices[0].finish_reason == "tool_calls"
    assert required.choices[0].message.content is None
    assert_valid_calls(required.choices[0].message)
    named = served.chat.completions.create(**{**ask, "temperature": 1.0}, seed=3, parallel_tool_calls=False,
                                           tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = assert_valid_calls(named.choices[0].message, names=("get_time",))
    assert named.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    results = [{"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'} for call in calls]
    final = served.chat.completions.create(model="llm", max_tokens=8, temperature=0, tools=CALL_TOOLS,
                                           messages=[*ASK, named.choices[0].message.model_dump(exclude_none=True),
                                                     *results])
    answer = final.choices[0]
    assert answer.message.content or assert_valid_calls(answer.message)


def test_streamed_tool_calls_equal_the_answer(served):
    """Greedy, two choices: each choice's streamed deltas reassemble into its non-streamed calls;
    the first delta of a call carries its id, type and name, later ones only more arguments."""
    ask = dict(model="llm", messages=ASK, tools=CALL_TOOLS, max_tokens=200, temperature=0, tool_choice="required", n=2)
    whole = served.chat.completions.create(**ask).choices
    calls, finish = {0: {}, 1: {}}, {}
    for chunk in served.chat.completions.create(**ask, stream=True):
        choice = chunk.choices[0]
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls[choice.index]:
                assert delta.id.startswith("call_") and delta.type == "function" and delta.function.name
                calls[choice.index][delta.index] = {"name": delta.function.name,
                                                    "arguments": delta.function.arguments or ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[choice.index][delta.index]["arguments"] += delta.function.arguments
        assert not choice.delta.content
    for answer in whole:
        assert finish[answer.index] == answer.finish_reason == "tool_calls"
        assert list(calls[answer.index].values()) == [{"name": c.function.name, "arguments": c.function.arguments}
                                                      for c in answer.message.tool_calls]


def test_the_router_reads_the_calls_a_replica_answered(triton):
    """The router remembers a replica's answer as the tokens it generated: a tool call's as the
    model's format writes it, from a whole answer and from a stream alike."""
    import httpx

    from frontend.router.prompts import Prompts
    from frontend.router.relay import ResponseScanner

    body = {"model": "llm", "messages": ASK, "tools": CALL_TOOLS, "tool_choice": "required", "max_tokens": 200,
            "temperature": 0}
    whole, streamed = ResponseScanner(), ResponseScanner()
    url = f"{triton.openai_url}/chat/completions"
    answer = httpx.post(url, json=body, timeout=300)
    whole.read(answer.content)
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=300) as sse:
        for chunk in sse.iter_bytes():
            streamed.feed(chunk)
    message = answer.json()["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert whole.tool_calls == streamed.tool_calls == calls and whole.text == streamed.text == ""
    prompts = Prompts(triton.repo)
    expected = prompts.openai.tokenizer.encode(HERMES.write(calls), add_special_tokens=False)
    assert prompts.generated_ids("", calls) == expected


def test_parallel_tool_calls_false_makes_one_call(served):
    for seed in range(3):
        got = served.chat.completions.create(model="llm", messages=ASK, tools=CALL_TOOLS, tool_choice="required",
                                             parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        assert got.choices[0].finish_reason == "tool_calls" and len(assert_valid_calls(got.choices[0].message)) == 1


@pytest.mark.parametrize("tools, choice, extra, param, message", [
    ([CALL_TOOLS[0], {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}],
     "required", {}, "tools.1.function.parameters", "the parameters of tool 'broken' do not compile"),
    (CALL_TOOLS, {"type": "function", "function": {"name": "get_time"}}, {"response_format": {"type": "json_object"}},
     "response_format", "tool_choice and response_format both constrain the output"),
    (CALL_TOOLS, {"type": "function", "function": {"name": "absent"}}, {}, "tool_choice", "a tool named 'absent'"),
    (None, "required", {}, "tool_choice", "this tool_choice needs tools"),
    (CALL_TOOLS, "sometimes", {}, "tool_choice", "tool_choice"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", {}, "tools.0.function.name",
     "tools.0.function.name"),
])
def test_bad_tools_are_a_400_naming_them(served, tools, choice, extra, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        served.chat.completions.create(model="llm", messages=ASK, max_tokens=4, tool_choice=choice,
                                       **({"tools": tools} if tools else {}), **extra)
    assert refused.value.body["param"] == param and message in refused.value.body["message"], refused.value.body
    # a schema the grammar cannot compile is refused only where a grammar enforces it
    assert served.chat.completions.create(model="llm", messages=ASK, max_tokens=4, tools=[
        {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}]).choices


def test_auto_answers_content_or_valid_calls(served):
    for stream in (False, True):
        got = served.chat.completions.create(model="llm", messages=ASK, tools=CALL_TOOLS, max_tokens=48,
                                             temperature=1.0, seed=5, stream=stream)
        if stream:
            chunks = list(got)
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            assert content or any(c.choices[0].delta.tool_calls for c in chunks)
        else:
            message = got.choices[0].message
            assert message.content or assert_valid_calls(message)


class Forecast(pydantic.BaseModel):
    """The weather ahead"""
    city: str = pydantic.Field(pattern="^(Paris|Zürich)$")
    days: int = pydantic.Field(ge=1, le=7)


def test_langchain_binds_tools_and_structures_output(triton):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="llm", base_url=triton.openai_url, api_key="unused", temperature=0, max_tokens=200,
                      max_retries=0)
    called = chat.bind_tools([Forecast], tool_choice="Forecast").invoke("Weather in Paris?")
    assert [call["name"] for call in called.tool_calls] == ["Forecast"] and not called.invalid_tool_calls
    Forecast.model_validate(called.tool_calls[0]["args"])
    for method in ("json_schema", "function_calling"):
        assert isinstance(chat.with_structured_output(Forecast, method=method).invoke("Weather in Paris?"), Forecast)
