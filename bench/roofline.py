"""Section 6, roofline: the machine's read bandwidth, and decode steps of the fp32, int8 and int4
weight engines at batch 1, 2 and 4 as the bytes per second they read. A decode step must read
every weight once plus the K/V of every cached token of every row, so step time >= (weight bytes +
rows x context x KV bytes/token) / bandwidth; the weight bytes are the engine's own initializers.

Bandwidth and decode steps are measured in turns, so both see the same load from other
processes; the headline compares the best read with the fastest step (what the hardware and the
engine can do), and the median step is reported beside it.
"""
from __future__ import annotations

import math
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from bench.common import Params, decode_steps, finish_figure, rendered, say, section_ran, skipped, table, target
from kvforge.manifest import kv_bytes
from kvforge.onnx_graphs import all_nodes

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


# the weights section's engines (python -m engines build --weights) but fp16's: its bytes are counted from
# the engine's initializers, and ONNX Runtime's CPU provider widens fp16 ones to fp32 when it loads them
WEIGHT_MODES = ("fp32", "int8", "int4")
TARGET_PERCENT = 90  # issue 23: batch-1 decode reads its bytes at >= 90% of the measured read bandwidth
TARGET_WEIGHTS = ("fp32", "int8")


def initializer_bytes(tensor) -> int:
    """Bytes of one ONNX initializer, from its shape and element type (4-bit types pack two per byte)."""
    from onnx import TensorProto, helper

    elements = math.prod(tensor.dims)
    if tensor.data_type in (TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1):
        return (elements + 1) // 2
    return elements * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


