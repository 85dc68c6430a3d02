"""Prefill: where a long prompt's time goes, against the matmul-only roofline, and what chunking
the prompt costs and buys (issue #13).

- profile: a prompt's prefill as LLMEngine runs it alone (chunks of the scheduler's
  SOLO_PREFILL_TOKENS, logits of the last position only) under ONNX Runtime's profiler, its kernel time split into the weight matmuls, attention and
  everything else; the lm_head matmul is reported apart.
- roofline: every weight matmul of those steps timed alone as an ONNX Runtime MatMul of the same
  shapes and thread count (best of several runs: the machine's FLOP/s at those shapes). Their sum
  is the time a prefill cannot beat while it does those matmuls; prefill share = bound / step.
- chunks: through LLMEngine (prefix caching off, a fresh random prompt every round), the prompt's
  time to first token at each chunk size when it runs alone, and the inter-token gaps of a
  sequence that decodes while the prompt is prefilled. runtime/scheduler.py records the curve.

    python -m bench.prefill EXPORT_DIR [--tokens 1024,2048] [--chunks 128,256,512,1024,2048] [--out F]

prints a summary and saves JSON (default results/prefill.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import ROOT, say, section_ran, skipped, table, target, write_json
from runtime.scheduler import SOLO_PREFILL_TOKENS

MATMUL_OPS = {"MatMul", "FusedMatMul", "Gemm", "MatMulNBits", "MatMulInteger", "DynamicQuantizeMatMul"}
ATTENTION_OPS = {"Attention", "MultiHeadAttention", "GroupQueryAttention"}
# a control-flow node's time is its subgraph's, whose nodes the profile lists themselves
CONTROL_FLOW_OPS = {"If", "Loop", "Scan"}
BOUND_REPEATS = 5  # best of: other processes only ever slow a matmul down
DECODER_PROMPT_TOKENS = 16
DECODER_MAX_TOKENS = 1024  # outlasts any prefill here; cancelled once the prompt's first token is out


def _shapes(entries: list[dict]) -> list[list[int]]:
    return [next(iter(e.values())) for e in entries]


def solo_prefill(runner, ids: np.ndarray, chunk: int = SOLO_PREFILL_TOKENS, every_position: bool = False) -> int:
    """A prompt prefilled as LLMEngine runs it alone: chunks of `chunk` tokens, each in the
    capacity bucket that fits it (grown by copying, as the KV manager does), logits of the last
    position (every_position: of every position). Returns the number of steps."""
    from runtime.runners.base import last_positions

    rows, length = ids.shape
    runner.allocate(rows, runner.bucket_for(min(chunk, length)))
    done, steps = 0, 0
    while done < length:
        n = min(chunk, length - done)
        runner.resize(runner.bucket_for(done + n), rows)
        num_new = np.full(rows, n, np.int64)
        runner.step(ids[:, done:done + n], np.full(rows, done, np.int64), num_new,
                    None if every_position else last_positions(num_new))
        done, steps = done + n, steps + 1
    return steps


def profile_step(export_dir: Path, tokens: int, threads: int, every_position: bool = False) -> dict:
    """Kernel time per category of one `tokens`-long prefill as the engine runs it alone (after
    an unprofiled warm-up), asking for the last position's logits (generation) or, in one step,
    every position's (scoring)."""
    from runtime.runners import open_runner

    runner = open_runner(export_dir, threads)
    vocab = runner.manifest.model.vocab_size
    chunk = tokens if every_position else SOLO_PREFILL_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        profile(runner, export_dir, threads, Path(tmp))
        ids = np.random.default_rng(tokens).integers(3, vocab, (1, tokens))
        for _ in range(2):  # the first run allocates and picks kernels; the second is analysed
            began = time.perf_counter()
            steps = solo_prefill(runner, ids, chunk, every_position)
            wall = time.perf_counter() - began
        runs, nodes = kernel_events(runner, steps)
    split = {"matmul": 0.0, "lm_head_matmul": 0.0, "attention": 0.0, "other": 0.0}
    weight_matmuls = []  # (input shape, weight shape) of every matmul by a 2-D weight
    for e in nodes:
        op, seconds = e["args"]["op_name"], e["dur"] / 1e6
        if op in MATMUL_OPS:
            inputs, output = _shapes(e["args"]["input_type_shape"]), _shapes(e["args"]["output_type_shape"])[0]
            split["lm_head_matmul" if output[-1] == vocab else "matmul"] += seconds
            if len(inputs) == 1:  # the weight is a constant, pre-packed by ORT and not listed
                weight_matmuls.append((tuple(inputs[0]), (inputs[0][-1], output[-1])))
        else:
            split["attention" if op in ATTENTION_OPS else "other"] += seconds
    kernels = sum(split.values())
    by_op = seconds_by_op(nodes)
    return {"tokens": tokens, "chunk_tokens": chunk, "steps": steps, "wall_s": wall,
            "model_run_s": sum(r["dur"] for r in runs) / 1e6, "kernel_s": kernels,
            "seconds": split, "percent": {k: 100 * v / kernels for k, v in split.items()},
            "top_ops_s": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:10]), "ops_s": by_op,
            "weight_matmuls": weight_matmuls}


