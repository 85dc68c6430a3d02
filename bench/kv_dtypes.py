"""Section 3, KV dtypes: bytes per token, sequences that fit a KV budget, step time, and quality
(held-out perplexity, greedy agreement with fp32) on the trained model, in-place layout.

Bytes are computed from the manifest for the trained model and for the benchmark model; step
time and quality are measured on the trained model (random weights make quality meaningless).
"""
from __future__ import annotations

from bench.common import (Params, generate, greedy_agreement, held_out_prompts, interleaved_steps, perplexity,
    quality_cells, rendered, runnable_kv_dtypes, say, section_ran, skipped, summary_ms, table, target)
from export.train import eval_windows, held_out_tokens
from kvforge.manifest import KV_DTYPES, Manifest, ModelSpec, kv_bytes_per_token

GREEDY_ROWS = 8


def budget_table(spec: ModelSpec, params: Params) -> list[dict]:
    fp16 = kv_bytes_per_token(spec, "fp16")
    rows = []
    for name, d in KV_DTYPES.items():
        per_token = kv_bytes_per_token(spec, name)
        rows.append({"kv_dtype": name, "bytes_per_token": per_token, "relative_to_fp16": round(per_token / fp16, 4),
                     "sequences_in_budget": params.kv_budget_bytes // (per_token * params.budget_sequence_tokens),
                     "runs_on": list(d.runs_on)})
    return rows


def quality_setup(params: Params, artifacts) -> dict:
    """The held-out material every quality measurement uses (same text for every variant)."""
    checkpoint = artifacts.checkpoint(params.quality_model)
    stream = held_out_tokens(checkpoint)
    return {"windows": eval_windows(stream, params.eval_windows),
            "prompts": held_out_prompts(stream, GREEDY_ROWS, params.greedy_prompt_tokens)}


