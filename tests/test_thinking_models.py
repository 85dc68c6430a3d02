"""Qwen3 and Llama 3.1 served end to end through Triton and the front, with the `openai` SDK:
Qwen3's thoughts (`<think>...</think>`) as reasoning_content, and both families' tool formats
(Hermes `<tool_call>` for Qwen3, Llama 3.1's JSON) rendered by their public templates, forced by
tool_choice and read back as tool_calls, and a round trip through the real templates.

Each family's checkpoint is tiny (2 layers, 2,048 positions: Llama 3.1's tool preamble fits)
with models/stdlib-llama's tokenizer plus the family's own added tokens, special or text as the
real tokenizers mark them, and weights that make its greedy answer a script: attention and MLP
write nothing, so the last token alone picks the next (`SCRIPT`), and the answer after a
generation prompt is a known thought and answer."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.conftest import ROOT

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
POSITIONS = 2048
HIDDEN = 64
# family -> (config class, public template, added tokens: special, then text (as the real tokenizers
# mark them: Qwen3's <think> and <tool_call> are text), the turn end)
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen-Qwen3-0.6B.jinja", ["<|im_start|>", "<|im_end|>"],
              ["<think>", "</think>", "<tool_call>", "</tool_call>"], "<|im_end|>"),
    "llama3.1": ("LlamaConfig", "meta-llama-Llama-3.1-8B-Instruct.jinja",
                 ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"], [], "<|eot_id|>"),
}
# the greedy answer after each family's generation prompt (its last text token), as text pieces
# that are one token each: Qwen3 thinks first; after enable_thinking false's empty block ("\n\n")
# it answers at once
SCRIPT = {"qwen3": {"\n": ["<think>", " because", "</think>", " the", " value", "<|im_end|>"],
                    "\n\n": [" x", "<|im_end|>"]},
          "llama3.1": {"\n\n": [" the", " value", "<|eot_id|>"]}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days"],
                   "properties": {"city": {"enum": ["Paris", "Rome"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 9}}}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def scripted_checkpoint(directory: Path, family: str) -> None:
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer

    config_class, template, special, text_tokens, turn_end = FAMILIES[family]
    tokenizer = Tokenizer.from_file(str(ROOT / "models" / "stdlib-llama" / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in text_tokens])
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((ROOT / "models" / "stdlib-llama" / "tokenizer_config.json").read_text())
    bos = special[0] if family == "llama3.1" else None
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos, "eos_token": turn_end}))
    shutil.copy(TEMPLATES / template, directory / "chat_template.jinja")

    def one(piece: str) -> int:
        ids = tokenizer.encode(piece, add_special_tokens=False).ids
        assert len(ids) == 1, (piece, ids)
        return ids[0]

    end = one(turn_end)
    model = getattr(transformers, config_class)(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=POSITIONS,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=end)
    model.architectures = [config_class.replace("Config", "ForCausalLM")]
    lm = transformers.AutoModelForCausalLM.from_config(model).eval()
    torch.manual_seed(0)
    successors = {one(a): one(b) for first, pieces in SCRIPT[family].items()
                  for a, b in zip([first, *pieces], pieces)}
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "o_proj" in name or "down_proj" in name:
                p.zero_()  # no layer writes into the residual: the embedding alone reaches the head
            elif "norm" in name:
                p.fill_(1.0)
        lm.model.embed_tokens.weight.normal_(0.0, 0.02)
        lm.lm_head.weight.zero_()
        for slot, (token, successor) in enumerate(successors.items()):
            lm.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(torch.tensor(slot), HIDDEN).float()
            lm.lm_head.weight[successor, slot] = 10.0
    lm.save_pretrained(directory)
    generation = json.loads((directory / "generation_config.json").read_text())
    (directory / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [end]}))


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """(family, checkpoint dir, an `openai` client of it served through Triton and the front)."""
    from engines.repository import write_repository
    from export.__main__ import export
    from launcher.harness import TritonServer, free_ports

    family = request.param
    root = tmp_path_factory.mktemp(f"thinking-{family}")
    scripted_checkpoint(root / "checkpoint", family)
    export(str(root / "checkpoint"), root / "export", "inplace", "fp32", POSITIONS)
    write_repository(root / "export", root / "repo", slots=2)
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(root / "repo", http_port=http, grpc_port=grpc, metrics_port=metrics,
                      openai_port=openai_port) as server:
        yield family, root / "checkpoint", openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)


def prompt_tokens(directory: Path, messages: list[dict], tools: list[dict] | None = None, **kwargs) -> int:
    """apply_chat_template's prompt length (the tools and earlier calls rendered by the real template)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=False, **kwargs))


def streamed(client: openai.OpenAI, **ask) -> tuple[str | None, str | None, list[dict], str]:
    """A streamed chat's reasoning, content and calls reassembled, and its finish reason."""
    reasoning = content = None
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        choice = chunk.choices[0]
        delta = choice.delta
        if getattr(delta, "reasoning_content", None):
            reasoning = (reasoning or "") + delta.reasoning_content
        if delta.content:
            content = (content or "") + delta.content
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"id": call.id, "name": call.function.name, "arguments": ""})
            entry["arguments"] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_a_thinking_models_thought_is_reasoning_content(served):
    """Qwen3's template (thinking on by default): the thought comes back as reasoning_content and
    the answer as content, whole and streamed; cut inside the thought, all of it is reasoning;
    with enable_thinking false (an empty block in the prompt) the answer is content."""
    family, _, client = served
    if family != "qwen3":
        pytest.skip("Llama 3.1's template writes no <think>: its answers are content (test below)")
    ask = dict(model="llm", messages=ASK, max_tokens=32, temperature=0)
    message = client.chat.completions.create(**ask).choices[0]
    assert (message.message.reasoning_content, message.message.content, message.finish_reason) == \
        (" because", " the value", "stop")
    assert streamed(client, **ask) == (" because", " the value", [], "stop")
    cut = client.chat.completions.create(**{**ask, "max_tokens": 2}).choices[0]
    assert (cut.message.reasoning_content, cut.message.content, cut.finish_reason) == (" because", None, "length")
    assert streamed(client, **{**ask, "max_tokens": 2}) == (" because", None, [], "length")
    plain = client.chat.completions.create(**ask, extra_body=NO_THINKING).choices[0].message
    assert (getattr(plain, "reasoning_content", None), plain.content) == (None, " x")


