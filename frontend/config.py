"""What the HTTP front needs to know about the Triton server behind it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_SECONDS = 1  # what a 503 (the server busy or not ready) tells clients to wait


@dataclass(frozen=True)
class FrontConfig:
    triton_http: str  # Triton's private loopback HTTP address (host:port); /v2 is proxied there
    triton_grpc: str  # Triton's gRPC address (host:port); the OpenAI API streams through it
    model_repository: Path  # the served repository: the llm model's engine dir (tokenizer, chat template)
    model: str = "llm"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None  # bearer key for /v1; the launcher requires one when binding beyond loopback
    # a thinking model's <think> block goes to reasoning_content (frontend/reasoning.py; on where the
    # chat template writes <think>); False: it stays in content
    reasoning_parser: bool = True
