"""Section prefix_cache: what reusing the KV of repeated prompt prefixes buys (issue 9, section 5).

- repeated prompt: TTFT of a prompt sent cold, then again (warm), per context length, in-process
  (LLMEngine) and through the real Triton server (gRPC streaming, prefix caching on as `make serve`);
- multi-turn chat (vLLM's multi-turn shape): conversations whose every turn resends the history
  (the previous answer as text) plus new user tokens; TTFT per turn with caching on vs off, and
  the cold TTFT of a prompt as long as one turn's new tokens;
- shared document (LMCache's long-document QA shape): requests with one document and different
  questions at a fixed concurrency: throughput and TTFT on vs off;
- no-hit overhead: distinct random prompts, decode tokens/s on vs off, interleaved pairs;
- copy cost: copy-in / copy-out time per block at two block sizes (the block-size choice in
  kvforge/manifest.py), against the prefill time the copy replaces.

In-process, "on" and "off" are two engines on the same engine dir, taking turns, so load from
other processes hits both alike. TTFT = time from submit to the first generated token.
"""
from __future__ import annotations

import queue
import statistics
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from bench.common import Params, describe, finish_figure, rendered, run_module, say, section_ran, skipped, table, target


@dataclass(frozen=True)
class Shape:
    contexts: tuple[int, ...]
    pairs: int  # cold/warm (or on/off) pairs per point
    conversations: int
    turns: int
    turn_user_tokens: int
    turn_answer_tokens: int
    document_tokens: int
    document_requests: int
    document_concurrency: int
    question_tokens: int
    answer_tokens: int
    nohit_prompt_tokens: int
    nohit_rows: int
    nohit_new_tokens: int
    copy_tokens: int  # the prefix the copy timings move


def shape(quick: bool) -> Shape:
    if quick:
        return Shape(contexts=(64, 160), pairs=2, conversations=2, turns=3, turn_user_tokens=32, turn_answer_tokens=8,
                     document_tokens=160, document_requests=4, document_concurrency=2, question_tokens=16,
                     answer_tokens=4, nohit_prompt_tokens=32, nohit_rows=2, nohit_new_tokens=8, copy_tokens=128)
    return Shape(contexts=(512, 1024, 2048, 3584), pairs=3, conversations=8, turns=6, turn_user_tokens=128,
                 turn_answer_tokens=64, document_tokens=2560, document_requests=16, document_concurrency=4,
                 question_tokens=32, answer_tokens=32, nohit_prompt_tokens=128, nohit_rows=4, nohit_new_tokens=64,
                 copy_tokens=2048)


class Texts:
    """Disjoint windows of held-out standard-library source, `n` tokens each (as text)."""

    def __init__(self, engine_dir):
        from tokenizers import Tokenizer

        from export.train import split_corpus

        self.tokenizer = Tokenizer.from_file(str(engine_dir / "tokenizer.json"))
        self.ids = [i for enc in self.tokenizer.encode_batch(split_corpus()[1]) for i in enc.ids]
        self.at = 0

    def take(self, n: int) -> str:
        if self.at + n > len(self.ids):
            self.at = (self.at % 997) + 1  # wrap with a shift: no window repeats one cut before
        window = self.ids[self.at:self.at + n]
        self.at += n
        return self.tokenizer.decode(window)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)


def mapped(engine):
    """The engine once its KV reservation and the host pool's first blocks are mapped (background
    threads touch their pages at startup): nothing is measured while the kernel is still faulting
    gigabytes in."""
    if getattr(engine.runner, "reservation", None) is not None:
        engine.runner.reservation.populated.wait()
    if engine.kv.pool is not None:
        engine.kv.pool.populated.wait()
    return engine