def test_a_constraint_on_a_thinking_model_is_refused_unless_thinking_is_off(served):
    """A guide would forbid the <think> the model writes first: a 400 naming the field, and
    with enable_thinking false the constraint holds over the answer."""
    family, _, client = served
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    ask = dict(model="llm", messages=ASK, max_tokens=32, temperature=0)
    structured = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    if family == "qwen3":
        for constraint, param in ((structured, "response_format"),
                                  ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice")):
            with pytest.raises(openai.BadRequestError) as refused:
                client.chat.completions.create(**ask, **constraint)
            assert refused.value.body["param"] == param and "thinks first" in refused.value.body["message"]
    answer = client.chat.completions.create(**ask, **structured, extra_body=NO_THINKING if family == "qwen3" else None)
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_forced_tool_calls_in_the_familys_format_round_trip(served):
    """tools reach the real template (the prompt is apply_chat_template's); tool_choice required
    and named force a call in the family's format, read back as tool_calls with finish_reason
    tool_calls, whole and streamed; the call and its result go back through the template and the
    model answers."""
    family, directory, client = served
    kwargs = NO_THINKING if family == "qwen3" else {}
    ask = dict(model="llm", messages=ASK, tools=[WEATHER], max_tokens=64, temperature=0, parallel_tool_calls=False,
               extra_body=kwargs or None)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        answer = client.chat.completions.create(**ask, tool_choice=choice)
        assert answer.usage.prompt_tokens == prompt_tokens(directory, ASK, [WEATHER], **kwargs.get(
            "chat_template_kwargs", {}))
        first = answer.choices[0]
        assert first.finish_reason == "tool_calls" and first.message.content is None
        [call] = first.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        reasoning, content, calls, finish = streamed(client, **ask, tool_choice=choice)
        assert (reasoning, content, finish) == (None, None, "tool_calls")
        assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]

    history = [*ASK, first.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}]
    final = client.chat.completions.create(model="llm", messages=history, tools=[WEATHER], max_tokens=16,
                                           temperature=0)
    template_messages = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                         "arguments": json.loads(call.function.arguments)}}]},
        history[-1]]
    assert final.usage.prompt_tokens == prompt_tokens(directory, template_messages, [WEATHER])
    answer = final.choices[0]
    assert (answer.finish_reason, answer.message.content, answer.message.tool_calls) == ("stop", " the value", None)
    assert getattr(answer.message, "reasoning_content", None) == (" because" if family == "qwen3" else None)


@pytest.mark.parametrize("step", [1, 2, 3, 100])
def test_thoughts_stream_as_they_split_whole(step):
    """Fed in pieces of any size (a marker split across them), the thought and content are the
    whole answer's; the newlines around the thought and after </think> go."""
    from frontend.reasoning import AFTER, INSIDE, MAY_OPEN, Thoughts, split

    cases = {(MAY_OPEN, "<think>\nI reason.\n\nMore.\n</think>\n\nParis\n"): ("I reason.\n\nMore.", "Paris\n"),
             (MAY_OPEN, " <think>cut </thi"): ("cut </thi", ""), (INSIDE, "\nabc\n</think>d"): ("abc", "d"),
             (MAY_OPEN, "Paris <think>"): (None, "Paris <think>"), (MAY_OPEN, "<thin"): (None, "<thin"),
             (AFTER, "<think>x</think>y"): (None, "<think>x</think>y")}
    for (start, text), expected in cases.items():
        assert split(start, text) == expected
        thoughts, thought, content = Thoughts(start), "", ""
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            t, c = thoughts.feed(piece, finished=i == len(pieces) - 1)
            thought, content = thought + t, content + c
        assert (thought, content) == (expected[0] or "", expected[1])


def test_reasoning_parser_off_leaves_the_thought_in_content(served, tmp_path):
    """The front's setting (launcher --reasoning-parser off): a thinking template's answers are
    content, and a constraint is the operator's to allow."""
    from engines.repository import write_repository
    from frontend.config import FrontConfig
    from frontend.openai_api import OpenAIServer
    from frontend.reasoning import AFTER, INSIDE, MAY_OPEN

    family, directory, _ = served
    if family != "qwen3":
        pytest.skip("one thinking template is enough")
    repo = tmp_path / "repo"
    write_repository(directory.parent / "export", repo)
    on = OpenAIServer(FrontConfig(triton_http="", triton_grpc="", model_repository=repo))
    off = OpenAIServer(FrontConfig(triton_http="", triton_grpc="", model_repository=repo, reasoning_parser=False))
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (on.thinking(prompt), off.thinking(prompt)) == (MAY_OPEN, None)
    assert on.thinking(prompt + "<think>\n\n</think>\n\n") == AFTER and on.thinking(prompt + "<think>\n") == INSIDE
