"""OpenAI tool calls (issue 42): the grammar that makes a model call a tool, and the calls read
back out of its answer, whole or while it streams.

A model writes its calls in its family's format, the one its chat template teaches
(format_of reads the template's text):
- HERMES (Qwen2.5/Qwen3, Hermes, and the default: kvforge's presets' simple template teaches none):
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, one block per call, "\\n" between.
- LLAMA3_JSON (Llama 3.1/3.2/3.3, whose template asks for `{"name": function name, "parameters":
  dictionary ...}` and writes `<|python_tag|>` for built-in tools): `{"name": "f", "parameters":
  {...}}`, calls joined by "; " as vLLM's llama3_json parser reads them.
Mistral's `[TOOL_CALLS]` is not read: kvforge exports no Mistral family (its marker is a special
token, which the engine's text leaves out).

tool_choice "required" or a named function makes decoding follow `grammar`: exactly that format
around each tool's parameters schema (llguidance's Lark with inline %json), so the answer is
calls and nothing else, and `ToolCalls` reads it as it grows (each call's arguments stream out as
they are written). Under "auto" nothing is enforced: content streams until a call begins, the
rest is held until the answer ends, and a call that does not parse (or names no offered tool)
leaves the whole answer as content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from runtime.grammar import JSON_OPTIONS

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolFormat:
    name: str
    call_open: str  # before each call's JSON object
    call_close: str  # after it
    separator: str  # between two calls
    arguments_key: str  # the object's key for the arguments

    def header(self, name: str) -> str:
        return f'{self.call_open}{{"name": {json.dumps(name)}, "{self.arguments_key}": '

    def write(self, calls: list[tuple[str, str]]) -> str:
        """Calls (name, arguments as JSON text) as the grammar makes a model write them."""
        return self.separator.join(f"{self.header(name)}{arguments}}}{self.call_close}" for name, arguments in calls)


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters")


def format_of(template_source: str | None) -> ToolFormat:
    """The format the chat template teaches: Hermes where it names <tool_call> (or teaches none)."""
    if template_source and "<tool_call>" not in template_source and "<|python_tag|>" in template_source:
        return LLAMA3_JSON
    return HERMES


def strict_schema(schema):
    """OpenAI's strict mode: an object has only the properties it lists (additionalProperties
    false wherever the schema leaves it out), through every nested schema."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions"):
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(sub) for sub in out[key]]
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def arguments_schema(parameters: dict | None, strict: bool) -> dict:
    schema = NO_PARAMETERS if parameters is None else parameters
    return strict_schema(schema) if strict else schema


def grammar(fmt: ToolFormat, tools: list[tuple[str, dict]], parallel: bool) -> str:
    """Lark for one call (or, parallel, one or more) of these (name, arguments schema) tools, in
    the format; the arguments in the front's one JSON layout (runtime/grammar.py's JSON_OPTIONS)."""
    rules = [f"call_{i}: {json.dumps(fmt.header(name))} %json {json.dumps({'x-guidance': JSON_OPTIONS, **schema})} "
             f"{json.dumps('}' + fmt.call_close)}" for i, (name, schema) in enumerate(tools)]
    more = f" ({json.dumps(fmt.separator)} call)*" if parallel else ""
    return "\n".join([f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules])


@dataclass
class Call:
    name: str
    arguments: str  # JSON text as written (so far, while it streams)
    closed: bool  # its arguments and its format's closing text are all there


WHITESPACE = re.compile(r"\s*")


def calls_start(text: str, fmt: ToolFormat, since: int = 0) -> int:
    """Where the first call begins in an answer (looking from `since` on), or -1."""
    if fmt.call_open:
        return text.find(fmt.call_open, since)
    first = WHITESPACE.match(text).end()
    return first if text.startswith("{", first) else -1


class ObjectEnd:
    """Where a JSON object (or array) opening at `start` ends, in a text that grows: each
    character is read once however often it is asked (a streamed call's arguments can be long)."""

    def __init__(self, start: int):
        self.pos, self.depth, self.in_string, self.escaped = start, 0, False, False
        self.end: int | None = None

    def find(self, text: str) -> int | None:
        while self.end is None and self.pos < len(text):
            c = text[self.pos]
            self.pos += 1
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (c == "\\", c != '"')
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                self.end = self.pos if self.depth == 0 else None
        return self.end


