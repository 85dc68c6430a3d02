"""Chat requests rendered by public chat templates (tests/fixtures/chat_templates: Llama 3.1,
Qwen3, Gemma 3, Granite 3.3, Command R7B) as apply_chat_template renders them: plain chats,
system prompts, multi-turn, tools with assistant tool_calls and tool messages, documents,
chat_template_kwargs (Qwen3's enable_thinking), earlier reasoning, the templates' own refusals;
the front's refusals; one served through the front with the `openai` client (free-text decoding:
tool calls are not parsed out of the answer)."""
import json
import shutil
from pathlib import Path

import openai
import pytest

from frontend.chat_template import TEMPLATE_FILE, ChatTemplate

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
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(APIError, match="tool_choice .* is not supported"):
            front_prompt(template_dir, {"messages": messages, "tools": TOOLS, "tool_choice": choice})
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