def profile(runner, export_dir: Path, threads: int, tmp: Path) -> None:
    """Give runner a session of the same graph under ONNX Runtime's profiler (files in tmp)."""
    import onnxruntime as ort

    from runtime.runners.ort import session_options

    opts = session_options(threads)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(tmp / "profile")
    runner.session = ort.InferenceSession(str(runner_path(export_dir)), opts, providers=["CPUExecutionProvider"])


def kernel_events(runner, runs: int) -> tuple[list[dict], list[dict]]:
    """The profiled session's last `runs` model runs and the kernel events inside them, control-flow
    nodes left out (each subgraph node is an event of its own; ends the profile)."""
    events = json.loads(Path(runner.session.end_profiling()).read_text())
    last = [e for e in events if e.get("name") == "model_run"][-runs:]
    return last, [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                  and e["args"]["op_name"] not in CONTROL_FLOW_OPS
                  and any(r["ts"] <= e["ts"] <= r["ts"] + r["dur"] for r in last)]


def seconds_by_op(nodes: list[dict]) -> dict[str, float]:
    by_op: dict[str, float] = {}
    for e in nodes:
        by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e6
    return by_op


def runner_path(export_dir: Path) -> Path:
    from kvforge.manifest import Manifest

    manifest = Manifest.load(export_dir)
    return Path(export_dir) / manifest.engine.get("file", manifest.onnx_file)


def matmuls_seconds(shapes: list[tuple[tuple, tuple]], threads: int) -> float:
    """Best time of one ONNX Runtime graph running a MatMul of each (input shape, weight shape),
    every weight its own random fp32 initializer: weights that outgrow the caches are read from
    memory, as a decode step reads them (one weight timed again and again would sit in cache)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inputs, outputs, weights, feed = [], [], [], [], {}
    for i, (a_shape, b_shape) in enumerate(shapes):
        weights.append(numpy_helper.from_array(rng.standard_normal(b_shape, np.float32) * 0.02, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{i}", f"w{i}"], [f"y{i}"]))
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, list(a_shape)))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, list(a_shape[:-1]) + [b_shape[1]]))
        feed[f"x{i}"] = rng.standard_normal(a_shape, np.float32)
    graph = helper.make_graph(nodes, "bound", inputs, outputs, weights)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"])
    session.run(None, feed)
    best = float("inf")
    for _ in range(BOUND_REPEATS):
        began = time.perf_counter()
        session.run(None, feed)
        best = min(best, time.perf_counter() - began)
    return best


def torch_linear_seconds(a_shape: tuple, b_shape: tuple, threads: int) -> float:
    """Best time of torch.nn.functional.linear at one matmul shape and thread count: the kernel
    transformers' prefill runs, timed like matmuls_seconds times ONNX Runtime's."""
    import torch

    torch.set_num_threads(threads)
    x = torch.randn(a_shape)
    weight = torch.randn(b_shape[1], b_shape[0]) * 0.02  # Linear keeps [out, in]
    best = float("inf")
    with torch.no_grad():
        torch.nn.functional.linear(x, weight)
        for _ in range(BOUND_REPEATS):
            began = time.perf_counter()
            torch.nn.functional.linear(x, weight)
            best = min(best, time.perf_counter() - began)
    return best


def roofline(profile: dict, threads: int) -> dict:
    """The matmul-only bound of a profiled step and the step's share of it, and the same matmuls
    on PyTorch's kernels: whether another fp32 CPU kernel would do them faster."""
    counts: dict[tuple, int] = {}
    for shapes in profile["weight_matmuls"]:
        counts[shapes] = counts.get(shapes, 0) + 1
    shapes_out, bound, torch_bound, flops = [], 0.0, 0.0, 0
    for (a, b), n in counts.items():
        seconds, torch_seconds = matmuls_seconds([(a, b)], threads), torch_linear_seconds(a, b, threads)
        f = 2 * int(np.prod(a[:-1])) * a[-1] * b[1]
        bound, torch_bound, flops = bound + n * seconds, torch_bound + n * torch_seconds, flops + n * f
        shapes_out.append({"input": list(a), "weight": list(b), "count": n, "best_ms": round(seconds * 1e3, 3),
                           "gflop_per_s": round(f / seconds / 1e9, 2),
                           "torch_best_ms": round(torch_seconds * 1e3, 3)})
    step = profile["wall_s"]
    return {"bound_s": round(bound, 4), "torch_bound_s": round(torch_bound, 4),
            "matmul_gflop": round(flops / 1e9, 2),
            "machine_gflop_per_s_at_these_shapes": round(flops / bound / 1e9, 2),
            "prefill_gflop_per_s": round(flops / step / 1e9, 2),
            "percent_of_roofline": round(100 * bound / step, 1), "shapes": shapes_out}


