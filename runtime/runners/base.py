"""The Runner interface: one step of the decoder over a batch of KV slots, and the KV blocks
of those slots, copied out and in.

A Runner owns the KV buffers for `slots` sequences. Active sequences occupy rows 0..rows-1
(the packed rows, runtime/kv/rows.py, keep them so with `move`), so every step binds a contiguous prefix of
each buffer: no gather, no copy. Implementations: runners/ort.py (ONNX Runtime, in place and
concat) and runners/trt.py (in place on a GPU); `runtime.runners.open_runner` picks one from
the manifest.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from kvforge.manifest import Manifest, capacity_bucket, kv_block_spec, kv_pairs

# A block of one cache tensor, as read_blocks returns it and write_blocks takes it:
# [blocks, kv_heads, block_tokens, D] (D = 1 for a scale tensor), C-contiguous.
Blocks = dict[str, np.ndarray]


@dataclass
class Batch:
    """One step's inputs: rows 0..rows-1, each feeding its next tokens after what it has cached."""

    kind: str  # "prefill" | "decode" | "mixed"
    input_ids: np.ndarray  # [rows, S], right-padded with 0
    write_positions: np.ndarray  # [rows]
    num_new: np.ndarray  # [rows]
    drafts: np.ndarray  # [rows]: of its num_new, the drafted tokens a row verifies (runtime/speculation.py)
    # [rows]: the length a longrope model picks each row's factors from (Sequence.rope_length,
    # ModelSpec.long_factors in kvforge/manifest.py: a prompt prefilled in chunks keeps its long factors);
    # None: the runner's default
    prompt_lengths: np.ndarray | None = None

    @classmethod
    def of(cls, kind: str, seqs, width: int, num_new=None, drafts=None) -> "Batch":
        """The next num_new[b] (default: up to `width`) pending tokens of each sequence (anything
        with tokens and num_cached), then its drafted tokens (drafts[b], a list); a row may feed none."""
        drafts = drafts or [[] for _ in seqs]
        input_ids = np.zeros((len(seqs), width), np.int64)
        if num_new is None:
            num_new = np.minimum([len(s.tokens) - s.num_cached for s in seqs], width)
        num_new = np.asarray(num_new, np.int64)
        for b, (s, draft) in enumerate(zip(seqs, drafts)):
            own = num_new[b] - len(draft)
            input_ids[b, :own] = s.tokens[s.num_cached:s.num_cached + own]
            input_ids[b, own:num_new[b]] = draft
        return cls(kind, input_ids, np.array([s.num_cached for s in seqs], np.int64), num_new,
                   np.array([len(d) for d in drafts], np.int64), np.array([s.rope_length for s in seqs], np.int64))

    @property
    def logit_positions(self) -> np.ndarray:
        """What generation samples from, [rows, 1 + most drafts]: each row's last real position
        and, before it, one per drafted token (a row with fewer repeats its last position)."""
        last = np.maximum(self.num_new - 1, 0)[:, None]
        width = int(self.drafts.max(initial=0)) + 1
        return np.minimum(last - self.drafts[:, None] + np.arange(width), last)