def engine_request(engine, prompt: str, max_tokens: int) -> dict:
    """One greedy request: TTFT (s), total time (s), generated text, token ids and count, cached tokens."""
    from runtime.llm_engine import SamplingParams

    outputs: queue.Queue = queue.Queue()
    began = time.perf_counter()
    engine.submit(prompt, SamplingParams(max_tokens=max_tokens), lambda out: outputs.put((time.perf_counter(), out)))
    first, text, ids = None, "", []
    while True:
        t, out = outputs.get(timeout=600)
        if out.error:
            raise RuntimeError(out.error)
        if out.token_ids and first is None:
            first = t - began
        text, ids = text + out.text, ids + list(out.token_ids)
        if out.finished:
            return {"ttft_s": first if first is not None else t - began, "total_s": t - began, "text": text,
                    "token_ids": ids, "tokens": len(ids), "cached_tokens": out.cached_tokens}


def triton_request(client, prompt: str, max_tokens: int) -> dict:
    began = time.perf_counter()
    deltas = list(client.stream(prompt, max_tokens=max_tokens))
    timed = [d for d in deltas if d.token_ids]
    return {"ttft_s": timed[0].time if timed else deltas[-1].time, "total_s": time.perf_counter() - began,
            "text": "".join(d.text for d in deltas), "tokens": sum(len(d.token_ids) for d in deltas)}


spread = partial(describe, scale=1e3, digits=2, unit="_ms")  # seconds -> median/min/max ms


# ---------------------------------------------------------------- workloads

def repeated_prompt(send, texts: Texts, s: Shape, label: str) -> list[dict]:
    points = []
    for context in s.contexts:
        cold, warm, same = [], [], True
        for _ in range(s.pairs):
            prompt = texts.take(context)
            say(f"prefix_cache: repeated prompt, {label}, {context} tokens")
            first, second = send(prompt, 1), send(prompt, 1)
            cold.append(first["ttft_s"])
            warm.append(second["ttft_s"])
            same &= first["text"] == second["text"]
        c, w = spread(cold), spread(warm)
        points.append({"context": context, "cold": c, "warm": w, "same_greedy_text": same,
                       "warm_percent_of_cold": round(100 * w["median_ms"] / c["median_ms"], 2),
                       "cached_tokens": second.get("cached_tokens")})
    return points


def multi_turn(engines: dict, texts: Texts, s: Shape) -> dict:
    """Conversations take turns (turn 1 of each, then turn 2 ...); on and off alternate per turn."""
    conversations = [{"on": "", "off": ""} for _ in range(s.conversations)]
    ttft = {"on": [[] for _ in range(s.turns)], "off": [[] for _ in range(s.turns)]}
    for turn in range(s.turns):
        say(f"prefix_cache: multi-turn, turn {turn + 1} of {s.turns}")
        for conversation in conversations:
            user = texts.take(s.turn_user_tokens)
            for mode, engine in engines.items():
                prompt = conversation[mode] + user
                result = engine_request(engine, prompt, s.turn_answer_tokens)
                ttft[mode][turn].append(result["ttft_s"])
                conversation[mode] = prompt + result["text"]  # the answer is resent as text
    new_tokens = s.turn_user_tokens + s.turn_answer_tokens
    say(f"prefix_cache: multi-turn, cold prompts of one turn's {new_tokens} new tokens")
    cold_new = [engine_request(engines["off"], texts.take(new_tokens), 1)["ttft_s"] for _ in range(s.conversations)]
    return {"turns": [{"turn": t + 1, "on": spread(ttft["on"][t]), "off": spread(ttft["off"][t])}
                      for t in range(s.turns)],
            "cold_new_tokens": spread(cold_new), "new_tokens_per_turn": new_tokens,
            "conversations": s.conversations}