def step_weight_bytes(model_path: Path, rows: int) -> dict:
    """Weight bytes one decode step of `rows` sequences reads, summed over the engine's own ONNX
    initializers: each is read whole, except one that only Gather nodes read as their data (the
    embedding table, rotary tables), of which a step reads one row per sequence."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    readers: dict[str, set] = {}
    for node in all_nodes(graph):
        for index, name in enumerate(node.input):
            readers.setdefault(name, set()).add((node.op_type, index))
    whole, gathered = 0, 0
    for tensor in graph.initializer:
        size = initializer_bytes(tensor)
        if readers.get(tensor.name, set()) == {("Gather", 0)} and tensor.dims:
            gathered += min(rows, tensor.dims[0]) * size // tensor.dims[0]
        else:
            whole += size
    return {"read_whole_bytes": whole, "gathered_rows_bytes": gathered, "weight_bytes_per_step": whole + gathered,
            "initializers": len(graph.initializer)}


def decode_point(weights: str, rows: int, context: int, times: list[float], weight_bytes: int, kv_per_token: int,
                 bandwidth: float) -> dict:
    """One decode figure as bytes read per step over step time, and as a share of `bandwidth`."""
    needed = weight_bytes + kv_per_token * context * rows
    bound = needed / bandwidth
    fastest, median = min(times), statistics.median(times)
    return {"weights": weights, "batch": rows, "context": context, "weight_bytes_per_step": weight_bytes,
            "bytes_per_step": needed, "bound_ms": round(bound * 1e3, 4),
            "fastest_ms": round(fastest * 1e3, 4), "median_ms": round(median * 1e3, 4),
            "fastest_tokens_per_s": round(rows / fastest, 2), "bound_tokens_per_s": round(rows / bound, 2),
            "gb_per_s": round(needed / fastest / 1e9, 3), "gb_per_s_median_step": round(needed / median / 1e9, 3),
            "percent_of_roofline": round(100 * bound / fastest, 2),
            "percent_of_roofline_median_step": round(100 * bound / median, 2)}


def batch_one(points: list[dict], weights: str, context: int) -> dict:
    return next(p for p in points if (p["weights"], p["batch"], p["context"]) == (weights, 1, context))


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    export = artifacts.export(params.model, "inplace", "fp32")
    engines = {w: artifacts.engine(export, w, params.threads) for w in WEIGHT_MODES}
    runners = {w: open_runner(directory, params.threads) for w, directory in engines.items()}
    spec = runners["fp32"].manifest.model
    head_context = params.contexts[0]
    # every weight mode at every batch at the first context; fp32 batch 1 along every context
    grid = [(w, rows, head_context) for w in WEIGHT_MODES for rows in params.roofline_batches]
    grid += [("fp32", 1, context) for context in params.contexts[1:]]
    tests = {(kind, t): test for t in sorted({1, params.threads}) for kind, test in stream_tests(t).items()}
    tests["matmul", params.threads] = matmul_test(params.threads)
    seconds: dict[tuple, list[float]] = {key: [] for key in tests}
    steps: dict[tuple, list[float]] = {key: [] for key in grid}
    for runner in runners.values():
        decode_steps(runner, 1, head_context, params.timed_steps)  # warm-up
    say(f"roofline: memory bandwidth and decode steps ({', '.join(WEIGHT_MODES)} weights, batches "
        f"{list(params.roofline_batches)}), taking turns ({params.layout_rounds} rounds)")
    for _ in range(params.layout_rounds):
        for key, (fn, args, _) in tests.items():
            seconds[key] += [concurrent_seconds(fn, args) for _ in range(STREAMS_PER_ROUND)]
        for weights, rows, context in grid:
            steps[weights, rows, context] += decode_steps(runners[weights], rows, context, params.timed_steps)
    bandwidth = {f"{kind}_{t}_threads": tests[kind, t][2] / min(s) for (kind, t), s in seconds.items()}
    bound_by = max((f"{kind}_{params.threads}_threads" for kind in ("read", "matmul")), key=bandwidth.get)
    kv_per_token = kv_bytes(spec, "fp32", 1)
    step_bytes = {(w, rows): step_weight_bytes(engines[w] / runners[w].manifest.engine["file"], rows)
                  for w in WEIGHT_MODES for rows in params.roofline_batches}
    points = [decode_point(w, rows, context, steps[w, rows, context], step_bytes[w, rows]["weight_bytes_per_step"],
                           kv_per_token, bandwidth[bound_by]) for w, rows, context in grid]
    return {
        "model": params.model, "threads": params.threads, "layout": "inplace", "kv_dtype": "fp32",
        "batches": list(params.roofline_batches), "head_context": head_context,
        "bandwidth_bytes_per_s": {k: round(v) for k, v in bandwidth.items()}, "bound_by": bound_by,
        "read_bandwidth_bytes_per_s": round(bandwidth[bound_by]),
        "engines": {w: {"dir": str(engines[w]), **step_bytes[w, 1]} for w in WEIGHT_MODES},
        "kv_bytes_per_token": kv_per_token,
        "headline": {w: batch_one(points, w, head_context)["percent_of_roofline"] for w in WEIGHT_MODES},
        "method": "GB/s = (weight bytes a step reads + context x batch x KV bytes/token) / step time; weight bytes "
                  "= the engine's own ONNX initializers (python -m engines build --weights fp32|int8|int4), each "
                  "read whole except those only Gather reads (embedding, rotary tables): one row per sequence. "
                  "% of roofline = that over the best read bandwidth at the run's thread count, of np.dot over "
                  "float32 arrays and ONNX Runtime's MatMul of one row by a 256 MiB weight; copy bandwidth "
                  "(np.copyto, counting its read and its write) is reported beside them; bandwidth probes and "
                  "in-place decode steps of every engine and batch are measured in turns; the headline figures use "
                  "the fastest step, the *_median_step ones the median",
        "units": {"bandwidth_bytes_per_s": "bytes/s", "read_bandwidth_bytes_per_s": "bytes/s",
                  "bytes_per_step": "bytes", "weight_bytes_per_step": "bytes", "read_whole_bytes": "bytes",
                  "gathered_rows_bytes": "bytes", "bound_ms": "ms", "fastest_ms": "ms", "median_ms": "ms",
                  "bound_tokens_per_s": "tokens/s (all rows)", "fastest_tokens_per_s": "tokens/s (all rows)",
                  "gb_per_s": "1e9 bytes/s", "gb_per_s_median_step": "1e9 bytes/s", "percent_of_roofline": "%",
                  "percent_of_roofline_median_step": "%", "kv_bytes_per_token": "bytes", "headline": "%"},
        "points": points,
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def roofline_targets(roofline: dict | None) -> list[dict]:
    rows = []
    for weights in TARGET_WEIGHTS:
        name = f"{weights} decode at batch 1 >= {TARGET_PERCENT}% of the measured read bandwidth"
        required = f">= {TARGET_PERCENT}%"
        if not section_ran(roofline):
            rows.append(skipped(name, required, "roofline section did not run"))
            continue
        p = batch_one(roofline["points"], weights, roofline["head_context"])
        met = p["percent_of_roofline"] >= TARGET_PERCENT
        rows.append(target(name, required, f"{p['percent_of_roofline']:.1f}% ({p['gb_per_s']:.1f} of "
                           f"{roofline['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s) by the fastest step, "
                           f"{p['percent_of_roofline_median_step']:.1f}% by the median (context {p['context']})",
                           met, f"{p['percent_of_roofline'] - TARGET_PERCENT:+.1f} points" + ("" if met else
                           "; the remainder is compute and per-step overhead that a weight-streaming bound ignores")))
    return rows


PROBES = {"read": "np.dot read", "copy": "np.copyto", "matmul": "ONNX Runtime MatMul read"}


def section_markdown(roof: dict) -> list[str]:
    bw = ", ".join(f"{PROBES[k.split('_')[0]]} ({k.split('_')[1]} threads) {v / 1e9:.1f} GB/s"
                   for k, v in roof["bandwidth_bytes_per_s"].items())
    probe, threads = roof["bound_by"].split("_")[:2]
    engines = ", ".join(f"{w} {e['weight_bytes_per_step'] / 2**20:.1f} MiB" for w, e in roof["engines"].items())

    def cells(p: dict) -> list:
        return [p["weights"], p["batch"], p["context"], f"{p['bytes_per_step'] / 2**20:.1f}", f"{p['fastest_ms']:.2f}",
                f"{p['median_ms']:.2f}", f"{p['gb_per_s']:.1f}", f"{p['gb_per_s_median_step']:.1f}",
                f"{p['percent_of_roofline']:.1f}", f"{p['percent_of_roofline_median_step']:.1f}"]

    header = ["weights", "batch", "context", "MiB read / step", "fastest step (ms)", "median step (ms)",
              "GB/s (fastest)", "GB/s (median)", "% of read bandwidth (fastest)", "% (median)"]
    return ["## 6. Roofline: bytes read per decode step against the read bandwidth (in-place, fp32 KV)", "",
            f"Bandwidth {bw}; the bound uses the best read at the run's thread count: {PROBES[probe]} at {threads} "
            f"threads, {roof['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s. Weights a batch-1 step reads, summed "
            f"over each engine's ONNX initializers: {engines}.", "",
            *table(header, [cells(p) for p in roof["points"]]), "", "Plot: [roofline.png](roofline.png)"]


def plot(plt, results: dict, out: Path) -> None:
    roof = results.get("roofline")
    fig, (by_batch, by_context) = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(roof):
        head = [p for p in roof["points"] if p["context"] == roof["head_context"]]
        for weights in WEIGHT_MODES:
            mine = [p for p in head if p["weights"] == weights]
            by_batch.plot([p["batch"] for p in mine], [p["gb_per_s"] for p in mine], "o-", label=f"{weights} weights")
        by_batch.axhline(roof["read_bandwidth_bytes_per_s"] / 1e9, color="k", ls="--", label="measured read bandwidth")
        by_batch.set(xticks=roof["batches"], ylim=(0, None), xlabel="batch", ylabel="GB/s read (fastest step)",
                     title=f"Decode bytes read per second, context {roof['head_context']}")
        curve = [p for p in roof["points"] if (p["weights"], p["batch"]) == ("fp32", 1)]
        for key, label in (("percent_of_roofline", "fastest step"), ("percent_of_roofline_median_step", "median")):
            by_context.plot([p["context"] for p in curve], [p[key] for p in curve], "o-", label=label)
        by_context.axhline(TARGET_PERCENT, color="k", ls="--", label=f"target {TARGET_PERCENT}%")
        contexts = [p["context"] for p in curve]
        by_context.set_xscale("log", base=2)
        by_context.set_xticks(contexts, [str(c) for c in contexts])
        by_context.minorticks_off()
        by_context.set(ylim=(0, 105), xlabel="context (tokens)", ylabel="% of read bandwidth",
                       title="fp32 weights, batch 1")
        for ax in (by_batch, by_context):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, out / "roofline.png", roof, "roofline", [by_batch, by_context])


def targets(results: dict) -> list[dict]:
    return roofline_targets(results.get("roofline"))


def markdown(results: dict) -> list[str]:
    return section_markdown(results["roofline"]) if rendered(results.get("roofline")) else []
