"""tools, documents and chat_template_kwargs of an OpenAI chat request reach the chat template as
apply_chat_template passes them (free-text decoding: tool calls are not parsed out of the answer)."""
import shutil
from pathlib import Path

import openai
import pytest

from frontend.chat_template import TEMPLATE_FILE, ChatTemplate

ROOT = Path(__file__).resolve().parents[1]

# Templates in the manner of Llama 3.1's (tools as JSON in the user turn, ipython role, a call's
# arguments written with tojson) and Qwen3's (<tools> block, <tool_call>, tool responses folded
# into a user turn, enable_thinking's empty <think> block); written for this test.
LLAMA31_STYLE = """{{- bos_token }}
{%- if documents %}{{- "Documents: " + documents | tojson + "\\n" }}{% endif %}
{%- for message in messages %}
    {%- if message.role == "user" and tools is not none and loop.last %}
        {{- "<|start_header_id|>user<|end_header_id|>\\n\\nUse one of these functions:\\n" }}
        {%- for t in tools %}{{- t | tojson(indent=4) + "\\n\\n" }}{% endfor %}
        {{- message.content + "<|eot_id|>" }}
    {%- elif message.role == "assistant" and message.tool_calls is defined %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson + "}<|eot_id|>" }}
    {%- elif message.role == "tool" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" + message.content | trim + "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{% endif %}"""

QWEN3_STYLE = """{%- if tools %}
    {{- "<|im_start|>system\\n# Tools\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" %}
        {{- "<|im_start|>assistant\\n" + message.content }}
        {%- for tool_call in message.tool_calls | default([]) %}
            {%- set tool_call = tool_call.function %}
            {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
            {%- if tool_call.arguments is string %}{{- tool_call.arguments }}{% else %}{{- tool_call.arguments | tojson }}{% endif %}
            {{- "}\\n</tool_call>" }}
        {%- endfor %}
        {{- "<|im_end|>\\n" }}
    {%- elif message.role == "tool" %}
        {{- "<|im_start|>user\\n<tool_response>\\n" + message.content + "\\n</tool_response><|im_end|>\\n" }}
    {%- else %}
        {{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|im_start|>assistant\\n" }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- "<think>\\n\\n</think>\\n\\n" }}{% endif %}
{%- endif %}"""

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


@pytest.fixture(scope="module", params=["llama3.1", "qwen3"])
def template_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "stdlib-llama" / name, directory / name)
    (directory / TEMPLATE_FILE).write_text(LLAMA31_STYLE if request.param == "llama3.1" else QWEN3_STYLE)
    return directory


def front_prompt(directory: Path, body: dict) -> str:
    """The prompt the front renders for a chat body (the parser and render path it serves with)."""
    from frontend.openai_api import ChatRequest, render_chat

    return render_chat(ChatTemplate(directory), ChatRequest.model_validate({"model": "llm", **body}))


@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}])
def test_tools_documents_and_kwargs_render_as_apply_chat_template(template_dir, kwargs):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(template_dir)
    documents = [{"title": "forecast", "text": "sun > rain"}]
    body = {"messages": MESSAGES, "tools": TOOLS, "documents": documents, "chat_template_kwargs": kwargs}
    text = front_prompt(template_dir, body)
    assert text == hf.apply_chat_template(MESSAGES, tools=TOOLS, documents=documents, add_generation_prompt=True,
                                          tokenize=False, **kwargs)
    assert "get_weather" in text and "Zürich" in text and "Paris" in text and "clear" in text
    if template_dir.name.startswith("qwen3"):
        assert text.endswith("<think>\n\n</think>\n\n") == (kwargs.get("enable_thinking") is False)
        # tool_choice "none": the template gets no tools
        unoffered = front_prompt(template_dir, {**body, "tool_choice": "none"})
        assert unoffered == hf.apply_chat_template(MESSAGES, documents=documents, add_generation_prompt=True,
                                                   tokenize=False, **kwargs)
        assert "<tools>" in text and "<tools>" not in unoffered


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