def read_calls(text: str, start: int, fmt: ToolFormat, ends: dict[int, ObjectEnd]) -> tuple[list[Call], int]:
    """The calls from `start` as far as they go (the last one maybe unfinished), and where the
    text after the last closed call begins. ends: the arguments' scanners by where they open,
    kept by a caller that reads the same growing text again."""
    header = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"%s"\s*:\s*' % fmt.arguments_key)
    close = re.compile(r"\s*\}" + re.escape(fmt.call_close))
    separator = re.compile(r"\s*" + re.escape(fmt.separator.strip()) + r"\s*")
    calls, pos, rest = [], start, start
    while text.startswith(fmt.call_open, pos):
        head = header.match(text, pos + len(fmt.call_open))
        if head is None or not text.startswith("{", head.end()):
            break
        end = ends.setdefault(head.end(), ObjectEnd(head.end())).find(text)
        closing = close.match(text, end) if end is not None else None
        calls.append(Call(head.group(1), text[head.end():end], closing is not None))
        if closing is None:
            break
        rest = closing.end()
        following = separator.match(text, rest)
        if following is None:
            break
        pos = following.end()
    return calls, rest


def parse(text: str, fmt: ToolFormat, names: set[str]) -> tuple[str, list[Call]]:
    """A finished answer: (the content before its calls, the calls); an answer whose calls do not
    all parse, name an offered tool and end it is all content."""
    start = calls_start(text, fmt)
    if start < 0:
        return text, []
    calls, rest = read_calls(text, start, fmt, {})
    valid = calls and all(c.closed and c.name in names and isinstance(loads(c.arguments), dict) for c in calls)
    return (text[:start], calls) if valid and not text[rest:].strip() else (text, [])


def loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def held_back(text: str, marker: str) -> int:
    """How many of the text's last characters may be the beginning of the marker."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:k])), 0)


class ToolCalls:
    """One choice's answer read as content and tool calls while it streams: `feed` takes each
    piece of text and returns what to send (a content delta, OpenAI's delta.tool_calls entries).
    enforced: a grammar made the answer calls only (they stream as they are written); otherwise
    content streams until a call may begin, and the rest waits for the end of the answer."""

    def __init__(self, fmt: ToolFormat, names: set[str], enforced: bool):
        self.fmt, self.names, self.enforced = fmt, names, enforced
        self.text = ""
        self.content_sent = 0
        self.arguments_sent: list[int] = []  # per call sent: how much of its arguments
        self.ends: dict[int, ObjectEnd] = {}  # enforced: the calls' arguments read so far
        self.start = -1  # auto: where the first call begins, once seen

    @property
    def called(self) -> bool:
        return bool(self.arguments_sent)

    def feed(self, text: str, finished: bool) -> tuple[str, list[dict]]:
        self.text += text
        if self.enforced:
            return "", self._deltas(read_calls(self.text, 0, self.fmt, self.ends)[0])
        if self.start < 0:  # a call's opening may straddle the new text's beginning
            self.start = calls_start(self.text, self.fmt, max(0, len(self.text) - len(text) - len(self.fmt.call_open)))
        if not finished:  # content up to a possible call (and its trailing whitespace, which may precede one)
            end = self.start if self.start >= 0 else len(self.text) - held_back(self.text, self.fmt.call_open)
            return self._content(end), []
        content, calls = parse(self.text, self.fmt, self.names)
        if not calls:
            return self._content(len(self.text), trailing=True), []
        return self._content(len(content)), self._deltas(calls)

    def _content(self, end: int, trailing: bool = False) -> str:
        """The content not sent yet up to `end`, but its trailing whitespace (unless trailing)."""
        pending = self.text[self.content_sent:end]
        delta = pending if trailing else pending.rstrip()
        self.content_sent += len(delta)
        return delta

    def _deltas(self, calls: list[Call]) -> list[dict]:
        """OpenAI's delta.tool_calls: a call's first entry carries its id, type and name, later
        ones the rest of its arguments."""
        deltas = []
        for index, call in enumerate(calls):
            if index == len(self.arguments_sent):
                deltas.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
                self.arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self.arguments_sent[index]:
                deltas.append({"index": index, "function": {"arguments": call.arguments[self.arguments_sent[index]:]}})
                self.arguments_sent[index] = len(call.arguments)
        return deltas


def message_of(reader: ToolCalls, text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's content (None when calls stand alone) and message.tool_calls."""
    content, deltas = reader.feed(text, finished=True)
    calls = [{"id": d["id"], "type": "function", "function": d["function"]} for d in deltas]
    return (content or None) if calls else content, calls
