"""`python -m bench --quick --sections mla` end to end: the section runs and its results have the
structure bench.md and readers rely on. Never speed: numbers on a shared machine say nothing
about correctness."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli
from tests.test_bench import png_ok

pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def mla_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-mla")
    result = run_cli("bench", "--quick", "--sections", "mla", "--out", str(out),
                     "--work", str(tmp_path_factory.mktemp("bench-mla-work")), timeout=1100)
    assert (out / "bench.json").is_file(), result.stderr[-4000:]
    return out, json.loads((out / "bench.json").read_text()), result


def test_mla_section(mla_run):
    out, results, run = mla_run
    section = results["mla"]
    assert section["status"] == "ok" and run.returncode == 0, (section.get("error"), run.stderr[-3000:])
    shape = section["shape"]
    # bytes: the runners' own buffers agree with the manifest; MHA and GQA hold more per token than the latent
    rows = {(r["model"], r["kv_dtype"]): r for r in section["accounting"]}
    assert set(rows) == {("mla", "fp16"), ("mla", "int8"), (f"mha-{shape['gqa_heads']}", "fp16"),
                         (f"gqa-{shape['gqa_kv_heads']}", "fp16")}
    for r in rows.values():
        assert r["bytes_per_token"] == r["manifest_bytes_per_token"] > 0
        assert 0 < r["sequences_admitted"] <= r["sequences_by_bytes"]
    mla = rows[("mla", "fp16")]
    assert mla["bytes_per_token"] == 2 * (shape["kv_lora_rank"] + shape["qk_rope_head_dim"])  # one layer
    assert rows[("mla", "int8")]["bytes_per_token"] == shape["kv_lora_rank"] + shape["qk_rope_head_dim"] + 4
    assert all(r["x_mla_fp16"] > 1 for (model, _), r in rows.items() if model != "mla")
    # prefill: every (past, width) with both paths; decode: every context
    assert [(r["past"], r["width"]) for r in section["prefill"]] == [
        (p, w) for p in shape["prefill_pasts"] for w in shape["prefill_widths"]]
    for r in section["prefill"]:
        assert r["absorbed"]["median_ms"] > 0 and r["decompressed"]["median_ms"] > 0 and r["decompressed_speedup"] > 0
    assert [r["context"] for r in section["decode"]] == list(shape["decode_contexts"])
    assert all(r[p]["tokens_per_s"] > 0 for r in section["decode"] for p in ("absorbed", "decompressed"))
    assert section["long_context_crossover"] > 0
    assert {r["if_picks"] for r in section["prefill"]} <= {"absorbed", "decompressed"}
    # quality (on the seeded model in a quick run): fp32 is the reference
    dtypes = section["quality"]["dtypes"]
    assert [d["kv_dtype"] for d in dtypes] == ["fp32", "fp16", "int8"]
    assert all(d["perplexity"] > 1 for d in dtypes) and "perplexity_vs_fp32_percent" in dtypes[2]
    assert isinstance(section["units"], dict) and section["units"]
    # report: its targets (the quick run does not judge int8 quality on a few training steps), bench.md, the plot
    targets = {t["target"]: t for t in results["targets"] if t["target"].startswith("MLA")}
    assert len(targets) == 2
    size = next(t for name, t in targets.items() if "smaller" in name)
    assert isinstance(size["met"], bool) and size["measured"] not in ("", "-")
    assert next(t for name, t in targets.items() if "int8" in name)["met"] is None
    md = (out / "bench.md").read_text()
    assert "## MLA" in md and "decompressed speedup" in md
    assert png_ok((out / "mla.png").read_bytes())