# ---------------------------------------------------------------- chunk size vs TTFT and decode gaps

def engine_round(engine, vocab: int, tokens: int, with_decoder: bool, seed: int) -> dict:
    """One fresh `tokens`-long prompt through the engine (one generated token): its TTFT, and,
    with_decoder, the gaps between the tokens of a sequence decoding meanwhile."""
    from runtime.sampling import SamplingParams

    rng = np.random.default_rng(seed)
    stamps: list[float] = []
    started = threading.Event()
    ended: list[float] = []
    decoder = None
    if with_decoder:
        def on_token(out):
            stamps.append(time.perf_counter())
            if out.finished and out.finish_reason != "cancelled":
                ended.append(stamps[-1])
            if len(stamps) >= 3:
                started.set()

        decoder = engine.submit(rng.integers(3, vocab, DECODER_PROMPT_TOKENS).tolist(),
                                SamplingParams(max_tokens=DECODER_MAX_TOKENS), on_token)
        if not started.wait(120):
            raise RuntimeError("the decoding sequence produced no tokens")
    done = threading.Event()
    first: list[float] = []

    def on_first(out):
        first.append(time.perf_counter())
        done.set()

    began = time.perf_counter()
    engine.submit(rng.integers(3, vocab, tokens).tolist(), SamplingParams(max_tokens=1), on_first)
    if not done.wait(600):
        raise RuntimeError("the prompt produced no token")
    result = {"ttft_s": first[0] - began}
    if decoder is not None:
        engine.cancel(decoder)
        during = [t for t in stamps if began <= t <= first[0]]
        if ended and ended[0] < first[0]:  # it sampled EOS mid-prefill
            raise RuntimeError("the decoding sequence stopped during the prefill; rerun with another seed")
        gaps = np.diff([max(t for t in stamps if t < began)] + during + [first[0]])
        result.update(decode_gap_max_s=float(gaps.max()), decode_gap_median_s=float(np.median(gaps)),
                      decode_tokens_during_prefill=len(during))
    return result


def chunk_curve(export_dir: Path, tokens: tuple[int, ...], chunks: tuple[int, ...], rounds: int,
                threads: int) -> list[dict]:
    from runtime.llm_engine import LLMEngine

    points = {(t, c, d): [] for t in tokens for c in chunks for d in (False, True) if c <= t}
    with LLMEngine(export_dir, slots=2, prefix_cache=False, threads=threads) as engine:
        vocab = engine.manifest.model.vocab_size
        engine_round(engine, vocab, min(tokens), False, seed=0)  # warm-up
        for r in range(rounds):  # rounds outermost: load from elsewhere hits every point alike
            for key in points:
                t, c, d = key
                engine.scheduler.prefill_budget = engine.scheduler.solo_prefill_tokens = c
                points[key].append(engine_round(engine, vocab, t, d, seed=hash(key) % 1000 + 1000 * r))
                say(f"prefill chunks: {t} tokens, chunk {c}, {'with' if d else 'no'} decoder, round {r + 1}: "
                    f"TTFT {points[key][-1]['ttft_s']:.2f} s")
    out = []
    for (t, c, d), results in points.items():
        ttft = [x["ttft_s"] for x in results]
        row = {"prompt_tokens": t, "chunk_tokens": c, "decoding_meanwhile": d,
               "ttft_s_median": round(statistics.median(ttft), 3), "ttft_s_min": round(min(ttft), 3),
               "ttft_s_max": round(max(ttft), 3)}
        if d:
            row["decode_gap_max_s_median"] = round(statistics.median(x["decode_gap_max_s"] for x in results), 3)
            row["decode_gap_median_s"] = round(statistics.median(x["decode_gap_median_s"] for x in results), 3)
        out.append(row)
    return out