class Runner(ABC):
    """allocate -> step* (with move/resize/read_blocks/write_blocks between steps)."""

    threads = 0  # the CPU threads a step computes on, as its session reports them (0: none of its own, a GPU's)

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.block = kv_block_spec(manifest)
        self.cache = {t.name: t for t in manifest.cache_tensors}  # past_key_values.* name -> its sizes
        self.pairs = kv_pairs(manifest.model, manifest.kv_dtype)  # (past, present) names, graph order
        self.slots = 0
        self.capacity = 0

    def reserve(self, nbytes: int, slots: int) -> None:
        """Before allocate: the KV memory every later layout of at most `slots` slots within
        `nbytes` lives in (runners that hold their KV in fixed buffers anyway need none)."""

    def close(self) -> None:
        """Give the KV memory back (the engine has stopped): a process that starts engine after
        engine (tests, benchmarks) would otherwise hold each one's until a garbage collection
        breaks the engine's reference cycles (runtime/kv/block_pool.py HostBlockPool.close)."""

    @abstractmethod
    def allocate(self, slots: int, capacity: int) -> None:
        """(Re)create empty KV buffers for `slots` sequences of up to `capacity` tokens."""

    def allocate_cached(self, slots: int, length: int, capacity: int) -> None:
        """allocate, with rows 0..slots-1 holding `length` (zero) cached tokens: a step at a
        given context without the prefill that would get there. The in-place layouts need
        nothing more, as write_positions alone say how deep a row is."""
        self.allocate(slots, capacity)

    @abstractmethod
    def step(self, input_ids: np.ndarray, write_positions: np.ndarray, num_new: np.ndarray,
             logit_positions: np.ndarray | None = None, prompt_lengths: np.ndarray | None = None) -> np.ndarray:
        """Run rows 0..len(input_ids)-1: input_ids [rows, S] (right-padded), write_positions [rows]
        (tokens already cached per row), num_new [rows] (real tokens per row, <= S), logit_positions
        [rows, K] (indices into S whose logits are wanted; None = all S, as scoring needs;
        generation passes Batch.logit_positions), prompt_lengths [rows] (the length each row's
        longrope factors are chosen from: rope_lengths). Returns logits [rows, K, vocab] float32;
        row b's cache now holds write_positions[b] + num_new[b]."""

    def rope_lengths(self, write_positions: np.ndarray, num_new: np.ndarray,
                     prompt_lengths: np.ndarray | None) -> np.ndarray | None:
        """The graph's prompt_lengths per row for a longrope model (None for any other). By default
        each row's length after the step: transformers' choice for a call that feeds the row's whole
        prompt, or decodes (ModelSpec.long_factors; a caller decoding past the original length recomputes
        the row, as runtime.greedy does); the engine passes Sequence.rope_length, so a prompt
        prefilled in chunks takes the factors its full length picks from its first chunk on."""
        if self.manifest.model.longrope_original is None:
            return None
        if prompt_lengths is None:
            return np.asarray(write_positions, np.int64) + np.asarray(num_new, np.int64)
        lengths = np.ascontiguousarray(prompt_lengths, dtype=np.int64)
        if lengths.shape != np.shape(write_positions):
            raise ValueError("prompt_lengths needs one entry per row")
        return lengths

    @abstractmethod
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached tokens of slot src into slot dst (keeps rows packed)."""

    @abstractmethod
    def resize(self, capacity: int, rows: int, slots: int | None = None) -> None:
        """Change the capacity (and the slot count) keeping the cached tokens of rows 0..rows-1
        (up to the new capacity)."""

    def read_blocks(self, row: int, start: int, n: int) -> Blocks:
        """Copies of blocks start..start+n-1 of slot `row` (positions past the capacity read as 0)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy KV blocks out of its slots")

    def write_blocks(self, row: int, start: int, data: Blocks) -> None:
        """Write blocks start.. of slot `row` from read_blocks-shaped data (past the capacity: dropped)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy KV blocks into its slots")

    @property
    def kv_arrays(self) -> dict[str, np.ndarray]:
        """The host arrays holding the KV, by past_key_values.* name (ONNX Runtime runners only)."""
        raise NotImplementedError(f"{type(self).__name__} keeps its KV in device memory")

    @property
    @abstractmethod
    def kv_bytes_allocated(self) -> int:
        """Bytes of the KV buffers' layout right now."""

    @property
    def kv_bytes_held(self) -> int:
        """Bytes of KV memory the process holds: the reservation, else the buffers of now."""
        return self.kv_bytes_allocated

    def bucket_for(self, tokens: int) -> int:
        return capacity_bucket(tokens, self.manifest.max_seq_len)

    def check_step(self, input_ids: np.ndarray, write_positions: np.ndarray, num_new: np.ndarray,
                   logit_positions: np.ndarray | None = None) -> np.ndarray:
        """Refuse a step that does not fit; returns logit_positions as int64 [rows, K] (None: all)."""
        rows, seq = input_ids.shape
        if rows > self.slots:
            raise ValueError(f"{rows} rows exceed the {self.slots} allocated slots")
        if write_positions.shape != (rows,) or num_new.shape != (rows,):
            raise ValueError("write_positions and num_new need one entry per row")
        if self.manifest.max_chunk is not None and seq > self.manifest.max_chunk:
            raise ValueError(f"a step of {seq} tokens per row exceeds the export's max_chunk "
                             f"{self.manifest.max_chunk} (its sliding layers' rings hold one chunk beyond the window)")
        needed = int((write_positions + seq).max())
        if needed > self.capacity:
            raise ValueError(f"step needs {needed} cache positions but capacity is {self.capacity}; resize first")
        if logit_positions is None:
            return all_positions(rows, seq)
        positions = np.ascontiguousarray(logit_positions, dtype=np.int64)
        if positions.ndim != 2 or positions.shape[0] != rows or positions.shape[1] == 0:
            raise ValueError(f"logit_positions must be [rows={rows}, K >= 1], got shape {positions.shape}")
        if positions.min() < 0 or positions.max() >= seq:
            raise ValueError(f"logit_positions must index the step's {seq} positions (0..{seq - 1})")
        return positions

    def block_range(self, start: int, n: int) -> tuple[int, int]:
        """Token positions [lo, hi) of blocks start..start+n-1 that lie inside the capacity."""
        tokens = self.block.tokens
        lo = start * tokens
        if lo > self.capacity:
            raise ValueError(f"block {start} starts past the capacity {self.capacity}")
        return lo, min((start + n) * tokens, self.capacity)


