"""Section 7, weights: fp32 vs fp16 / int8 / int4 weight ONNX Runtime engines (built by
`python -m engines build --weights ...`): decode tokens/s on the benchmark model (the engines
taking turns) and quality (perplexity, greedy agreement with the fp32 engine) on the trained model."""
from __future__ import annotations

from bench.common import Params, SectionError, kvforge_steps, quality_cells, random_prompts, rendered, say, table
from bench.kv_dtypes import quality, quality_setup
from bench.peers import interleaved
from engines.onnxruntime_build import WEIGHT_MODES
from kvforge.manifest import Manifest


def run(params: Params, artifacts) -> dict:
    from runtime.runners import open_runner

    speed_export = artifacts.export(params.model, "inplace", "fp32")
    quality_export = artifacts.export(params.quality_model, "inplace", "fp32")
    engines, failed = {}, {}
    for weights in WEIGHT_MODES:
        try:
            engines[weights] = (artifacts.engine(speed_export, weights, params.threads),
                                artifacts.engine(quality_export, weights, params.threads))
        except RuntimeError as e:  # a refused build is a result too; the other modes still run
            say(f"weights: the {weights} engine build failed")
            failed[weights] = str(e)[-600:]

    runners = {w: open_runner(speed, params.threads) for w, (speed, _) in engines.items()}
    vocab = Manifest.load(speed_export).model.vocab_size
    speed = {w: [] for w in engines}
    for rows in params.batches:
        say(f"weights: {', '.join(engines)} engines taking turns, batch {rows}")
        rates = interleaved({w: (lambda ids, n, r=r: kvforge_steps(r, ids, n)) for w, r in runners.items()},
                            random_prompts(vocab, rows, params.prompt_tokens), params.new_tokens, params.peer_rounds)
        for w, rate in rates.items():
            speed[w].append({"batch": rows, **rate})

    material = quality_setup(params, artifacts)
    results, reference = [], None
    for weights in WEIGHT_MODES:
        if weights in failed:
            results.append({"weights": weights, "error": failed[weights]})
            continue
        say(f"weights: {weights} engine quality on the trained model")
        q = quality(open_runner(engines[weights][1], params.threads), reference, material, params.greedy_tokens)
        if weights == "fp32":
            reference = q
        engine = Manifest.load(engines[weights][0]).engine
        results.append({"weights": weights, "engine_bytes": engine["size_bytes"],
                        "parity_max_abs_diff_vs_export": engine.get("parity_max_abs_diff"),
                        "speed": speed[weights], **{k: v for k, v in q.items() if k != "tokens"}})
    section = {
        "model": params.model, "quality_model": params.quality_model, "layout": "inplace", "kv_dtype": "fp32",
        "prompt_tokens": params.prompt_tokens, "new_tokens": params.new_tokens, "rounds": params.peer_rounds,
        "results": results,
        "units": {"engine_bytes": "bytes", "decode_tokens_per_s": "tokens/s (all rows)",
                  "decode_tokens_per_s_mean": "tokens/s (all rows)", "median_step_ms": "ms",
                  "fastest_step_ms": "ms", "prefill_s": "s",
                  "perplexity": "exp(nats/token)", "perplexity_vs_fp32_percent": "%",
                  "free_running_agreement": "fraction", "teacher_forced_agreement": "fraction"},
    }
    if failed:
        raise SectionError(f"engines build refused {', '.join(failed)} weights", section)
    return section


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def section_markdown(weights: dict) -> list[str]:
    rows = [[r["weights"], f"{r['engine_bytes'] / 2**20:.1f}",
             ", ".join(f"{s['decode_tokens_per_s']:.1f} (b{s['batch']})" for s in r["speed"]), *quality_cells(r)]
            if "error" not in r else [r["weights"], "build refused: " + r["error"].strip().splitlines()[-1], *[""] * 4]
            for r in weights["results"]]
    return ["## 7. Weight quantization (ONNX Runtime engines)", "",
            *table(["weights", "engine MiB", "decode tokens/s (batch)", "perplexity", "vs fp32",
                     "greedy agreement (teacher-forced / free-running)"], rows)]


def targets(results: dict) -> list[dict]:
    return []


def markdown(results: dict) -> list[str]:
    return section_markdown(results["weights"]) if rendered(results.get("weights")) else []