def measure(export_dir: Path, tokens: tuple[int, ...], chunks: tuple[int, ...], rounds: int, threads: int) -> dict:
    load_before = os.getloadavg()
    profiles = []
    for t in tokens:
        say(f"prefill profile: {t} tokens in one step")
        p = profile_step(export_dir, t, threads)
        say(f"prefill roofline: {len(set(p['weight_matmuls']))} matmul shapes of the {t}-token step")
        p["roofline"] = roofline(p, threads)
        del p["weight_matmuls"]
        profiles.append(p)
    # One graph serves generation and scoring: what scoring pays for the gather that generation
    # needs is the GatherElements time of an every-position step (two graphs would avoid it).
    say(f"prefill profile: {tokens[0]} tokens, every position's logits (scoring)")
    scoring = profile_step(export_dir, tokens[0], threads, every_position=True)
    gather = scoring["ops_s"].get("GatherElements", 0.0)
    one_graph = {"tokens": tokens[0], "wall_s": scoring["wall_s"], "gather_s": gather,
                 "gather_percent_of_step": 100 * gather / scoring["kernel_s"],
                 "lm_head_s": scoring["seconds"]["lm_head_matmul"]}
    curve = chunk_curve(export_dir, tokens, chunks, rounds, threads) if chunks else []
    return {"export": str(export_dir), "threads": threads, "profiles": profiles, "chunk_curve": curve,
            "scoring_step": one_graph,
            "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
            "method": f"profile: ONNX Runtime's profiler over a prompt's prefill as LLMEngine runs it alone "
                      f"({SOLO_PREFILL_TOKENS}-token chunks in growing capacity buckets, the last position's logits; "
                      "after an unprofiled warm-up); kernel times summed by op type; "
                      "roofline: each weight matmul of the step timed alone as an ONNX Runtime MatMul of the same "
                      f"shapes and threads (best of {BOUND_REPEATS}), summed over the step's matmuls; "
                      "torch_bound_s: the same shapes as torch.nn.functional.linear (transformers' kernel), "
                      "timed alike; "
                      "percent_of_roofline = that bound / the step's wall time; chunk curve: LLMEngine with "
                      "prefix caching off, a fresh random prompt every round, points interleaved per round",
            "units": {"wall_s": "s", "model_run_s": "s", "kernel_s": "s", "seconds": "s", "percent": "%",
                      "bound_s": "s", "gflop_per_s": "GFLOP/s", "ttft_s_median": "s",
                      "decode_gap_max_s_median": "s (longest gap between a decoding sequence's tokens "
                                                 "while the prompt was prefilled, median over rounds)"}}


def run(params, artifacts) -> dict:
    """`make bench`'s prefill section: profile and roofline of each peer model (the chunk curve
    is this module's CLI, recorded in runtime/scheduler.py)."""
    models = []
    for model in params.peer_models or (params.model,):
        result = measure(artifacts.export(model, "inplace", "fp32"), params.prefill_profile_tokens, (), 1,
                         params.threads)
        models.append({"model": artifacts.checkpoint(model).name, **result})
        say(summary(result))
    return {"models": models, "method": models[0]["method"], "units": models[0]["units"]}


# ---------------------------------------------------------------- bench.md: issue 13's targets

TTFT_LENGTHS = (1024, 2048)


def kernel_caps(model: dict, what: str, length: int, ratio: float, theirs: float, prefill: dict | None) -> dict:
    """The best ratios to the peer that ONNX Runtime's fp32 CPU kernels allow, with everything
    else in the graph taken as free. Decode, "weight matmuls alone": peers' decode_matmul_bound
    over the peer's rate. TTFT: kvforge's ratio scaled by the share of its profiled prefill (this
    section) that the weight matmuls at their best take ("weight matmuls alone") and those plus
    the profiled attention kernels ("with attention"); a share, so that the machine's drift
    between sections cancels. Empty where it was not measured."""
    if what == "decode_tokens_per_s":
        bound = model.get("decode_matmul_bound")
        return {"weight matmuls alone": bound["bound_tokens_per_s"] / theirs} if bound else {}
    profiles = {p["tokens"]: p for m in (prefill or {}).get("models", []) if m["model"] == model["model"]
                for p in m["profiles"]}
    if length not in profiles:
        return {}
    profile = profiles[length]
    bound, attention = profile["roofline"]["bound_s"], profile["seconds"]["attention"]
    return {"weight matmuls alone": ratio * bound / profile["wall_s"],
            "with attention": ratio * (bound + attention) / profile["wall_s"]}


