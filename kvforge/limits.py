"""Every serving limit, derived from the manifest in one place.

The engine enforces them, and `engines repository` writes them into config.pbtxt, so Triton's
batch sizes and the runtime's admission control always agree.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvforge.engine_config import DEFAULT_KV_CACHE_BYTES
from kvforge.manifest import Manifest, slot_bytes

MAX_SLOTS = 32
WAITING_PER_SLOT = 8
# The step model returns logits for every position: rows * max_seq_len * vocab floats.
SCORE_LOGITS_BYTES = 256 << 20
# Prompt text is refused before tokenizing when it is longer than this many characters per
# context token (no tokenizer packs more), so a huge body cannot tie up the tokenizer.
MAX_CHARS_PER_TOKEN = 32
DRAIN_SECONDS = 30.0  # on SIGTERM, how long in-flight requests may take to finish (default)


@dataclass(frozen=True)
class Limits:
    max_seq_len: int
    vocab_size: int
    slots: int  # sequences decoding at once, each owning a KV slot
    kv_cache_bytes: int  # the runner's slot buffers never hold more
    kv_bytes_per_token: int
    max_waiting: int
    score_rows: int  # sequences per step-model batch

    @property
    def max_prompt_chars(self) -> int:
        return self.max_seq_len * MAX_CHARS_PER_TOKEN

    @property
    def kv_tokens(self) -> int:
        """Tokens the slot buffers hold in all: one sequence's promise can be at most this."""
        return self.kv_cache_bytes // self.kv_bytes_per_token

    @classmethod
    def from_manifest(cls, manifest: Manifest, slots: int | None = None, max_waiting: int | None = None,
                      kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> "Limits":
        """Default slots make the worst case (every slot at max_seq_len) fit kv_cache_bytes,
        bounded by what the engine was built for (a TensorRT profile's max batch)."""
        per_slot = slot_bytes(manifest.cache_tensors, manifest.max_seq_len)  # rings count their cells only
        engine_rows = int(manifest.engine.get("max_batch_size") or MAX_SLOTS)
        if slots is None:
            slots = max(1, min(MAX_SLOTS, engine_rows, kv_cache_bytes // per_slot))
        if not 0 < slots <= engine_rows:
            raise ValueError(f"slots must be in 1..{engine_rows}, got {slots}")
        vocab = manifest.model.vocab_size
        return cls(max_seq_len=manifest.max_seq_len, vocab_size=vocab, slots=slots,
                   kv_cache_bytes=kv_cache_bytes, kv_bytes_per_token=manifest.kv_bytes_per_token,
                   max_waiting=max_waiting if max_waiting is not None else WAITING_PER_SLOT * slots,
                   score_rows=max(1, min(slots, SCORE_LOGITS_BYTES // (manifest.max_seq_len * vocab * 4))))
