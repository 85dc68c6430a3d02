"""python -m bench [--quick] [--out DIR]: measure what the KV cache buys, against peers, with plots.

Sections (issue 5): cache vs no cache, KV layouts, KV dtypes, peers, serving through Triton,
roofline, prefill (issue 13), weight quantization; (issue 9) prefix caching; (issue 10) KV tiers;
(issue 22) a fleet behind the router; (issue 20) streams beside long prompts per scheduler; (issue 37) stream
gaps while long prompts arrive, the ITL target's trade-off; (issue 21) mla;
(issue 23) prompt-lookup speculation and the idle-thread spin policy; (issue 42) structured outputs;
(issue 39) the model families: export, engine sizes, decode and quantized-weight quality per family, windowed KV.
Writes DIR/bench.json, DIR/bench.md and PNG plots; a section
that fails is recorded with its error, the others still run, and the exit code is 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from importlib import import_module
from pathlib import Path

from bench import common, report
from bench.common import ROOT, Artifacts, SectionError, params, say

SECTIONS = ("layouts", "cache", "kv_dtypes", "peers", "roofline", "prefill", "weights", "serving", "prefix_cache",
            "kv_tiers", "fleet", "mixed_load", "stream_gaps", "mla", "speculative", "spin", "structured", "families")


def prepare(p, artifacts: Artifacts, sections: set[str]) -> None:
    """Make the exports the sections need up front, two at a time (each export is mostly one
    core of tracing); the sections then find them cached."""
    peer_models = set(p.peer_models or (p.model,)) if sections & {"peers", "prefill"} else set()
    for model in {p.model, p.quality_model} | peer_models:
        artifacts.checkpoint(model)  # materialize presets once, before any parallel export
    jobs = []
    if sections & {"layouts", "cache", "peers", "roofline", "weights", "serving", "prefix_cache", "spin"}:
        jobs += [(p.model, layout, "fp32") for layout in ("concat", "inplace")]
    if sections & {"kv_tiers", "fleet", "mixed_load", "stream_gaps"}:
        jobs.append((p.model, "inplace", "fp32"))
    if "kv_dtypes" in sections:
        jobs += [(p.quality_model, "inplace", d) for d in common.runnable_kv_dtypes()]
    if sections & {"weights", "prefix_cache", "kv_tiers", "fleet"}:
        jobs.append((p.quality_model, "inplace", "fp32"))
    jobs += [(model, "inplace", "fp32") for model in sorted(peer_models)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(artifacts.export, *job) for job in dict.fromkeys(jobs)]
        if "peers" in sections:
            futures += [pool.submit(artifacts.genai, model) for model in sorted(peer_models | {p.model})]
        for f in futures:
            f.result()


def run_section(name: str, p, artifacts: Artifacts) -> dict:
    say(f"section {name}: start")
    began = time.perf_counter()
    try:
        # imported here, so a section whose module cannot load fails alone
        result = {"status": "ok", **import_module(f"bench.{name}").run(p, artifacts)}
    except SectionError as e:
        result = {"status": "error", "error": str(e), "partial": True, **e.partial}
    except Exception as e:  # one broken section must not cost the others' numbers
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(e).__name__}: {str(e)[:500]}"}
    result["seconds"] = round(time.perf_counter() - began, 1)
    say(f"section {name}: {result['status']} in {result['seconds']:.0f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="every section on tiny sizes (< 3 minutes)")
    parser.add_argument("--out", type=Path, default=ROOT / "results", help="results directory (default results/)")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench",
                        help="cache of exports and engines (reused while the checkpoint is unchanged)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every system")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated subset of {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    sections = {s for s in args.sections.split(",") if s}
    unknown = sections - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {', '.join(sorted(unknown))}")
    if not (common.TRAINED_MODEL / "model.safetensors").is_file():
        print(f"error: the trained model {common.TRAINED_MODEL} is missing; make it with "
              "`python -m export.train --out models/stdlib-llama`", file=sys.stderr)
        return 2

    p = params(args.quick, args.threads)
    artifacts = Artifacts(args.work)
    began = time.perf_counter()
    results: dict = {"meta": {"command": "python -m bench" + (" --quick" if args.quick else ""),
                              "params": p.to_dict(), "machine": common.machine_facts(),
                              "versions": common.library_versions(), "started_unix": time.time()}}
    say(f"{'quick' if p.quick else 'full'} run: model {p.model}, quality model {Path(p.quality_model).name}, "
        f"{p.threads} threads, sections {', '.join(s for s in SECTIONS if s in sections)}")
    say("preparing exports (cached under " + str(args.work) + ")")
    prepare(p, artifacts, sections)

    for name in SECTIONS:
        if name in sections:
            results[report.RESULT_KEYS.get(name, name)] = run_section(name, p, artifacts)
    results["meta"]["duration_s"] = round(time.perf_counter() - began, 1)
    results["meta"]["machine"]["load_average_at_end"] = list(os.getloadavg())

    report.write(results, args.out)
    failed = [k for k, v in results.items() if isinstance(v, dict) and v.get("status") == "error"]
    say(f"wrote {args.out / 'bench.json'}, {args.out / 'bench.md'} and plots in {results['meta']['duration_s']:.0f} s"
        + (f"; sections failed: {', '.join(failed)}" if failed else ""))
    for t in results["targets"]:
        status = {True: "met", False: "NOT MET", None: "not evaluated"}[t["met"]]
        print(f"{status:>13}  {t['target']}: {t['measured']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