def closed_loop(engine, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    from bench.serving import level

    run = level(concurrency, prompts, max_tokens, lambda p, n: engine_request(engine, p, n), total=len(prompts))
    if run["errors"]:
        raise RuntimeError(f"shared-document requests failed: {run['errors'][:3]}")
    results, wall = run["records"], run["wall_s"]
    return {"wall_s": round(wall, 3), "requests_per_s": round(len(results) / wall, 3),
            "generated_tokens_per_s": round(sum(r["tokens"] for r in results) / wall, 2),
            "ttft": spread([r["ttft_s"] for r in results]),
            "cached_tokens_mean": round(float(np.mean([r["cached_tokens"] for r in results])), 1)}


def shared_document(engines: dict, texts: Texts, s: Shape) -> dict:
    runs = {}
    for mode, engine in engines.items():  # each mode its own document: "off" must not warm "on"
        document = texts.take(s.document_tokens)
        prompts = [document + "\n# question: " + texts.take(s.question_tokens) for _ in range(s.document_requests)]
        say(f"prefix_cache: shared document, caching {mode}")
        runs[mode] = closed_loop(engine, prompts, s.document_concurrency, s.answer_tokens)
    return {**runs, "throughput_ratio": round(runs["on"]["requests_per_s"] / runs["off"]["requests_per_s"], 2),
            "requests": s.document_requests, "concurrency": s.document_concurrency,
            "document_tokens": s.document_tokens}


def no_hit_overhead(engines: dict, texts: Texts, s: Shape) -> dict:
    """Distinct prompts (nothing to hit), nohit_rows at once; decode tokens/s = tokens after the
    first of each request over the time after its first token."""
    rates = {"on": [], "off": []}
    for i in range(max(5, s.pairs)):
        for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
            prompts = [texts.take(s.nohit_prompt_tokens) for _ in range(s.nohit_rows)]
            result = [None] * len(prompts)

            def one(k, mode=mode, prompts=prompts, result=result):
                result[k] = engine_request(engines[mode], prompts[k], s.nohit_new_tokens)

            threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            tokens = sum(r["tokens"] - 1 for r in result)
            decode = max(r["total_s"] for r in result) - min(r["ttft_s"] for r in result)
            rates[mode].append(tokens / decode)
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    pair_overheads = [100 * (1 - a / b) for a, b in zip(rates["on"], rates["off"])]
    return {"decode_tokens_per_s": {"on": round(on, 2), "off": round(off, 2)},
            "overhead_percent": round(statistics.median(pair_overheads), 2),
            "overhead_percent_by_pair": [round(x, 2) for x in pair_overheads],
            "pairs": len(pair_overheads), "rows": s.nohit_rows}


def copy_cost(engine_dir, s: Shape, prefill_s: float | None) -> dict:
    """Copy-in (pool -> slot) and copy-out (slot -> pool) of a copy_tokens prefix at block sizes
    16 and 64, through the runner's read_blocks / write_blocks and the host pool."""
    from kvforge.manifest import kv_block_spec
    from runtime.kv.manager import HostBlockPool
    from runtime.runners import open_runner

    runner = open_runner(engine_dir)
    runner.allocate(1, runner.bucket_for(s.copy_tokens + 1))
    rows = []
    for block_tokens in (16, 64):
        runner.block = spec = kv_block_spec(runner.manifest, block_tokens)
        n = s.copy_tokens // block_tokens
        pool = HostBlockPool(spec, n * spec.bytes_per_block)
        outs, ins = [], []
        for _ in range(5):
            pool.clear()
            began = time.perf_counter()
            ids = pool.put(runner.read_blocks(0, 0, n), [bytes([i % 256, i // 256]) + b"x" for i in range(n)])
            outs.append(time.perf_counter() - began)
            began = time.perf_counter()
            runner.write_blocks(0, 0, pool.get(ids))
            ins.append(time.perf_counter() - began)
            pool.release(ids)
        copy_in, copy_out = statistics.median(ins), statistics.median(outs)
        rows.append({"block_tokens": block_tokens, "blocks": n, "bytes_per_block": spec.bytes_per_block,
                     "copy_in_ms_per_block": round(1e3 * copy_in / n, 4),
                     "copy_out_ms_per_block": round(1e3 * copy_out / n, 4),
                     "copy_in_ms_prefix": round(1e3 * copy_in, 3), "copy_out_ms_prefix": round(1e3 * copy_out, 3),
                     "copy_in_percent_of_prefill": round(100 * copy_in / prefill_s, 3) if prefill_s else None})
    return {"prefix_tokens": s.copy_tokens, "prefill_ms": round(1e3 * prefill_s, 2) if prefill_s else None,
            "block_sizes": rows}


def section_engine(params: Params, artifacts) -> tuple[str, object, Texts]:
    """The model these sections measure (the small quality model in a quick run), its fp32 in-place
    ONNX Runtime engine dir and its held-out texts."""
    model = params.quality_model if params.quick else params.model
    engine_dir = artifacts.engine(artifacts.export(model, "inplace", "fp32"), "fp32", params.threads)
    return model, engine_dir, Texts(engine_dir)


def run(params: Params, artifacts) -> dict:
    import os

    from clients.api import LLMClient
    from runtime.llm_engine import LLMEngine
    from launcher.harness import TritonServer, free_ports

    s = shape(params.quick)
    model, engine_dir, texts = section_engine(params, artifacts)
    load_at_start = os.getloadavg()
    engines = {"on": LLMEngine(engine_dir, threads=params.threads),
               "off": LLMEngine(engine_dir, threads=params.threads, prefix_cache=False)}
    try:
        for engine in engines.values():
            engine_request(engine, texts.take(8), 2)  # warm-up: first-step allocations
        in_process = repeated_prompt(lambda p, n: engine_request(engines["on"], p, n), texts, s, "in-process")
        turns = multi_turn(engines, texts, s)
        document = shared_document(engines, texts, s)
        nohit = no_hit_overhead(engines, texts, s)
        stats = engines["on"].stats()
    finally:
        for engine in engines.values():
            engine.close()
    two_k = next((p for p in in_process if p["context"] >= 2048), in_process[-1])
    copies = copy_cost(engine_dir, s, two_k["cold"]["median_ms"] / 1e3 * s.copy_tokens / two_k["context"])

    repo = artifacts.root / "model_repository_prefix"
    run_module("engines", "repository", str(engine_dir), "--repo", str(repo))
    http, grpc, metrics = free_ports(3)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics) as server:  # as `make serve`
        client = LLMClient(server.grpc_url)
        triton_request(client, texts.take(8), 2)
        through_triton = repeated_prompt(lambda p, n: triton_request(client, p, n), texts, s, "triton")

    return {
        "model": model, "engine": str(engine_dir), "shape": s.__dict__, "block_tokens": engines["on"].runner.block.tokens,
        "repeated_prompt": {"in_process": in_process, "triton": through_triton},
        "multi_turn": turns, "shared_document": document, "no_hit": nohit, "copy": copies,
        "engine_counters": {k: stats[k] for k in ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                                                  "copy_in_blocks", "copy_in_seconds", "copy_out_blocks",
                                                  "copy_out_seconds", "blocks_evicted", "prefix_waits")},
        "load_average": {"start": list(load_at_start), "end": list(os.getloadavg())},
        "method": "TTFT = submit to first generated token (greedy); repeated prompt: the same prompt twice, "
                  "`pairs` fresh prompts per context, medians; multi-turn: conversations take turns, each turn "
                  "resends the history with the previous answer as text; shared document: one document, "
                  "different questions, closed loop at the given concurrency; no-hit: distinct prompts, "
                  "on/off alternating, overhead = median over pairs of 1 - on/off decode tokens/s; copy: "
                  "runner read_blocks/write_blocks + host pool, median of 5",
        "units": {"median_ms": "ms", "min_ms": "ms", "max_ms": "ms", "warm_percent_of_cold": "%",
                  "requests_per_s": "requests/s", "generated_tokens_per_s": "tokens/s", "wall_s": "s",
                  "decode_tokens_per_s": "tokens/s", "overhead_percent": "%", "copy_in_ms_per_block": "ms",
                  "copy_out_ms_per_block": "ms", "copy_in_percent_of_prefill": "%", "bytes_per_block": "bytes"},
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def targets(results: dict) -> list[dict]:
    section = results.get("prefix_cache")
    names = ("Prefix cache: warm TTFT <= 5% of cold at >= 2K tokens",
             "Prefix cache: multi-turn TTFT from turn 2 <= 1.5x the cold TTFT of its new tokens",
             "Prefix cache: shared-document throughput >= 5x",
             "Prefix cache: no-hit decode overhead <= 2%",
             "Prefix cache: copy-in of a 2K-token prefix <= 2% of its prefill")
    if not section_ran(section):
        return [skipped(n, "", "prefix_cache section did not run") for n in names]
    rows = []
    long = [p for p in section["repeated_prompt"]["in_process"] if p["context"] >= 2048]
    if long:
        worst = max(long, key=lambda p: p["warm_percent_of_cold"])
        rows.append(target(names[0], "<= 5%", f"{worst['warm_percent_of_cold']:.2f}% at {worst['context']} tokens",
                           worst["warm_percent_of_cold"] <= 5, "in-process medians; the Triton figures are in the "
                           "section table"))
    else:
        rows.append(skipped(names[0], "<= 5%", "no context >= 2K tokens in this (quick) run"))
    cold = section["multi_turn"]["cold_new_tokens"]["median_ms"]
    later = [t for t in section["multi_turn"]["turns"] if t["turn"] >= 2]
    ratio = max(t["on"]["median_ms"] for t in later) / cold
    rows.append(target(names[1], "<= 1.5x", f"worst {ratio:.2f}x ({cold:.0f} ms cold)", ratio <= 1.5,
                       "median TTFT per turn over the conversations"))
    doc = section["shared_document"]
    rows.append(target(names[2], ">= 5x", f"{doc['throughput_ratio']:.2f}x", doc["throughput_ratio"] >= 5,
                       f"{doc['requests']} requests at concurrency {doc['concurrency']}, "
                       f"{doc['document_tokens']}-token document"))
    nohit = section["no_hit"]
    rows.append(target(names[3], "<= 2%", f"{nohit['overhead_percent']:.2f}% (pairs {min(nohit['overhead_percent_by_pair']):.1f}"
                       f"..{max(nohit['overhead_percent_by_pair']):.1f}%)", nohit["overhead_percent"] <= 2,
                       f"median of {nohit['pairs']} interleaved on/off pairs"))
    chosen = next(b for b in section["copy"]["block_sizes"] if b["block_tokens"] == section["block_tokens"])
    pct = chosen["copy_in_percent_of_prefill"]
    if section["copy"]["prefix_tokens"] >= 2048 and pct is not None:
        rows.append(target(names[4], "<= 2%", f"{pct:.3f}% ({chosen['copy_in_ms_prefix']:.1f} ms)", pct <= 2,
                           f"{chosen['blocks']} blocks of {chosen['block_tokens']} tokens"))
    else:
        rows.append(skipped(names[4], "<= 2%", "the quick run copies a shorter prefix"))
    return rows


def plot(plt, results: dict, out: Path) -> None:
    section, path = results.get("prefix_cache"), out / "prefix_cache.png"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(section):
        for color, mode in enumerate(("in_process", "triton")):
            points = section["repeated_prompt"][mode]
            x = [p["context"] for p in points]
            left.plot(x, [p["cold"]["median_ms"] for p in points], "s--", color=f"C{color}", label=f"cold ({mode})")
            left.plot(x, [p["warm"]["median_ms"] for p in points], "o-", color=f"C{color}", label=f"warm ({mode})")
        left.set(xlabel="prompt tokens", ylabel="TTFT (ms)", yscale="log", title="Repeated prompt: TTFT vs context")
        turns = section["multi_turn"]["turns"]
        for mode, style in (("on", "o-"), ("off", "s--")):
            right.plot([t["turn"] for t in turns], [t[mode]["median_ms"] for t in turns], style,
                       label=f"prefix caching {mode}")
        right.axhline(section["multi_turn"]["cold_new_tokens"]["median_ms"], color="gray", ls=":",
                      label="cold TTFT of one turn's new tokens")
        right.set(xlabel="turn", ylabel="TTFT (ms, median)", title="Multi-turn chat")
        for ax in (left, right):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, path, section, "prefix_cache", [left, right])


def markdown(results: dict) -> list[str]:
    section = results.get("prefix_cache")
    if not rendered(section):
        return []
    rows = [[mode, p["context"], f"{p['cold']['median_ms']:.0f} ({p['cold']['min_ms']:.0f}-{p['cold']['max_ms']:.0f})",
             f"{p['warm']['median_ms']:.1f} ({p['warm']['min_ms']:.1f}-{p['warm']['max_ms']:.1f})",
             f"{p['warm_percent_of_cold']:.2f}%", "yes" if p["same_greedy_text"] else "**no**"]
            for mode in ("in_process", "triton") for p in section["repeated_prompt"][mode]]
    turns = section["multi_turn"]
    turn_rows = [[t["turn"], f"{t['on']['median_ms']:.0f}", f"{t['off']['median_ms']:.0f}"] for t in turns["turns"]]
    doc, nohit = section["shared_document"], section["no_hit"]
    copy_rows = [[b["block_tokens"], f"{b['copy_in_ms_per_block']:.3f}", f"{b['copy_out_ms_per_block']:.3f}",
                  f"{b['copy_in_ms_prefix']:.1f}", _pct(b["copy_in_percent_of_prefill"])]
                 for b in section["copy"]["block_sizes"]]
    load = section["load_average"]
    return [f"## Prefix cache ({section['model'].split('/')[-1]}, blocks of {section['block_tokens']} tokens; "
            f"load average {load['start'][0]:.2f} -> {load['end'][0]:.2f})", "",
            "Repeated prompt, TTFT median (min-max) in ms:", "",
            *table(["mode", "prompt tokens", "cold", "warm", "warm / cold", "same greedy text"], rows), "",
            f"Multi-turn ({turns['conversations']} conversations, {turns['new_tokens_per_turn']} new tokens per turn; "
            f"cold TTFT of those new tokens alone: {turns['cold_new_tokens']['median_ms']:.0f} ms):", "",
            *table(["turn", "TTFT on (ms)", "TTFT off (ms)"], turn_rows), "",
            f"Shared document ({doc['requests']} requests, concurrency {doc['concurrency']}, {doc['document_tokens']} "
            f"tokens): on {doc['on']['requests_per_s']:.2f} req/s, TTFT p50 {doc['on']['ttft']['median_ms']:.0f} ms; "
            f"off {doc['off']['requests_per_s']:.2f} req/s, TTFT p50 {doc['off']['ttft']['median_ms']:.0f} ms "
            f"({doc['throughput_ratio']:.2f}x).", "",
            f"No-hit decode: on {nohit['decode_tokens_per_s']['on']:.1f} vs off {nohit['decode_tokens_per_s']['off']:.1f} "
            f"tokens/s, overhead {nohit['overhead_percent']:.2f}% (median of {nohit['pairs']} pairs).", "",
            f"Copy cost of a {section['copy']['prefix_tokens']}-token prefix:", "",
            *table(["block tokens", "copy-in ms/block", "copy-out ms/block", "copy-in of the prefix (ms)",
                    "copy-in / prefill"], copy_rows)]


def _pct(x) -> str:
    return "-" if x is None else f"{x:.3f}%"
