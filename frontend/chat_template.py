"""Chat messages -> one prompt string, with the checkpoint's own Jinja2 chat template.

The template comes from the engine dir's tokenizer_config.json (`chat_template`, a string or
Hugging Face's list of named templates, where "default" is taken). It runs in Jinja2's
sandbox: a template is data from a checkpoint, not code we trust. kvforge's presets and
models/stdlib-llama carry export.presets.SIMPLE_CHAT_TEMPLATE ("role: content" lines, then
"assistant:"). A checkpoint without a template can still serve completions; chat is refused.
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The messages cannot be rendered into a prompt; the message says why."""


def _token(value) -> str:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} objects
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class ChatTemplate:
    def __init__(self, engine_dir: Path):
        path = Path(engine_dir) / "tokenizer_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        self.source = source if isinstance(source, str) else None
        self.special = {"bos_token": _token(config.get("bos_token")), "eos_token": _token(config.get("eos_token"))}
        self._template = None
        if self.source is not None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = self._raise
            self._template = env.from_string(self.source)

    @staticmethod
    def _raise(message: str):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template (tokenizer_config.json has no chat_template); "
                                    "use /v1/completions, or add a chat_template to the checkpoint and re-export")
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self.special)
        except ChatTemplateError:
            raise
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from None
