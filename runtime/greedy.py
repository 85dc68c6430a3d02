"""Greedy generation straight on a Runner, no scheduler: rows of different lengths prefilled in
one right-padded step, then one token per row per step. The reference every stage checks
against (export.verify, the engine build's parity gate, benchmarks, tests).

    run = Greedy(runner, [[5, 17, 300], [8, 9]], max_new_tokens=32)
    logits = run.prefill()  # [rows, longest prompt, vocab]
    for _ in range(31):
        last = run.step()  # [rows, vocab]; feeds each row's argmax (or step(tokens) feeds those)
"""
from __future__ import annotations

import numpy as np

from runtime.runners.base import Runner, last_positions


class Greedy:
    def __init__(self, runner: Runner, prompts: list[list[int]], max_new_tokens: int):
        self.runner = runner
        self.prompts = [list(p) for p in prompts]
        self.lengths = np.array([len(p) for p in prompts], np.int64)
        self.tokens = [list(p) for p in prompts]  # each row's tokens so far (a longrope row may feed them again)
        self.original = runner.manifest.model.longrope_original
        needed = capacity_needed(self.original, self.lengths, max_new_tokens)
        runner.allocate(len(prompts), runner.bucket_for(min(needed, runner.manifest.max_seq_len)))
        self.last: np.ndarray | None = None  # logits of each row's newest position [rows, vocab]

    def prefill(self, every_position: bool = True) -> np.ndarray:
        """Logits [rows, longest prompt, vocab]; every_position=False asks for each row's last
        position only, as generation does ([rows, 1, vocab])."""
        ids = np.zeros((len(self.prompts), int(self.lengths.max())), np.int64)
        for r, p in enumerate(self.prompts):
            ids[r, :len(p)] = p
        chunk = self.runner.manifest.max_chunk or ids.shape[1]  # a ring export's steps write at most that
        chunks = []
        for start in range(0, ids.shape[1], chunk):
            num_new = np.clip(self.lengths - start, 0, chunk)
            positions = None if every_position else last_positions(num_new)
            chunks.append(self.runner.step(ids[:, start:start + chunk], np.minimum(self.lengths, start), num_new,
                                           positions))
        if not every_position:  # each row's last chunk holds its last position
            final = (self.lengths - 1) // chunk
            logits = np.stack([chunks[c][r] for r, c in enumerate(final)])
            self.last = logits[:, 0]
            return logits
        logits = np.concatenate(chunks, axis=1)
        self.last = logits[np.arange(len(self.prompts)), self.lengths - 1]
        return logits

    @property
    def next_tokens(self) -> np.ndarray:
        return self.last.argmax(-1)

    def step(self, tokens: np.ndarray | None = None) -> np.ndarray:
        """Feed one token per row. A longrope row whose token passes the original length
        (kvforge.manifest.ModelSpec.long_factors) feeds all its tokens again from position 0, on the long
        factors, as transformers' generate() recomputes its cache there."""
        tokens = self.next_tokens if tokens is None else np.asarray(tokens, np.int64)
        for row, token in zip(self.tokens, tokens):
            row.append(int(token))
        restart = self.lengths == self.original if self.original is not None else np.zeros(len(tokens), bool)
        if not restart.any():
            self.last = self.runner.step(tokens[:, None], self.lengths, np.ones(len(tokens), np.int64))[:, 0]
        else:
            num_new = np.where(restart, self.lengths + 1, 1)
            ids = np.zeros((len(tokens), int(num_new.max())), np.int64)
            for r, row in enumerate(self.tokens):
                ids[r, :num_new[r]] = row[-num_new[r]:]
            self.last = self.runner.step(ids, np.where(restart, 0, self.lengths), num_new,
                                         last_positions(num_new))[:, 0]
        self.lengths = self.lengths + 1
        return self.last


def capacity_needed(original: int | None, lengths, max_new_tokens: int) -> int:
    """Cache positions Greedy's steps may reach: the longest prompt and its new tokens, plus for
    longrope (original: its original length) the wide step of each row that may be recomputed
    (concat's columns add up)."""
    lengths = np.asarray(lengths)
    restarts = 0 if original is None else int((lengths <= original).sum()) * (original + 1)
    return int(lengths.max()) + restarts + max_new_tokens


def greedy_tokens(runner: Runner, prompt: list[int], max_tokens: int, stop: set[int] = frozenset()) -> list[int]:
    """One sequence alone: up to max_tokens greedy tokens, ending before a stop token."""
    run = Greedy(runner, [prompt], max_tokens)
    run.prefill()  # every position: the reference the generation path (last position only) is checked against
    out: list[int] = []
    while len(out) < max_tokens and int(run.next_tokens[0]) not in stop:
        out.append(int(run.next_tokens[0]))
        if len(out) < max_tokens:
            run.step()
    return out


def followed_logprobs(runners: list[Runner], prompt: list[int], max_tokens: int) -> tuple[list[int], list[list[float]]]:
    """The first runner's max_tokens greedy tokens after `prompt`, and every runner's log p of each
    of them, every runner fed those same tokens: how far a variant of a model (quantized weights)
    moves the reference's own choices, without one early difference sending the texts apart."""
    runs = [Greedy(runner, [prompt], max_tokens) for runner in runners]
    for run in runs:
        run.prefill(every_position=False)
    tokens: list[int] = []
    logprobs: list[list[float]] = [[] for _ in runs]
    for i in range(max_tokens):
        tokens.append(int(runs[0].next_tokens[0]))
        for run, out in zip(runs, logprobs):
            shifted = run.last[0].astype(np.float64) - run.last[0].max()
            out.append(float(shifted[tokens[-1]] - np.log(np.exp(shifted).sum())))
        if i + 1 < max_tokens:
            for run in runs:
                run.step(np.array([tokens[-1]]))
    return tokens, logprobs
