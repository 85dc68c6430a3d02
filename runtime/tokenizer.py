"""The engine dir's tokenizer.json (Hugging Face `tokenizers`, no transformers) and streaming decode."""
from __future__ import annotations

from pathlib import Path

import tokenizers

from kvforge.manifest import Manifest, ManifestError

# Tokens of the prompt decoded together with the first new ones, so a tokenizer that renders a
# leading space differently at the start of a text (SentencePiece's "▁") decodes them as mid-text.
CONTEXT_TOKENS = 5


class Tokenizer:
    def __init__(self, engine_dir: Path, manifest: Manifest):
        path = Path(engine_dir) / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} is missing; the engine dir needs the exported tokenizer.json")
        self._tok = tokenizers.Tokenizer.from_file(str(path))
        self.eos_token_ids = tuple(manifest.tokenizer.get("eos_token_ids") or ())
        bos = manifest.tokenizer.get("bos_token_id")
        # the BOS the post-processor puts before every text, if it does
        self._added_bos = bos if bos is not None and self._tok.encode("").ids[:1] == [bos] else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The one encoding of a prompt: the engine's and the router's (its block hashes name the
        engine's tokens). The tokenizer.json's own post-processor decides about BOS, as in the
        model's training, except that a text that already begins with BOS keeps that one: a chat
        a client rendered with a template that writes it (Llama 3, Gemma) and sent as text, where
        a second would be a token the model never saw (the front's own chats are encoded without
        special tokens, as transformers' apply_chat_template encodes them).
        encode_batch releases the GIL while it works and encode does not: a 250K-character prompt
        held every other thread of the process (the response sender, the engine's step loop) for
        170-260 ms; through encode_batch the longest pause seen was 7 ms
        (tests/test_runtime.py test_encoding_releases_the_gil)."""
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._added_bos is not None and ids[:2] == [self._added_bos] * 2:
            return ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Turns tokens arriving one by one into text deltas that never end inside a character.

    A byte-level BPE token can hold part of a UTF-8 sequence; such text decodes to U+FFFD and is
    held back until the following tokens complete it (or the sequence ends: `flush`)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self.prefix = 0  # ids[prefix:read] were already turned into text
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[self.prefix:self.read])
        text = self.tokenizer.decode(self.ids[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]