def quality(runner, reference: dict | None, material: dict, new_tokens: int) -> dict:
    """Perplexity and greedy generation of one variant; agreement with `reference` (the fp32
    variant's result) when given."""
    out = {"perplexity": round(perplexity(runner, material["windows"]), 4)}
    tokens = generate(runner, material["prompts"], new_tokens)["tokens"]
    if reference is not None:
        out["perplexity_vs_fp32_percent"] = round(100 * (out["perplexity"] / reference["perplexity"] - 1), 3)
        out.update(greedy_agreement(reference["tokens"], runner, material["prompts"], tokens))
    return {**out, "tokens": tokens}


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    benchmark_spec = Manifest.load(artifacts.export(params.model, "inplace", "fp32")).model
    material = quality_setup(params, artifacts)
    runners = {d: open_runner(artifacts.export(params.quality_model, "inplace", d), params.threads)
               for d in runnable_kv_dtypes()}
    results, reference = [], None
    for dtype, runner in runners.items():
        say(f"kv dtypes: {dtype} on the trained model (perplexity, greedy generation)")
        q = quality(runner, reference, material, params.greedy_tokens)
        if dtype == "fp32":  # the reference every other dtype is compared with; it comes first
            reference = q
        results.append({"kv_dtype": dtype, "bytes_per_token": runner.manifest.kv_bytes_per_token,
                        **{k: v for k, v in q.items() if k != "tokens"}, "step_time": []})
    say(f"kv dtypes: step time, the dtypes taking turns ({params.layout_rounds} rounds)")
    for rows in params.batches:
        for context in params.dtype_contexts:
            times = interleaved_steps({d: (r, None) for d, r in runners.items()}, rows, context,
                                      params.timed_steps, params.layout_rounds)
            for r in results:
                r["step_time"].append({"batch": rows, "context": context, **summary_ms(times[r["kv_dtype"]])})
    trained_spec = runners["fp32"].manifest.model
    return {
        "quality_model": params.quality_model, "layout": "inplace",
        "kv_budget_bytes": params.kv_budget_bytes, "sequence_tokens_for_budget": params.budget_sequence_tokens,
        "eval": {"windows": int(len(material["windows"])), "window_tokens": int(material["windows"].shape[1] - 1),
                 "greedy_rows": GREEDY_ROWS, "greedy_prompt_tokens": params.greedy_prompt_tokens,
                 "greedy_new_tokens": params.greedy_tokens},
        "bytes": {"benchmark_model": budget_table(benchmark_spec, params),
                  "quality_model": budget_table(trained_spec, params)},
        "measured": results,
        "units": {"bytes_per_token": "bytes", "sequences_in_budget": "sequences of sequence_tokens_for_budget "
                  "tokens in kv_budget_bytes", "perplexity": "exp(nats/token)", "perplexity_vs_fp32_percent": "%",
                  "free_running_agreement": "fraction", "teacher_forced_agreement": "fraction",
                  "median_ms": "ms", "min_ms": "ms", "max_ms": "ms"},
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def kv_dtype_target(kv: dict) -> dict:
    """Judged on int8-static (calibrated scales in the graph: nothing stored beside the cache);
    the per-token int8 cache, which needs no calibration, is quoted beside it."""
    name, required = "int8 KV: half the bytes of fp16, perplexity within 1% of fp32", "<= 0.50x fp16 bytes, <= 1%"
    if not section_ran(kv):
        return skipped(name, required, "kv_dtypes section did not run")

    def figures(dtype: str) -> tuple[float, float]:
        ratio = next(r for r in kv["bytes"]["benchmark_model"] if r["kv_dtype"] == dtype)["relative_to_fp16"]
        return ratio, next(r for r in kv["measured"] if r["kv_dtype"] == dtype)["perplexity_vs_fp32_percent"]

    ratio, ppl = figures("int8-static")
    per_token_ratio, per_token_ppl = figures("int8")
    bytes_met, ppl_met = ratio <= 0.5, abs(ppl) <= 1
    detail = [f"int8-static: bytes {ratio:.3f}x fp16, perplexity {ppl:+.2f}% vs fp32"
              + ("" if ppl_met else " (over the 1% bound)"),
              f"per-token int8: {per_token_ratio:.3f}x fp16 (its fp16 scale per token and head), "
              f"perplexity {per_token_ppl:+.2f}%"]
    return target(name, required, f"int8-static {ratio:.3f}x fp16 bytes, perplexity {ppl:+.2f}%",
                  bytes_met and ppl_met, "; ".join(detail))


def section_markdown(kv: dict) -> list[str]:
    bench_bytes = {r["kv_dtype"]: r for r in kv["bytes"]["benchmark_model"]}
    rows = []
    for r in kv["measured"]:
        b = bench_bytes[r["kv_dtype"]]
        steps = ", ".join(f"{s['median_ms']:.2f} (b{s['batch']}, {s['context']})" for s in r["step_time"])
        rows.append([r["kv_dtype"], f"{b['bytes_per_token']:,}", f"{b['sequences_in_budget']:,}",
                     *quality_cells(r), steps])
    e = kv["eval"]
    return ["## 3. KV dtypes", "",
            f"Bytes for the benchmark model; {kv['kv_budget_bytes'] / 2**30:g} GiB holds N sequences of "
            f"{kv['sequence_tokens_for_budget']} tokens. Quality and step time on the trained model "
            f"({e['windows']} held-out windows of {e['window_tokens']} tokens; greedy: {e['greedy_rows']} prompts x "
            f"{e['greedy_new_tokens']} tokens).", "",
            *table(["KV dtype", "bytes/token", "sequences in budget", "perplexity", "vs fp32",
                     "greedy agreement (teacher-forced / free-running)", "step ms (batch, context)"], rows)]


def targets(results: dict) -> list[dict]:
    return [kv_dtype_target(results.get("kv_dtypes"))]


def markdown(results: dict) -> list[str]:
    return section_markdown(results["kv_dtypes"]) if rendered(results.get("kv_dtypes")) else []
