"""Section 2, KV layouts: concat vs in-place through the same Runner code path.

Per (layout, batch, context): decode step time (measured in this process, the layouts taking
turns); bytes copied per step, computed from the manifest and observed (data pointers of the
cache arrays before and after a step, and which cache positions changed); peak RSS (Linux
VmHWM, reset per point). Memory is measured by one process per (layout, batch), contexts
ascending, so one layout's buffers never show in the other's numbers.
"""
from __future__ import annotations

import multiprocessing
import statistics
import sys
from pathlib import Path

import numpy as np

from bench.common import (Params, decode_steps, fitting_capacity, fmt, interleaved_steps, panels,
    rendered, say, section_ran, skipped, summary_ms, table, target)
from kvforge.manifest import Manifest, kv_bytes

LAYOUTS = ("concat", "inplace")
MEMORY_STEPS = 2  # the memory sweep only needs the cache at its size, not a timing


def memory_status() -> dict[str, int]:
    """Current and peak resident bytes of this process (Linux /proc)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            key, value, _unit = line.split()
            fields[key[:-1]] = int(value) * 1024
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}


def reset_peak_rss() -> None:
    """Start a new high-water mark: loading the session peaks far above any decode step."""
    Path("/proc/self/clear_refs").write_text("5")


def position_sums(buf: np.ndarray, rows: int) -> np.ndarray:
    """[rows, positions] checksums of a cache array, accumulated without a float64 copy of it
    (a copy would show in the next point's peak RSS)."""
    return buf[:rows].sum(axis=(1, 3), dtype=np.float64)


def observe_copy(runner, rows: int, context: int) -> dict:
    """Run one more decode step and observe what it did to the cache arrays: which were
    replaced by new allocations (their bytes were all written again) and, for arrays kept,
    how many token positions changed."""
    before = {name: (buf.ctypes.data, position_sums(buf, rows)) for name, buf in runner.kv_arrays.items()}
    if runner.manifest.kv_layout == "concat":
        runner.resize(context + 1, rows)  # concat can only append: one more column
        write_at = context
    else:
        write_at = context - 1  # rewrite the last position with another token: same work as a new one
    runner.step(np.full((rows, 1), 4, np.int64), np.full(rows, write_at, np.int64), np.ones(rows, np.int64))
    reallocated_bytes = changed_bytes = changed_positions = replaced = 0
    for name, buf in runner.kv_arrays.items():
        pointer, sums = before[name]
        if buf.ctypes.data != pointer:
            replaced += 1
            reallocated_bytes += buf.nbytes
            continue
        changed = position_sums(buf, rows) != sums
        changed_positions += int(changed.sum())
        changed_bytes += int(changed.sum()) * buf.shape[1] * buf.shape[3] * buf.itemsize
    return {"tokens_after_step": write_at + 1, "arrays": len(before), "arrays_reallocated": replaced,
            "bytes_in_reallocated_arrays": reallocated_bytes,
            "token_positions_changed_in_kept_arrays": changed_positions,
            "bytes_changed_in_kept_arrays": changed_bytes,
            "observed_bytes_written": reallocated_bytes + changed_bytes}


def expected_copy_bytes(manifest: Manifest, rows: int, tokens_after_step: int) -> int:
    """concat writes the whole present (past + the new token) into a new array every step;
    in-place writes only the new token."""
    tokens = tokens_after_step if manifest.kv_layout == "concat" else 1
    return kv_bytes(manifest.model, manifest.kv_dtype, tokens, rows)


def capacities(runner, context: int) -> list[int | None]:
    """None = the capacity that fits; for in-place also the bucket's worst case: a context one
    token past a bucket boundary lives in the next bucket (up to 25% larger)."""
    out = [None]
    manifest = runner.manifest
    if manifest.kv_layout == "inplace" and context < manifest.max_seq_len:
        out.append(runner.bucket_for(context + 1))
    return out


def memory_sweep(export_dir: str, rows: int, contexts: tuple[int, ...], threads: int) -> dict:
    """Peak RSS and observed bytes per step for one layout and batch (runs in a child process)."""
    from runtime.runners import open_runner

    runner = open_runner(export_dir, threads)
    manifest = runner.manifest
    after_load = memory_status()["rss"]
    points = []
    for context in contexts:
        for capacity in capacities(runner, context):
            reset_peak_rss()
            before = memory_status()["rss"]
            decode_steps(runner, rows, context, MEMORY_STEPS, capacity=capacity)
            observed = observe_copy(runner, rows, context)
            point = {"context": context, "capacity": capacity or fitting_capacity(runner, context), "batch": rows,
                     "worst_case_bucket": capacity is not None, "rss_before_point_bytes": before,
                     "peak_rss_bytes": memory_status()["peak"], "kv_bytes_allocated": runner.kv_bytes_allocated,
                     **observed}
            point["expected_bytes_copied_per_step"] = expected_copy_bytes(manifest, rows, point["tokens_after_step"])
            points.append(point)
    return {"layout": manifest.kv_layout, "batch": rows, "rss_after_load_bytes": after_load, "points": points}


def in_child(fn, *args):
    """fn(*args) in a fresh process, so its memory high-water mark is its own."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def step_times(runners: dict, rows: int, contexts: tuple[int, ...], steps: int, rounds: int) -> dict:
    """(layout, context, worst_case_bucket) -> decode step seconds, the layouts taking turns."""
    times: dict[tuple, list[float]] = {}
    for runner in runners.values():  # a fresh session's first steps grow its arena and thread pool
        decode_steps(runner, rows, contexts[0], steps)
    for context in contexts:
        variants = {(layout, context, capacity is not None): (runner, capacity)
                    for layout, runner in runners.items() for capacity in capacities(runner, context)}
        measured = interleaved_steps(variants, rows, context, steps, rounds)
        times.update(measured)
        print(f"[bench]   batch {rows} context {context}: " + ", ".join(
            f"{layout}{' (worst-case bucket)' if worst else ''} {1e3 * statistics.median(t):.2f} ms"
            for (layout, _, worst), t in measured.items()), file=sys.stderr, flush=True)
    return times


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    exports = {layout: artifacts.export(params.model, layout, "fp32") for layout in LAYOUTS}
    runners = {layout: open_runner(exports[layout], params.threads) for layout in LAYOUTS}
    manifest = runners["inplace"].manifest
    sweeps = []
    for rows in params.batches:
        say(f"layouts: step time, batch {rows}, contexts {list(params.contexts)}")
        times = step_times(runners, rows, params.contexts, params.timed_steps, params.layout_rounds)
        for layout in LAYOUTS:
            say(f"layouts: memory and bytes copied, {layout}, batch {rows} (own process)")
            sweep = in_child(memory_sweep, str(exports[layout]), rows, params.contexts, params.threads)
            for point in sweep["points"]:
                point.update(summary_ms(times[(layout, point["context"], point["worst_case_bucket"])]))
            sweeps.append(sweep)
    return {
        "model": params.model, "kv_dtype": "fp32", "kv_bytes_per_token": manifest.kv_bytes_per_token,
        "max_seq_len": manifest.max_seq_len, "timed_steps_per_point": params.timed_steps * params.layout_rounds,
        "threads": params.threads,
        "method": {
            "step_time": f"median of {params.layout_rounds} rounds x {params.timed_steps} one-token decode steps "
                         "ending at the context, each round after one warm-up step, layouts taking turns; "
                         "the past is seeded (values do not change step time)",
            "expected_bytes": "concat: tokens after the step x kv_bytes_per_token x batch (the present is "
                              "a new array holding the whole past); inplace: 1 token x kv_bytes_per_token x batch",
            "observed_bytes": "one extra step: bytes of cache arrays whose data pointer changed, plus "
                              "token positions whose contents changed in arrays that kept their pointer",
            "peak_rss": "process RSS high-water mark (VmHWM, reset before each point) over the point's steps; "
                        "one process per layout and batch, contexts ascending; includes the weights "
                        "(rss_after_load_bytes) and what earlier points left in ORT's arena (rss_before_point_bytes); "
                        "never-written KV pages are not resident (kv_bytes_allocated is the reservation)",
            "inplace_capacity": "capacity bucket = smallest grid capacity >= context (kvforge.manifest."
                                "capacity_bucket, 4 steps per power of two); worst_case_bucket points use "
                                "the bucket of context + 1 (a context just past a bucket boundary)"},
        "units": {"median_ms": "ms", "min_ms": "ms", "max_ms": "ms", "peak_rss_bytes": "bytes",
                  "rss_after_load_bytes": "bytes", "rss_before_point_bytes": "bytes", "kv_bytes_allocated": "bytes",
                  "expected_bytes_copied_per_step": "bytes", "observed_bytes_written": "bytes",
                  "kv_bytes_per_token": "bytes"},
        "sweeps": sweeps,
    }


def step_ms(layouts: dict, layout: str, batch: int, worst_case: bool = False, stat: str = "median_ms") -> dict:
    """context -> step ms (median, or another summary_ms statistic) for one layout and batch."""
    for s in layouts["sweeps"]:
        if s["layout"] == layout and s["batch"] == batch:
            return {p["context"]: p[stat] for p in s["points"] if p["worst_case_bucket"] == worst_case}
    return {}


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def layout_targets(layouts: dict) -> list[dict]:
    names = ("In-place step time <= concat at every context (capacity = bucket that fits)",
             "In-place step time <= concat at every context (worst case: context just past a bucket boundary)",
             "In-place bytes copied per step = O(new tokens)")
    if not section_ran(layouts):
        return [skipped(n, "", "layouts section did not run") for n in names]
    why = {False: "at equal capacity the in-place step does the same attention plus a scatter and a causal "
                  "mask over the whole buffer, while concat's copy is still small at these contexts",
           True: "the buffer is twice the context and ORT's Attention costs follow the buffer, "
                 "not the valid length"}
    rows = []
    for worst in (False, True):
        ratios = []  # (median ratio, min ratio, batch, context)
        for batch in sorted({s["batch"] for s in layouts["sweeps"]}):
            concat = step_ms(layouts, "concat", batch)
            concat_min = step_ms(layouts, "concat", batch, stat="min_ms")
            best = step_ms(layouts, "inplace", batch, worst_case=worst, stat="min_ms")
            for context, ms in step_ms(layouts, "inplace", batch, worst_case=worst).items():
                ratios.append((ms / concat[context], best[context] / concat_min[context], batch, context))
        if not ratios:
            rows.append(skipped(names[worst], "ratio <= 1 everywhere", "no worst-case points (max_seq_len)"))
            continue
        ratio, _, batch, context = max(ratios)
        # slower by the median but not by the fastest step: other processes' load, not the layout
        consistent = [f"b{b}@{c}" for r, m, b, c in sorted(ratios, key=lambda x: x[2:]) if r > 1 and m > 1]
        noisy = [f"b{b}@{c}" for r, m, b, c in sorted(ratios, key=lambda x: x[2:]) if r > 1 >= m]
        detail = "met at every point" if ratio <= 1 else "; ".join(filter(None, [
            consistent and f"slower by median and fastest step at {', '.join(consistent)}: {why[worst]}",
            noisy and f"slower by median only at {', '.join(noisy)} (the fastest steps favour in-place: load "
                      "from other processes, not the layout)"]))
        rows.append(target(names[worst], "in-place / concat <= 1 at every point (median step)",
                           f"worst {ratio:.3f}x (batch {batch}, context {context})", ratio <= 1, detail))
    inplace = [p for s in layouts["sweeps"] if s["layout"] == "inplace" for p in s["points"]]
    exact = all(p["observed_bytes_written"] == p["expected_bytes_copied_per_step"] and p["arrays_reallocated"] == 0
                for p in inplace)
    concat_max = max(p["observed_bytes_written"] for s in layouts["sweeps"] if s["layout"] == "concat"
                     for p in s["points"])
    inplace_max = max(p["observed_bytes_written"] for p in inplace)
    rows.append(target(names[2], "1 new token x KV bytes/token x batch, no reallocation",
                       f"in-place max {inplace_max:,} B/step vs concat max {concat_max:,} B/step", exact,
                       "observed: no cache array changed its data pointer and only the new token's positions "
                       "changed" if exact else "some in-place step reallocated or wrote more than the new tokens"))
    return rows


def plot_layouts(plt, layouts: dict, path: Path) -> None:
    def draw(left, right):
        for color, s in enumerate(layouts["sweeps"]):
            for worst in (False, True):
                pts = [p for p in s["points"] if p["worst_case_bucket"] == worst]
                if not pts:
                    continue
                label = f"{s['layout']}, batch {s['batch']}" + (" (worst-case bucket)" if worst else "")
                style = ":" if worst else ("o-" if s["layout"] == "inplace" else "s-")
                context = [p["context"] for p in pts]
                left.plot(context, [p["median_ms"] for p in pts], style, color=f"C{color}", label=label)
                if not worst:
                    right.plot(context, [p["observed_bytes_written"] for p in pts], style, color=f"C{color}",
                               label=label)
        left.set(xlabel="context (tokens)", ylabel="decode step (ms)", title="Step time by KV layout")
        right.set(xlabel="context (tokens)", ylabel="KV bytes written per step (observed)", yscale="log",
                  title="Bytes copied per step")

    panels(plt, path, layouts, "layouts", draw)


def section_markdown(layouts: dict) -> list[str]:
    rows = [[s["layout"], s["batch"], p["context"], p["capacity"], fmt(p["median_ms"]),
             f"{p['observed_bytes_written']:,}", f"{p['expected_bytes_copied_per_step']:,}",
             f"{p['kv_bytes_allocated'] / 2**20:.0f}", f"{p['peak_rss_bytes'] / 2**20:.0f}"]
            for s in layouts["sweeps"] for p in s["points"]]
    return ["## 2. KV layouts", "",
            "Peak RSS is the whole process (weights included); KV pages never written stay unbacked, so a "
            "fresh in-place buffer counts only the tokens written so far, while concat's present arrays are "
            "written in full every step.", "",
            *table(["layout", "batch", "context", "capacity", "step (ms)", "bytes written/step (observed)",
                     "expected", "KV allocated (MiB)", "peak RSS (MiB)"], rows)]


def targets(results: dict) -> list[dict]:
    return layout_targets(results.get("layouts"))


def markdown(results: dict) -> list[str]:
    return section_markdown(results["layouts"]) if rendered(results.get("layouts")) else []


def plot(plt, results: dict, out: Path) -> None:
    plot_layouts(plt, results.get("layouts"), out / "layouts.png")
