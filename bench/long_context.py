"""Long context (issue 41): peak memory per prompt length, in process, with default settings.

For each length, shortest first, one engine (built as `make build-engines` leaves it: the KV
budget sized to one full max_seq_len sequence, mapped at startup) prefills a prompt of that many
tokens of held-out standard-library text (a long document) and generates one token; the peak
RSS of the process is reset before each (/proc/self/clear_refs) and read after (VmHWM). RSS
does not depend on the machine's speed; the time to first token is printed as seen, not as a
benchmark. With --perplexity, the step model then scores the shortest prompt (log-perplexity
of its tokens: what the model makes of that document).

    python -m bench.long_context EXPORT_DIR [--tokens 4096,16384,32768] [--perplexity]
        [--attention-scores-mib M] [--out F]

prints a line per length and saves JSON (default results/long_context.json). The skeleton of
the `long_context` section of issue 41, not yet in `make bench`'s SECTIONS.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, say, write_json
from export.train import split_corpus
from kvforge.engine_config import DEFAULT_SCORES_BYTES
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.scorer import Scorer

DEFAULT_TOKENS = (4096, 16384)


def status_bytes(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # 5: reset the peak RSS (VmHWM) to the RSS of now


def document(engine: LLMEngine, tokens: int) -> list[int]:
    """The first `tokens` tokens of the held-out standard-library files, end to end."""
    ids: list[int] = []
    for text in split_corpus()[1]:
        ids += engine.tokenizer.encode(text)
        if len(ids) >= tokens:
            return ids[:tokens]
    raise ValueError(f"the held-out corpus has only {len(ids)} tokens")


def run(engine_dir: Path, lengths: list[int], threads: int | None, perplexity: bool, scores_bytes: int) -> dict:
    began = time.perf_counter()
    with LLMEngine(engine_dir, threads=threads, attention_scores_bytes=scores_bytes) as engine:
        if getattr(engine.runner, "reservation", None) is not None:  # mapped before anything is measured
            engine.runner.reservation.populated.wait()
        limits, started = engine.limits, status_bytes("VmRSS")
        say(f"engine up: max_seq_len {limits.max_seq_len}, KV {limits.kv_bytes_per_token} B/token, budget "
            f"{limits.kv_cache_bytes >> 20} MiB (reserved {limits.kv_reserved_bytes >> 20} MiB), RSS {started >> 20} MiB")
        rows = []
        for n in lengths:
            prompt = document(engine, n)
            reset_peak()
            t0 = time.perf_counter()
            out, = engine.generate([prompt], SamplingParams(max_tokens=1))
            ttft = time.perf_counter() - t0
            stats = engine.stats()
            rows.append(dict(tokens=n, peak_rss_bytes=status_bytes("VmHWM"), rss_after_bytes=status_bytes("VmRSS"),
                             kv_held_bytes=stats["kv_bytes_held"], host_pool_bytes=stats["kv_host_pool_bytes"],
                             prompt_tokens=out.prompt_tokens, seconds=ttft))
            say(f"{n:>7} tokens: peak RSS {rows[-1]['peak_rss_bytes'] >> 20} MiB (host pool "
                f"{stats['kv_host_pool_bytes'] >> 20} MiB), first token after {ttft:.1f} s")
        prompt = document(engine, lengths[0])
    result = dict(engine_dir=str(engine_dir), max_seq_len=limits.max_seq_len,
                  kv_bytes_per_token=limits.kv_bytes_per_token, kv_cache_bytes=limits.kv_cache_bytes,
                  kv_reserved_bytes=limits.kv_reserved_bytes, attention_scores_bytes=scores_bytes,
                  rss_started_bytes=started, lengths=rows)
    if perplexity:
        logits = Scorer(engine_dir, max_rows=1, threads=threads).score([np.array(prompt, np.int64)])[0][:-1]
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        nll = -float(log_probs[np.arange(len(prompt) - 1), prompt[1:]].mean())
        result["perplexity"] = dict(tokens=len(prompt), value=math.exp(nll))
        say(f"perplexity over the first {len(prompt)} tokens: {math.exp(nll):.1f}")
    result["wall_s"] = time.perf_counter() - began
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                        help="prompt lengths, comma-separated (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--perplexity", action="store_true")
    parser.add_argument("--attention-scores-mib", type=int, default=DEFAULT_SCORES_BYTES >> 20,
                        help="the engine's scores budget (default %(default)s)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "long_context.json")
    args = parser.parse_args()
    lengths = sorted(int(t) for t in args.tokens.split(","))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, run(args.engine_dir, lengths, args.threads, args.perplexity, args.attention_scores_mib << 20))
    say(f"saved {args.out}")


if __name__ == "__main__":
    main()
