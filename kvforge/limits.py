"""Every serving limit, derived from the manifest in one place.

The engine enforces them, and `engines repository` writes them into config.pbtxt, so Triton's
batch sizes and the runtime's admission control always agree.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvforge.engine_config import DEFAULT_KV_CACHE_BYTES, DEFAULT_SCORES_BYTES
from kvforge.manifest import Manifest, slot_bytes

MAX_SLOTS = 32
WAITING_PER_SLOT = 8
# The step model returns logits for every position: a request holds at most this many bytes of
# them (its tokens x vocab x 4 B), and a batch of requests as well (its rows x the longest).
SCORE_LOGITS_BYTES = 512 << 20
# The KV reservation is mapped at startup (runtime/runners/ort.py SlotReservation), and with the
# prefix cache as much of the host block pool again (its margin ahead of use, HostBlockPool.map_ahead):
# together at most this share of the RAM available then, the rest left to the weights, the pool's
# other pages and each step's activations.
RAM_SHARE = 0.8
# where the memory limit of this process's cgroup is read (v2, then v1): (limit, usage)
CGROUP_MEMORY = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
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
    slot_bytes: int  # one sequence at max_seq_len (a sliding layer's ring counts its cells only)
    max_waiting: int
    score_rows: int  # sequences per step-model batch
    score_tokens: int  # tokens per step-model request (its logits within SCORE_LOGITS_BYTES)

    @property
    def max_prompt_chars(self) -> int:
        return self.max_seq_len * MAX_CHARS_PER_TOKEN

    @property
    def kv_tokens(self) -> int:
        """Tokens the slot buffers hold in all: one sequence's promise can be at most this."""
        return self.kv_cache_bytes // self.kv_bytes_per_token

    @property
    def kv_reserved_bytes(self) -> int:
        """What the runner maps at startup: the budget, or every slot at max_seq_len if less."""
        return min(self.kv_cache_bytes, self.slots * self.slot_bytes)

    @classmethod
    def from_manifest(cls, manifest: Manifest, slots: int | None = None, max_waiting: int | None = None,
                      kv_cache_bytes: int | None = None, available: tuple[int, str] | None = None,
                      host_pool_bytes: int = 0) -> "Limits":
        """kv_cache_bytes None: DEFAULT_KV_CACHE_BYTES, or one sequence at max_seq_len if that is
        more, so that an engine built for N tokens serves an N-token request. Default slots make
        the worst case (every slot at max_seq_len) fit it, bounded by what the engine was built for
        (a TensorRT profile's max batch). Refused when what would be mapped at startup exceeds
        RAM_SHARE of the RAM available (`available`: (bytes, where that figure comes from);
        default available_ram()), naming the setting to change; with a host block pool of
        host_pool_bytes (the prefix cache on), its margin mapped ahead counts too."""
        per_slot = slot_bytes(manifest.cache_tensors, manifest.max_seq_len)  # rings count their cells only
        given = kv_cache_bytes is not None
        kv_cache_bytes = kv_cache_bytes if given else max(DEFAULT_KV_CACHE_BYTES, per_slot)
        engine_rows = int(manifest.engine.get("max_batch_size") or MAX_SLOTS)
        if slots is None:
            slots = max(1, min(MAX_SLOTS, engine_rows, kv_cache_bytes // per_slot))
        if not 0 < slots <= engine_rows:
            raise ValueError(f"slots must be in 1..{engine_rows}, got {slots}")
        vocab = manifest.model.vocab_size
        tokens = score_tokens(manifest)
        limits = cls(max_seq_len=manifest.max_seq_len, vocab_size=vocab, slots=slots,
                     kv_cache_bytes=kv_cache_bytes, kv_bytes_per_token=manifest.kv_bytes_per_token,
                     slot_bytes=per_slot, max_waiting=max_waiting if max_waiting is not None else WAITING_PER_SLOT * slots,
                     score_rows=max(1, min(slots, SCORE_LOGITS_BYTES // (tokens * vocab * 4))),
                     score_tokens=tokens)
        ram, source = available or available_ram()
        margin = min(host_pool_bytes, limits.kv_reserved_bytes)
        if limits.kv_reserved_bytes + margin > RAM_SHARE * ram:
            what = (f"kv_cache_bytes {mib(kv_cache_bytes)}" if given else
                    f"one {manifest.max_seq_len}-token sequence's KV, {mib(per_slot)} "
                    f"({manifest.kv_bytes_per_token} bytes per token),")
            if margin:
                what += f" and as much of the host block pool mapped ahead ({mib(margin)}) together"
            raise ValueError(f"{what} exceed{'' if margin else 's'} {RAM_SHARE:.0%} of the {mib(ram)} of RAM "
                             f"available ({source}): set "
                             "kv_cache_bytes lower (--kv-cache-mib of `engines repository`, make KV_CACHE_MIB=...) "
                             "to serve shorter requests, or build the engine for a shorter MAX_SEQ_LEN")
        return limits


def score_tokens(manifest: Manifest) -> int:
    """The longest sequence the step model scores: its logits within SCORE_LOGITS_BYTES."""
    return max(1, min(manifest.max_seq_len, SCORE_LOGITS_BYTES // (manifest.model.vocab_size * 4)))


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def available_ram() -> tuple[int, str]:
    """RAM this process may still take, and what says so: /proc/meminfo's MemAvailable, or its
    cgroup's memory limit less its usage when that is lower (a container's own bound)."""
    ram, source = math.inf, "no MemAvailable in /proc/meminfo"
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            ram, source = int(line.split()[1]) * 1024, "MemAvailable"
    for limit_file, usage_file in CGROUP_MEMORY:
        try:
            limit, usage = Path(limit_file).read_text().strip(), int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) - usage < ram:
            ram, source = int(limit) - usage, f"the cgroup memory limit {limit_file} less its usage"
        break
    return ram, source


def prefill_chunk(cached: int, rows: int, heads: int, scores_bytes: int = DEFAULT_SCORES_BYTES) -> int:
    """The widest prompt chunk w per row such that one layer's attention scores, rows x w x
    (cached + w) keys x heads x 4 B, stay within scores_bytes (the largest temporary a prefill
    step makes at long context: a 512-token chunk over 128K keys with 32 heads would be 8 GiB);
    at least 1. `cached`: the longest chunk row's tokens already in its cache."""
    per_key = 4 * rows * heads
    # the root of w^2 + cached w = scores_bytes / per_key, then exact in integers
    w = int((math.sqrt(cached * cached + 4 * scores_bytes / per_key) - cached) / 2) + 1
    while w > 1 and w * (cached + w) * per_key > scores_bytes:
        w -= 1
    return w
