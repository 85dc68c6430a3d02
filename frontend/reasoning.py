"""Thinking models' thoughts: Qwen3 (and DeepSeek-R1 distills, Qwen3-2507 thinking) write
`<think>...</think>` before the answer. The chat completion returns the thought as
message.reasoning_content and streams it as delta.reasoning_content (vLLM's and DeepSeek's
field), `content` holding only the answer (and any tool calls read out of it).

The parser is on for a checkpoint whose chat template writes `<think>` (it teaches the block),
unless the front is started with `--reasoning-parser off` (then the thought stays in content).
The rendered prompt says where the answer begins (`start_of`):
- inside a thought: the prompt ends in an open `<think>` (R1's and Qwen3-2507's templates write it
  in the generation prompt), so the answer is thought until `</think>`;
- after one: the prompt ends with a closed block (Qwen3's `enable_thinking: false` writes an empty
  `<think>\\n\\n</think>\\n\\n`), so the answer is content;
- otherwise the model may open one: a `<think>` at the answer's start (after whitespace) begins a
  thought, anything else makes the whole answer content.
An answer that ends inside its thought (max_tokens, a stop string) is all thought: content null,
as vLLM's parsers for these models return it. The thought loses the newlines around it and the
content the newlines after `</think>`, as Qwen3's template strips them when it writes an earlier
turn back.
"""
from __future__ import annotations

from frontend.tool_calls import held_back

OPEN, CLOSE = "<think>", "</think>"
INSIDE, AFTER, MAY_OPEN = "inside", "after", "may_open"  # where the answer begins
_CONTENT = "content"


def teaches_thinking(template_source: str | None) -> bool:
    return bool(template_source) and OPEN in template_source


def start_of(prompt: str) -> str:
    """Where the answer to this rendered prompt begins: INSIDE, AFTER or MAY_OPEN a thought."""
    if prompt.rfind(OPEN) > prompt.rfind(CLOSE):
        return INSIDE
    return AFTER if prompt.rstrip().endswith(CLOSE) else MAY_OPEN


class Thoughts:
    """One choice's answer split into thought and content while it streams: `feed` takes each
    piece of text and returns (the thought's new text, the content's new text)."""

    def __init__(self, start: str):
        self.state = {INSIDE: CLOSE, AFTER: _CONTENT, MAY_OPEN: OPEN}[start]  # what is looked for next
        self.text = ""
        self.sent = 0  # how much of the text went out (or was dropped: markers, stripped newlines)
        self.thought = False  # the answer had a thought
        self.thought_sent = False  # some of the thought went out (its leading newlines are dropped)
        self.content_began = False  # (the content's leading newlines are dropped)

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        self.text += text
        thought = ""
        if self.state == OPEN:
            head = self.text.lstrip()
            if head.startswith(OPEN):
                self.state, self.thought, self.sent = CLOSE, True, len(self.text) - len(head) + len(OPEN)
            elif finished or not OPEN.startswith(head):
                self.state = _CONTENT
            else:
                return "", ""
        if self.state == CLOSE:
            self.thought = True
            end = self.text.find(CLOSE, self.sent)
            if end < 0:
                return self._thought(len(self.text) - (0 if finished else held_back(self.text, CLOSE)), finished), ""
            thought = self._thought(end, True)
            self.state, self.sent = _CONTENT, end + len(CLOSE)
        pending = self.text[self.sent:]
        if not self.content_began and self.thought:
            pending = pending.lstrip("\n")
        self.content_began |= bool(pending)
        self.sent = len(self.text)
        return thought, pending

    def _thought(self, end: int, final: bool) -> str:
        """The thought's text up to `end` not sent yet, without its leading newlines and holding
        its trailing ones (dropped when final: they end the thought)."""
        piece = self.text[self.sent:end]
        if not self.thought_sent:
            stripped = piece.lstrip("\n")
            self.sent, piece = self.sent + len(piece) - len(stripped), stripped
        kept = piece.rstrip("\n")
        self.sent = end if final else self.sent + len(kept)
        self.thought_sent |= bool(kept)
        return kept


def split(start: str, text: str) -> tuple[str | None, str]:
    """A whole answer: (its thought, None when it had none; its content)."""
    thoughts = Thoughts(start)
    thought, content = thoughts.feed(text, finished=True)
    return (thought if thoughts.thought else None), content