def targets(results: dict) -> list[dict]:
    """TTFT vs transformers and GenAI at 1K and 2K, decode vs both, prefill vs its roofline at 2K.
    Beside each ratio, the kernels' caps (kernel_caps): a cap well on the wrong side of the target
    means no fp32 graph on ONNX Runtime's CPU kernels meets it on this machine."""
    peers, prefill = results.get("peers"), results.get("prefill")
    out = []
    ok = bool(peers) and peers.get("status") == "ok" and peers.get("ttft")
    for name, peer, factor, what in (("TTFT", "transformers", 0.8, "ttft_s"), ("TTFT", "onnxruntime_genai", 0.5, "ttft_s"),
                                     ("Decode", "onnxruntime_genai", 1.5, "decode_tokens_per_s"),
                                     ("Decode", "transformers", 2.5, "decode_tokens_per_s")):
        title = (f"{name} <= {factor}x {peer} at 1K and 2K prompt tokens (batch 1)" if what == "ttft_s" else
                 f"{name} (batch 1, 128-token prompt) >= {factor}x {peer}")
        required = f"{'<=' if what == 'ttft_s' else '>='} {factor:.2f}x"
        if not ok:
            out.append(skipped(title, required, "peers section did not run"))
            continue
        cells, met = [], True
        for m in peers["ttft"]:
            rows = {r["prompt_tokens"]: r["systems"] for r in m["lengths"]}
            wanted = TTFT_LENGTHS if what == "ttft_s" else (128,)
            for length in wanted:
                if length not in rows:
                    met = None
                    continue
                ours, theirs = rows[length]["kvforge"][what]["median"], rows[length][peer][what]["median"]
                ratio = ours / theirs
                met = met and (ratio <= factor if what == "ttft_s" else ratio >= factor) if met is not None else None
                unit = "s" if what == "ttft_s" else "tok/s"
                caps = kernel_caps(m, what, length, ratio, theirs, prefill)
                cells.append(f"{m['model']} @{length}: {ours:.3g} vs {theirs:.3g} {unit} ({ratio:.2f}x"
                             + "".join(f"; {name}: {cap:.2f}x" for name, cap in caps.items()) + ")")
        out.append(target(title, required, "; ".join(cells) or "-", met,
                          "medians over rounds; spread in the peers TTFT table; \"weight matmuls alone\" is the "
                          "ratio if the rest of the graph cost nothing (decode: the step's matmuls with distinct "
                          "weights; TTFT: the ratio times the matmul bound's share of the profiled prefill), "
                          "\"with attention\" adds the profiled attention kernels; +-10% or worse (the machine "
                          "drifts between the measurements); the prefill profile's \"same matmuls on PyTorch\" "
                          "says whether transformers' kernels would do the matmuls faster"
                          if met is not None else
                          "this run measured other prompt lengths (quick run)"))
    title, required = "Prefill of 2,048 tokens as a share of the matmul-only roofline", ">= 50%"
    if not (prefill and prefill.get("status") == "ok"):
        return out + [skipped(title, required, "prefill section did not run")]
    cells, met = [], True
    for m in prefill["models"]:
        at = {p["tokens"]: p for p in m["profiles"]}.get(2048)
        if at is None:
            met = None
            continue
        roof = at["roofline"]
        cells.append(f"{m['model']}: {roof['percent_of_roofline']:.0f}% ({at['wall_s']:.2f} s vs {roof['bound_s']:.2f} s)")
        met = met and roof["percent_of_roofline"] >= 50 if met is not None else None
    return out + [target(title, required, "; ".join(cells) or "-", met,
                         "bound = the step's weight matmuls timed alone at the machine's MatMul speed; "
                         "the profile table says where the rest goes" if met is not None else
                         "this run profiled shorter prompts (quick run)")]


