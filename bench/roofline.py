"""Section 6, roofline: the machine's memory bandwidth and batch-1 decode speed as a fraction
of the bound it sets. A batch-1 decode step must read every weight once plus the
K/V of every cached token, so step time >= (weight bytes + context x KV bytes/token) / bandwidth.

Bandwidth and decode steps are measured in turns, so both see the same load from other
processes; the headline compares the best copy with the fastest step (what the hardware and the
engine can do), and the median step is reported beside it.
"""
from __future__ import annotations

import statistics
import threading
import time

import numpy as np

from bench.common import Params, decode_steps, rendered, say, section_ran, skipped, table, target
from kvforge.manifest import ModelSpec, kv_bytes

STREAM_BYTES = 256 << 20  # far beyond any cache level, so it measures DRAM
STREAMS_PER_ROUND = 8  # best of: other processes only ever slow a stream down


def concurrent_seconds(fn, arg_sets: list[tuple]) -> float:
    """Wall time of fn(*args) for every arg set at once, one thread each (numpy releases the GIL)."""
    workers = [threading.Thread(target=fn, args=args) for args in arg_sets]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.perf_counter() - began


def stream_tests(threads: int) -> dict[str, tuple]:
    """name -> (numpy function, per-thread arguments, bytes moved by one run). A decode step only
    reads its weights, so `read` (a dot product: two streams in, nothing out) sets the bound;
    `copy` (reads and writes) is the classic figure, reported beside it."""
    per = STREAM_BYTES // threads
    reads = [(np.ones(per // 8, np.float32), np.ones(per // 8, np.float32)) for _ in range(threads)]  # per bytes
    copies = [(np.empty(per // 8), np.ones(per // 8)) for _ in range(threads)]
    return {"read": (np.dot, reads, STREAM_BYTES), "copy": (np.copyto, copies, 2 * STREAM_BYTES)}


def matmul_test(threads: int) -> tuple:
    """ONNX Runtime's own MatMul of one row by a STREAM_BYTES fp32 weight: a decode step's
    access pattern. The bound takes whichever of this and numpy's dot reads faster, so neither
    probe's weakness flatters the engine. Random weights: pages of one repeated value can be
    merged by the host (measured: a constant-filled weight "read" at 2.5x DRAM speed)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    side = int((STREAM_BYTES // 4) ** 0.5)
    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((side, side), np.float32), "weight")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "weight"], ["y"])], "read",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, side])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, side])], [weight])
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    session = ort.InferenceSession(helper.make_model(graph).SerializeToString(), opts,
                                   providers=["CPUExecutionProvider"])
    feed = {"x": np.ones((1, side), np.float32)}
    return (lambda: session.run(None, feed), [()], side * side * 4)


def decode_weight_bytes(spec: ModelSpec, bytes_per_weight: float = 4) -> int:
    """Weights one decode step reads: every projection, norm and the lm_head; of the embedding
    table only one row per token (unless it is the lm_head too)."""
    h, hd = spec.hidden_size, spec.head_dim
    attention = h * spec.num_heads * hd * 2 + h * spec.num_kv_heads * hd * 2
    bias = (spec.num_heads + 2 * spec.num_kv_heads) * hd if spec.attention_bias else 0
    layer = attention + bias + 3 * h * spec.intermediate_size + 2 * h
    head = h * spec.vocab_size
    embedding_row = 0 if spec.tie_word_embeddings else h
    return int((spec.num_layers * layer + h + head + embedding_row) * bytes_per_weight)


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    runner = open_runner(artifacts.export(params.model, "inplace", "fp32"), params.threads)
    spec = runner.manifest.model
    tests = {(kind, t): test for t in sorted({1, params.threads}) for kind, test in stream_tests(t).items()}
    tests["matmul", params.threads] = matmul_test(params.threads)
    seconds: dict[tuple, list[float]] = {key: [] for key in tests}
    steps: dict[int, list[float]] = {c: [] for c in params.contexts}
    decode_steps(runner, 1, params.contexts[0], params.timed_steps)  # warm-up
    say(f"roofline: memory bandwidth and batch-1 decode steps, taking turns ({params.layout_rounds} rounds)")
    for _ in range(params.layout_rounds):
        for key, (fn, args, _) in tests.items():
            seconds[key] += [concurrent_seconds(fn, args) for _ in range(STREAMS_PER_ROUND)]
        for context in params.contexts:
            steps[context] += decode_steps(runner, 1, context, params.timed_steps)
    bandwidth = {f"{kind}_{t}_threads": tests[kind, t][2] / min(s) for (kind, t), s in seconds.items()}
    bound_by = max((f"{kind}_{params.threads}_threads" for kind in ("read", "matmul")), key=bandwidth.get)
    bw = bandwidth[bound_by]
    weights = decode_weight_bytes(spec)
    points = []
    for context, times in steps.items():
        needed = weights + kv_bytes(spec, "fp32", context)
        bound = needed / bw
        fastest, median = min(times), statistics.median(times)
        points.append({"context": context, "bytes_per_step": needed, "bound_ms": round(bound * 1e3, 4),
                       "fastest_ms": round(fastest * 1e3, 4), "median_ms": round(median * 1e3, 4),
                       "bound_tokens_per_s": round(1 / bound, 2), "fastest_tokens_per_s": round(1 / fastest, 2),
                       "percent_of_roofline": round(100 * bound / fastest, 2),
                       "percent_of_roofline_median_step": round(100 * bound / median, 2)})
    head = points[0]
    return {
        "model": params.model, "threads": params.threads, "layout": "inplace", "batch": 1,
        "bandwidth_bytes_per_s": {k: round(v) for k, v in bandwidth.items()}, "bound_by": bound_by,
        "weight_bytes_per_step": weights, "kv_bytes_per_token": kv_bytes(spec, "fp32", 1),
        "headline": {"context": head["context"], "percent_of_roofline": head["percent_of_roofline"],
                     "percent_of_roofline_median_step": head["percent_of_roofline_median_step"]},
        "method": "bound = (fp32 weight bytes read per step + context x KV bytes/token) / the best read "
                  "bandwidth at the run's thread count, of np.dot over float32 arrays and ONNX Runtime's MatMul "
                  "of one row by a 256 MiB weight; copy bandwidth (np.copyto, counting its read and its write) "
                  "is reported beside them; bandwidth and batch-1 in-place decode steps "
                  "are measured in turns; percent_of_roofline uses the fastest step, "
                  "percent_of_roofline_median_step the median",
        "units": {"bandwidth_bytes_per_s": "bytes/s", "bytes_per_step": "bytes", "bound_ms": "ms",
                  "fastest_ms": "ms", "median_ms": "ms", "bound_tokens_per_s": "tokens/s",
                  "fastest_tokens_per_s": "tokens/s", "percent_of_roofline": "%",
                  "percent_of_roofline_median_step": "%", "weight_bytes_per_step": "bytes",
                  "kv_bytes_per_token": "bytes"},
        "points": points,
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def roofline_target(roofline: dict) -> dict:
    name, required = "Batch-1 decode as a share of the memory-bandwidth roofline", ">= 80%"
    if not section_ran(roofline):
        return skipped(name, required, "roofline section did not run")
    head = roofline["headline"]
    met = head["percent_of_roofline"] >= 80
    return target(name, required, f"{head['percent_of_roofline']:.1f}% by the fastest step, "
                  f"{head['percent_of_roofline_median_step']:.1f}% by the median (in-place, context {head['context']})",
                  met, f"{head['percent_of_roofline'] - 80:+.1f} points" + ("" if met else
                  "; the remainder is compute and per-step overhead that a weight-streaming bound ignores"))


def section_markdown(roof: dict) -> list[str]:
    probes = {"read": "np.dot read", "copy": "np.copyto", "matmul": "ONNX Runtime MatMul read"}
    bw = ", ".join(f"{probes[k.split('_')[0]]} ({k.split('_')[1]} threads) {v / 1e9:.1f} GB/s"
                   for k, v in roof["bandwidth_bytes_per_s"].items())
    bound_by = roof.get("bound_by", f"read_{roof['threads']}_threads").split("_")
    rows = [[p["context"], f"{p['bound_ms']:.2f}", f"{p['fastest_ms']:.2f}", f"{p['median_ms']:.2f}",
             f"{p['percent_of_roofline']:.1f}", f"{p['percent_of_roofline_median_step']:.1f}"] for p in roof["points"]]
    return ["## 6. Roofline (batch 1, in-place)", "",
            f"Bandwidth {bw} (the bound uses the best read: {probes[bound_by[0]]} at {bound_by[1]} threads); "
            f"{roof['weight_bytes_per_step'] / 2**20:.0f} MiB of weights read per decode step.",
            "", *table(["context", "bound (ms)", "fastest step (ms)", "median step (ms)", "% of roofline (fastest)",
                         "% (median)"], rows)]


def targets(results: dict) -> list[dict]:
    return [roofline_target(results.get("roofline"))]


def markdown(results: dict) -> list[str]:
    return section_markdown(results["roofline"]) if rendered(results.get("roofline")) else []
