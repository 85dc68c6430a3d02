"""Scoring: the logits of every position of whole token sequences, in one batched step.

Serves the `step` Triton model. No cache survives a call: each batch starts from fresh buffers
sized for its longest sequence, so any runner layout works and requests never see each other.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.runners import open_runner
from kvforge.errors import RequestError


class Scorer:
    def __init__(self, engine_dir: Path, max_rows: int, threads: int | None = None):
        self.runner = open_runner(engine_dir, threads)
        self.max_rows = max_rows
        self.max_seq_len = self.runner.manifest.max_seq_len
        self.vocab_size = self.runner.manifest.model.vocab_size

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
        if not 0 < ids.size <= self.max_seq_len:
            raise RequestError(f"input_ids must hold 1..{self.max_seq_len} tokens, got {ids.size}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise RequestError(f"input_ids must be in 0..{self.vocab_size - 1}")
        return ids.astype(np.int64)

    def score(self, batch: list[np.ndarray]) -> list[np.ndarray]:
        """Logits [n_i, vocab] for each checked sequence, up to max_rows sequences per step."""
        results = []
        for start in range(0, len(batch), self.max_rows):
            chunk = batch[start:start + self.max_rows]
            lengths = np.array([len(ids) for ids in chunk], np.int64)
            padded = np.zeros((len(chunk), int(lengths.max())), np.int64)
            for row, ids in enumerate(chunk):
                padded[row, :len(ids)] = ids
            self.runner.allocate(len(chunk), self.runner.bucket_for(padded.shape[1]))
            logits = self.runner.step(padded, np.zeros(len(chunk), np.int64), lengths)
            results += [logits[row, :n] for row, n in enumerate(lengths)]
        return results
