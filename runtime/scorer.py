"""Scoring: the logits of every position of whole token sequences, in one batched step.

Serves the `step` Triton model. No cache survives a call: each batch starts from fresh buffers
sized for its longest sequence, so any runner layout works and requests never see each other.
Memory is bounded at any length: a sequence is at most kvforge.limits.score_tokens long (its
logits, tokens x vocab x 4 B, within SCORE_LOGITS_BYTES), and it runs through the cache in chunks
whose attention scores stay within the scores budget (prefill_chunk), as the engine's prompts do.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from kvforge.engine_config import DEFAULT_SCORES_BYTES, read_variable
from kvforge.errors import RequestError
from kvforge.limits import prefill_chunk, score_tokens
from runtime.runners import open_runner


class Scorer:
    def __init__(self, engine_dir: Path, max_rows: int, threads: int | None = None, scores_bytes: int | None = None):
        """scores_bytes: the attention scores a chunk may make (None: $KVFORGE_ATTENTION_SCORES_BYTES
        as a served engine's process has it, else the default)."""
        self.runner = open_runner(engine_dir, threads)
        self.max_rows = max_rows
        self.max_tokens = score_tokens(self.runner.manifest)
        self.vocab_size = self.runner.manifest.model.vocab_size
        self.heads = self.runner.manifest.model.num_heads
        self.scores_bytes = scores_bytes or read_variable("attention_scores_bytes") or DEFAULT_SCORES_BYTES

    def check(self, ids: np.ndarray) -> np.ndarray:
        """One request's token ids, shape [1, n] (one sequence per request), as int64 [n], or
        RequestError saying what is wrong. Rows are refused rather than joined: a [2, 5] input
        would otherwise run as one 10-token sequence."""
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.shape[0] != 1:
            raise RequestError(f"input_ids must have shape [1, n]: one sequence per request (send each "
                               f"sequence as its own request; Triton batches them), got {list(ids.shape)}")
        ids = ids.reshape(-1)
        if not np.issubdtype(ids.dtype, np.integer):
            raise RequestError(f"input_ids must be integers, got {ids.dtype}")
        if not 0 < ids.size <= self.max_tokens:
            raise RequestError(f"input_ids must hold 1..{self.max_tokens} tokens, got {ids.size} (the context is "
                               f"{self.runner.manifest.max_seq_len} tokens; the logits of {self.max_tokens} tokens "
                               f"x {self.vocab_size} vocabulary are the most one request returns)")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise RequestError(f"input_ids must be in 0..{self.vocab_size - 1}")
        return ids.astype(np.int64)

    def score(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        """Logits [n_i, vocab] for each checked sequence, up to max_rows sequences per step."""
        results: list[np.ndarray | None] = [None] * len(batch)
        for first in range(0, len(batch), self.max_rows):
            group = range(first, min(first + self.max_rows, len(batch)))
            for i, logits in zip(group, self._score_rows([batch[i] for i in group])):
                results[i] = logits
        return results

    def _score_rows(self, sequences: list[np.ndarray]) -> list[np.ndarray]:
        """The rows run longest first, so the rows still feeding tokens are always rows 0..k-1;
        each step feeds every live row its next chunk."""
        order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i]))
        lengths = np.array([len(sequences[i]) for i in order], np.int64)
        out = [np.empty((n, self.vocab_size), np.float32) for n in lengths]
        self.runner.allocate(len(order), self.runner.bucket_for(int(lengths[0])))
        start = 0
        while start < lengths[0]:
            rows = int((lengths > start).sum())
            width = min(prefill_chunk(start, rows, self.heads, self.scores_bytes), int(lengths[0]) - start)
            num_new = np.minimum(lengths[:rows] - start, width)
            ids = np.zeros((rows, width), np.int64)
            for row in range(rows):
                ids[row, :num_new[row]] = sequences[order[row]][start:start + num_new[row]]
            logits = self.runner.step(ids, np.full(rows, start, np.int64), num_new)
            for row in range(rows):
                out[row][start:start + num_new[row]] = logits[row, :num_new[row]]
            start += width
        return [out[order.index(i)] for i in range(len(sequences))]
