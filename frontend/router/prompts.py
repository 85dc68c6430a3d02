"""Requests -> Prompts: each prompt as the replicas' engines will see it, tokens and block chain.

The prompt is read as the replicas read it: a /generate body with the llm model's own readers
(kvforge/llm_io.py), an OpenAI body with the front's models and chat template
(frontend/openai_api.py); its tokens with the engines' tokenizer; its full blocks named with the
engines' hash chain (kvforge/block_hash.py) under the repository's cache namespace and the
request's cache_salt.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from frontend.config import FrontConfig
from frontend.openai_api import APIError, ChatRequest, CompletionRequest, OpenAIServer, Sampling
from kvforge.block_hash import chain
from kvforge.errors import RequestError
from kvforge.llm_io import Inputs, cache_salt, prompt_of
from kvforge.manifest import KV_BLOCK_TOKENS, cache_namespace, kv_block_spec


@dataclass
class Prompt:
    """One prompt as the engines will see it: its tokens, salt and full blocks' chain hashes."""

    ids: list[int]
    salt: bytes | None
    chain: list[bytes]

    @property
    def tokens(self) -> int:
        return len(self.ids)

    @property
    def reusable_blocks(self) -> int:
        """Blocks an engine may take from its cache: full ones, never the last prompt token's."""
        return max(0, self.tokens - 1) // KV_BLOCK_TOKENS


class Prompts:
    """Requests -> their Prompts, with the tokenizer and chat template the replicas use."""

    def __init__(self, repo: Path):
        # only its prompt building is used (manifest, tokenizer, chat template: the front's own
        # code); it never connects to anything
        self.openai = OpenAIServer(FrontConfig(triton_http="", triton_grpc="", model_repository=repo))
        self.namespace = cache_namespace(self.openai.manifest)
        self.spec = self.openai.manifest.model
        self.block_bytes = kv_block_spec(self.openai.manifest).bytes_per_block

    def prompt(self, ids: list[int], salt: bytes | None, prompt_tokens: int | None = None) -> Prompt:
        """prompt_tokens: the length of the prompt that began ids (default all of them), which picks
        a longrope model's factors and so its chain's root (kvforge/block_hash.py)."""
        long = self.spec.long_factors(len(ids) if prompt_tokens is None else prompt_tokens)
        return Prompt(ids, salt, chain(self.namespace, salt, ids, len(ids) // KV_BLOCK_TOKENS, KV_BLOCK_TOKENS, long))

    def answered(self, prompt: Prompt, generated: list[int]) -> Prompt:
        """The tokens a replica holds the KV of once it generated `generated` after `prompt`: all
        but the last generated one (sampled, never fed back), under the prompt's own chain root."""
        return self.prompt(prompt.ids + generated[:-1], prompt.salt, prompt.tokens)

    def generated_ids(self, text: str, tool_calls: list[tuple[str, str]]) -> list[int]:
        """The tokens of a completion's text and tool calls (an OpenAI response carries text and
        calls, not ids: the calls as the model's format writes them)."""
        text += self.openai.tool_format.write(tool_calls)
        return self.openai.tokenizer.encode(text, add_special_tokens=False) if text else []

    def of_text(self, text: str | list[int], salt: bytes | None) -> Prompt:
        return self.prompt(text if isinstance(text, list) else self.openai.tokenizer.encode(text), salt)

    def of_generate(self, inputs: Inputs) -> list[Prompt]:
        """A /v2 generate body's prompt, read as the llm model reads it; one it would refuse has
        none (the request is routed by load alone and the replica answers the error)."""
        try:
            return [self.of_text(prompt_of(inputs), cache_salt(inputs))]
        except RequestError:
            return []

    def of_openai(self, path: str, body: bytes) -> tuple[list[Prompt], str | None]:
        """A /v1 body's prompts, read as the front reads them, and its `user` (the end-user id
        the affinity policy may key on); a body the front would refuse has neither (it is
        routed by load alone and the replica answers the error)."""
        try:
            if path.endswith("/chat/completions"):
                chat = ChatRequest.model_validate_json(body)
                return [self.of_text(self.openai.chat_prompt(chat), salt_of(chat))], chat.user
            completion = CompletionRequest.model_validate_json(body)
        except (ValidationError, APIError):
            return [], None
        prompt = completion.prompt
        prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
        return [self.of_text(p, salt_of(completion)) for p in prompts], completion.user


def salt_of(body: Sampling) -> bytes | None:
    """An OpenAI body's cache_salt as the front hands it to the llm model: UTF-8."""
    return body.cache_salt.encode() if body.cache_salt is not None else None