def pack_step(input_ids: np.ndarray, write_positions: np.ndarray, num_new: np.ndarray,
              logit_positions: np.ndarray, prompt_lengths: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The inplace graph's inputs (kvforge.manifest.io_tensors) for a right-padded step: the real
    tokens packed row after row; the chunk rows are 0..P-1, P = 1 + the last row feeding more than
    one token (a one-token row among them still takes its output from the decode query); their
    key span L covers the multi-token rows only, the decode queries' span D the one-token rows.
    With no multi-token row, row 0 stands in as a chunk of one query over one key (ONNX Runtime's
    Attention needs a batch), its output unused; with no one-token row, D = 1. prompt_lengths
    (longrope, Runner.rope_lengths): each row's, packed as its tokens are."""
    rows, width = input_ids.shape
    num_new = np.asarray(num_new, np.int64)
    real = np.arange(width)[None, :] < num_new[:, None]
    if not real.any():
        raise ValueError("a step needs at least one new token")
    starts = np.cumsum(num_new) - num_new
    row_tokens = np.where(real, starts[:, None] + np.arange(width), 0)
    multi = np.flatnonzero(num_new > 1)
    chunk_rows = int(multi[-1]) + 1 if len(multi) else 1
    chunk_keys = int((write_positions[multi] + num_new[multi]).max()) if len(multi) else 1
    single = num_new == 1
    decode_keys = int(write_positions[single].max()) + 1 if single.any() else 1
    slots = np.where(num_new[:, None] > 1, np.arange(rows)[:, None] * width + np.arange(width),
                     chunk_rows * width + np.arange(rows)[:, None])
    feeds = {"input_ids": input_ids[real], "positions": (write_positions[:, None] + np.arange(width))[real],
             "write_positions": write_positions, "row_tokens": row_tokens,
             "attention_extent": np.array([chunk_rows, chunk_keys, decode_keys], np.int64), "token_slots": slots[real],
             "logit_index": np.take_along_axis(row_tokens, logit_positions, axis=1).ravel()}
    if prompt_lengths is not None:
        feeds["prompt_lengths"] = np.broadcast_to(prompt_lengths[:, None], real.shape)[real]
    return feeds


def last_positions(num_new: np.ndarray) -> np.ndarray:
    """Each row's last real position, [rows, 1] (0 for a row feeding nothing this step, whose
    logits go unused): what a step without drafts samples from."""
    return np.maximum(np.asarray(num_new, np.int64) - 1, 0)[:, None]


def all_positions(rows: int, seq: int) -> np.ndarray:
    """The logit_positions scoring needs: every position of every row, [rows, seq]."""
    return np.ascontiguousarray(np.broadcast_to(np.arange(seq, dtype=np.int64), (rows, seq)))


def as_blocks(tokens_major: np.ndarray, n: int, block_tokens: int) -> np.ndarray:
    """[kv_heads, <= n*block_tokens, D] (one slot's positions) -> [n, kv_heads, block_tokens, D], zero-padded."""
    heads, length, width = tokens_major.shape
    out = np.zeros((n, heads, block_tokens, width), tokens_major.dtype)
    full = length // block_tokens
    out[:full] = tokens_major[:, :full * block_tokens].reshape(heads, full, block_tokens, width).transpose(1, 0, 2, 3)
    if full < n and length > full * block_tokens:
        out[full, :, :length - full * block_tokens] = tokens_major[:, full * block_tokens:]
    return out


def as_tokens(blocks: np.ndarray, length: int) -> np.ndarray:
    """[n, kv_heads, block_tokens, D] -> the first `length` positions as [kv_heads, length, D]."""
    n, heads, block_tokens, width = blocks.shape
    return blocks.transpose(1, 0, 2, 3).reshape(heads, n * block_tokens, width)[:, :length]