def markdown(results: dict) -> list[str]:
    """The peers' TTFT table and the prefill profile (issue 13): one renderer for two sections."""
    peers, prefill = (results.get(k) if section_ran(results.get(k)) else None for k in ("peers", "prefill"))
    lines = []
    if peers and peers.get("ttft"):
        rows = []
        for m in peers["ttft"]:
            for r in m["lengths"]:
                cell = lambda x, d: f"{x['median']:.{d}f} ({x['min']:.{d}f}-{x['max']:.{d}f})"  # noqa: E731
                rows.append([m["model"], r["prompt_tokens"],
                             *(cell(r["systems"][s]["ttft_s"], 3) for s in ("kvforge", "transformers", "onnxruntime_genai")),
                             *(cell(r["systems"][s]["decode_tokens_per_s"], 1)
                               for s in ("kvforge", "transformers", "onnxruntime_genai"))])
        lines += ["## 4b. Peers: time to first token and decode (batch 1, median (min-max) over "
                  f"{peers['ttft_rounds']} rounds)", "", peers["ttft_method"], "",
                  *table(["model", "prompt", "kvforge TTFT s", "transformers TTFT s", "GenAI TTFT s",
                          "kvforge tok/s", "transformers tok/s", "GenAI tok/s"], rows)]
    if prefill and prefill.get("models"):
        rows = [[m["model"], p["tokens"], f"{p['wall_s']:.2f}", *(f"{p['percent'][k]:.1f}" for k in
                 ("matmul", "lm_head_matmul", "attention", "other")), f"{p['roofline']['bound_s']:.2f}",
                 f"{p['roofline']['percent_of_roofline']:.0f}%", f"{p['roofline']['torch_bound_s']:.2f}",
                 f"{p['roofline']['prefill_gflop_per_s']:.0f} / {p['roofline']['machine_gflop_per_s_at_these_shapes']:.0f}"]
                for m in prefill["models"] for p in m["profiles"]]
        lines += ["", "## 6b. Prefill profile (a prompt alone, as LLMEngine chunks it; ONNX Runtime profiler)", "",
                  prefill["method"], "",
                  *table(["model", "tokens", "step s", "matmul %", "lm_head %", "attention %", "other %",
                          "matmul bound s", "share of bound", "same matmuls on PyTorch s",
                          "GFLOP/s (prefill / MatMul alone)"], rows)]
    return lines


def summary(result: dict) -> str:
    lines = []
    for p in result["profiles"]:
        pct, roof = p["percent"], p["roofline"]
        lines.append(f"{p['tokens']:>5} tokens: {p['wall_s']:.2f} s; matmuls {pct['matmul']:.0f}%, lm_head "
                     f"{pct['lm_head_matmul']:.1f}%, attention {pct['attention']:.0f}%, other {pct['other']:.0f}%; "
                     f"matmul roofline {roof['bound_s']:.2f} s = {roof['percent_of_roofline']:.0f}% "
                     f"({roof['prefill_gflop_per_s']:.0f} of {roof['machine_gflop_per_s_at_these_shapes']:.0f} GFLOP/s)")
    sc = result["scoring_step"]
    lines.append(f"scoring step ({sc['tokens']} tokens, every position): {sc['wall_s']:.2f} s, of which the "
                 f"gather {1e3 * sc['gather_s']:.2f} ms ({sc['gather_percent_of_step']:.2f}%), lm_head {sc['lm_head_s']:.2f} s")
    for c in result["chunk_curve"]:
        gap = f", decode gap max {c['decode_gap_max_s_median']:.2f} s" if c["decoding_meanwhile"] else ""
        lines.append(f"{c['prompt_tokens']:>5} tokens, chunk {c['chunk_tokens']:>4}, "
                     f"{'decoding meanwhile' if c['decoding_meanwhile'] else 'alone':>18}: TTFT "
                     f"{c['ttft_s_median']:.2f} s ({c['ttft_s_min']:.2f}-{c['ttft_s_max']:.2f}){gap}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.splitlines()[0])
    parser.add_argument("export_dir", type=Path, help="an inplace export or ONNX Runtime engine directory")
    parser.add_argument("--tokens", default="1024,2048", help="prompt lengths to profile")
    parser.add_argument("--chunks", default="128,256,512,1024,2048", help="chunk sizes for the curve ('' = skip)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "prefill.json")
    args = parser.parse_args(argv)
    ints = lambda text: tuple(int(x) for x in text.split(",") if x)  # noqa: E731
    result = measure(args.export_dir, ints(args.tokens), ints(args.chunks), args.rounds, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(summary(result))
    print(f"saved {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
