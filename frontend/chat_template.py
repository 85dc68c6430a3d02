"""Chat messages -> one prompt string, with the checkpoint's own Jinja2 chat template.

The template comes from the engine dir's chat_template.jinja (where transformers >= 4.43 saves
it), else tokenizer_config.json's `chat_template` (a string, or Hugging Face's list of named
templates, where "default" is taken). It runs in Jinja2's sandbox: a template is data from a
checkpoint, not code we trust, with the helpers transformers gives templates
(utils/chat_template_utils.py: `raise_exception`, `strftime_now`, a `tojson` that neither sorts
keys nor escapes HTML or non-ASCII, the `loopcontrols` extension and the `{% generation %}` tag),
so a template renders here as apply_chat_template renders it. kvforge's presets and
models/stdlib-llama carry export.presets.SIMPLE_CHAT_TEMPLATE ("role: content" lines, then
"assistant:"). A checkpoint without a template can still serve completions; chat is refused.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt; the message says why."""


def _token(value) -> str:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} objects
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: Jinja's own sorts keys and escapes <, >, &, ' for HTML."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks in
    transformers; rendering a prompt, it is its body (a call block, so scoping matches theirs)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class ChatTemplate:
    def __init__(self, engine_dir: Path):
        path = Path(engine_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja = Path(engine_dir) / TEMPLATE_FILE
        if jinja.is_file():  # transformers reads the file first too
            source = jinja.read_text()
        self.source = source if isinstance(source, str) else None
        self.special = {"bos_token": _token(config.get("bos_token")), "eos_token": _token(config.get("eos_token"))}
        self._template = None
        if self.source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationTag, loopcontrols])
            env.filters["tojson"] = tojson
            env.globals.update(raise_exception=self._raise, strftime_now=strftime_now)
            self._template = env.from_string(self.source)

    @staticmethod
    def _raise(message: str):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def render(self, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, **kwargs) -> str:
        """kwargs reach the template as transformers passes them (e.g. Qwen3's enable_thinking),
        and override the special tokens of the same name."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template (no chat_template.jinja, and tokenizer_config.json "
                                    "has no chat_template); use /v1/completions, or add a chat_template to the "
                                    "checkpoint and re-export")
        try:
            return self._template.render(messages=messages, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **{**self.special, **kwargs})
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 - a template is a checkpoint's data: whatever it raises on
            # these messages (a TemplateError, or Python's own, e.g. Command R7B looping over tools
            # that are None when documents come alone) is their refusal, not a server fault
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
