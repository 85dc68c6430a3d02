"""Section 1, cache vs no cache: per-token decode time against context, and the total time to
generate N tokens, with the KV cache and recomputing the full sequence at every step.

Without a cache every new token costs a forward pass over the whole sequence: the concat
export run with an empty past over all tokens (exactly what a cache-less generate() does).
With the cache: the in-place runner's one-token decode step at the same context, measured in
turns with the recompute so that load from other processes hits both alike.
"""
from __future__ import annotations

import time

import numpy as np

from bench.common import Params, decode_rate, decode_steps, generate, say, summary_ms

HEADLINE_CONTEXT = 2048


def recompute_seconds(runner, rows: int, context: int) -> float:
    """Time of one cache-less decode step at `context`: a forward over all `context` tokens."""
    ids = np.full((rows, context), 3, np.int64)
    runner.allocate(rows, context)  # an empty past: nothing is reused
    began = time.perf_counter()
    runner.step(ids, np.zeros(rows, np.int64), np.full(rows, context, np.int64))
    return time.perf_counter() - began


def generate_without_cache(runner, prompts: np.ndarray, new_tokens: int) -> list[float]:
    """Greedy generation recomputing everything per token; seconds per generated token."""
    rows = prompts.shape[0]
    tokens, times = prompts, []
    for _ in range(new_tokens):
        began = time.perf_counter()
        runner.allocate(rows, tokens.shape[1])
        logits = runner.step(tokens, np.zeros(rows, np.int64), np.full(rows, tokens.shape[1], np.int64))
        tokens = np.concatenate([tokens, logits[:, -1].argmax(-1)[:, None]], axis=1)
        times.append(time.perf_counter() - began)
    return times


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    concat = open_runner(artifacts.export(params.model, "concat", "fp32"), params.threads)
    inplace = open_runner(artifacts.export(params.model, "inplace", "fp32"), params.threads)
    curves = []
    for rows, contexts in params.nocache_contexts.items():
        points = []
        for context in contexts:
            say(f"cache: {context} tokens x batch {rows}, recomputing without a cache and decoding with it, "
                "taking turns")
            nocache, cached = [], []
            for _ in range(params.nocache_repeats):
                nocache.append(recompute_seconds(concat, rows, context))
                cached += decode_steps(inplace, rows, context, params.timed_steps)
            no, yes = summary_ms(nocache), summary_ms(cached)
            points.append({"context": context, "no_cache": no, "cache_inplace": yes,
                           "speedup": round(no["median_ms"] / yes["median_ms"], 2)})
        curves.append({"batch": rows, "points": points})

    say(f"cache: generating {params.new_tokens} tokens after a {params.prompt_tokens}-token prompt, "
        "with and without the cache")
    prompts = np.full((1, params.prompt_tokens), 3, np.int64)
    with_cache = generate(inplace, prompts, params.new_tokens)
    without = generate_without_cache(concat, prompts, params.new_tokens)
    total_cache = with_cache["prefill_s"] + sum(with_cache["step_s"])
    totals = {"batch": 1, "prompt_tokens": params.prompt_tokens, "new_tokens": params.new_tokens,
              "with_cache_s": round(total_cache, 4), "without_cache_s": round(sum(without), 4),
              "with_cache_decode_tokens_per_s": round(decode_rate(1, with_cache["step_s"]), 2),
              "speedup": round(sum(without) / total_cache, 2)}

    # quick runs never reach the headline context: report their longest instead, labelled
    batch1 = next(c for c in curves if c["batch"] == 1)["points"]
    head = next((p for p in batch1 if p["context"] == HEADLINE_CONTEXT), max(batch1, key=lambda p: p["context"]))
    return {
        "model": params.model, "target_context": HEADLINE_CONTEXT,
        "headline": {"batch": 1, "context": head["context"], "speedup": head["speedup"],
                     "no_cache_ms": head["no_cache"]["median_ms"], "cache_ms": head["cache_inplace"]["median_ms"]},
        "method": "no cache = the concat export with an empty past over the full sequence, once per generated "
                  "token; cache = the in-place layout's one-token decode step at the same context; the two take "
                  "turns (repeats_per_point rounds), so both see the same load; speedup = ratio of medians",
        "units": {"speedup": "x", "no_cache_ms": "ms", "cache_ms": "ms", "median_ms": "ms", "min_ms": "ms",
                  "max_ms": "ms", "with_cache_s": "s", "without_cache_s": "s",
                  "with_cache_decode_tokens_per_s": "tokens/s"},
        "curves": curves, "generation_total": totals, "repeats_per_point": params.nocache_repeats,
    }
