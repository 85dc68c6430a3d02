"""Turn the sections' results into results/bench.json, the PNG plots and results/bench.md with
the issue's targets, each met / not met and by how much.

Every section module owns its report: `targets(results)` (rows of the targets table),
`markdown(results)` (its bench.md lines, [] when it has nothing to show) and, where it draws
one, `plot(plt, results, out)` (its PNG; a section that did not run gets a figure saying why).
This module only orders and assembles them.
"""
from __future__ import annotations

from importlib import import_module
from pathlib import Path

from bench.common import figure, section_ran, table, write_json

# bench.md order; prefill also renders the peers' TTFT table (one renderer for issue 13's two sections)
REPORTED = ("cache", "layouts", "kv_dtypes", "peers", "serving", "roofline", "weights", "prefix_cache", "kv_tiers",
            "prefill", "fleet", "mixed_load", "stream_gaps", "mla", "speculative", "spin", "structured", "families")
RESULT_KEYS = {"cache": "cache_speedup"}  # the name for the section's top-level key
PLOTS = ("cache.png", "layouts.png", "serving.png", "prefix_cache.png", "kv_tiers.png", "fleet.png",
         "mixed_load.png", "stream_gaps.png", "mla.png", "speculative.png", "roofline.png", "spin.png",
         "structured.png", "families.png")


def sections():
    return [import_module(f"bench.{name}") for name in REPORTED]


def targets(results: dict) -> list[dict]:
    return [row for module in sections() for row in module.targets(results)]


def markdown(results: dict) -> str:
    meta = results["meta"]
    params, machine = meta["params"], meta["machine"]
    lines = [f"# kvforge benchmarks ({'quick' if params['quick'] else 'full'} run)", "",
             f"Model `{Path(params['model']).name}` for speed, `{Path(params['quality_model']).name}` for quality; "
             f"{params['threads']} threads; {machine.get('cpu_model', '?')}, {machine['cpu_count']} cores; "
             f"load average (1/5/15 min) {', '.join(f'{x:.2f}' for x in machine['load_average_at_start'])} at start, "
             f"{', '.join(f'{x:.2f}' for x in machine['load_average_at_end'])} at the end (a load above the core "
             "count means other processes shared the CPU and slowed what was measured); "
             f"run took {meta['duration_s']:.0f} s. Every figure comes from `{meta['command']}`; "
             "the full data with units is in bench.json.", "", "## Targets", "",
             *table(["Target", "Required", "Measured", "Status", "By how much / why"],
                    [[t["target"], t["required"], t["measured"],
                      {True: "met", False: "**not met**", None: "not evaluated"}[t["met"]], t["detail"]]
                     for t in results["targets"]])]
    for module in sections():
        shown = module.markdown(results)
        if shown:
            lines += ["", *shown]
    failed = [f"- `{name}`: {results[RESULT_KEYS.get(name, name)].get('error', '')}" for name in REPORTED
              if results.get(RESULT_KEYS.get(name, name)) and not section_ran(results[RESULT_KEYS.get(name, name)])]
    if failed:
        lines += ["", "## Sections that failed or ran in part", "", *failed]
    lines += ["", "Plots: " + ", ".join(f"[{p}]({p})" for p in PLOTS), ""]
    return "\n".join(lines)


def write(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench.json", results)  # the measurements first: a failing report must not lose them
    results["targets"] = targets(results)
    plt = figure()
    for module in sections():
        if hasattr(module, "plot"):
            module.plot(plt, results, out)
    write_json(out / "bench.json", results)
    (out / "bench.md").write_text(markdown(results))
