"""Bounded memory at any length (issue 41), at small scale on the tiny preset: the KV budget
sized to one full sequence, a request that can never fit refused with its numbers (in process and
through the served APIs), prompt chunks narrowed by the attention-scores budget, the step
model's bound, and the load-or-recompute deadline's quadratic term."""
from __future__ import annotations

import re

import numpy as np
import openai
import pytest

import kvforge.limits as limits
from clients.api import GenerationError, LLMClient
from kvforge.errors import RequestError
from kvforge.limits import Limits, prefill_chunk
from export.presets import hf_config
from kvforge.manifest import KV_BLOCK_TOKENS, Manifest, ModelSpec, kv_bytes_per_token
from runtime.llm_engine import LLMEngine, SamplingParams
from runtime.runners import open_runner
from runtime.scheduler import RecomputeCost
from runtime.scorer import Scorer
from tests.conftest import SERVING_CONTEXT

GREEDY = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def long_dir(exports):
    """The tiny preset at its whole context (2,048 tokens of 1 KiB of KV each)."""
    return exports(max_seq_len=SERVING_CONTEXT)


def long_prompt(tokens: int) -> list[int]:
    return [(i * 7919) % 4000 + 3 for i in range(tokens)]


def test_the_long_context_preset_has_a_1b_models_kv_per_token():
    spec = ModelSpec.from_hf_config(hf_config("long-llama"))
    assert spec.max_positions == 131072 and spec.rope_type == "llama3"
    assert kv_bytes_per_token(spec, "fp32") == 16 << 10


def test_prefill_chunk_keeps_the_scores_within_their_budget():
    budget = 64 << 20
    for cached in (0, 1000, 4096, 32768, 131072):
        for rows, heads in ((1, 8), (3, 32)):
            w = prefill_chunk(cached, rows, heads, budget)
            assert rows * w * (cached + w) * heads * 4 <= budget < rows * (w + 1) * (cached + w + 1) * heads * 4
    # the chunk narrows as the context grows, never below one token
    assert prefill_chunk(0, 1, 8, budget) > prefill_chunk(32768, 1, 8, budget) > prefill_chunk(131072, 1, 8, budget)
    assert prefill_chunk(1 << 30, 4, 64, 1) == 1


def test_the_budget_holds_one_full_sequence_by_default_and_is_refused_beyond_ram(long_dir, monkeypatch):
    manifest = Manifest.load(long_dir)
    full = manifest.max_seq_len * manifest.kv_bytes_per_token  # 2 MiB
    monkeypatch.setattr(limits, "DEFAULT_KV_CACHE_BYTES", full // 2)  # as a 1 GiB default is to a long model
    sized = Limits.from_manifest(manifest)
    assert (sized.kv_cache_bytes, sized.slots, sized.kv_reserved_bytes) == (full, 1, full)
    with pytest.raises(ValueError, match=re.escape(f"one {manifest.max_seq_len}-token sequence's KV, 2.0 MiB "
                                                   "(1024 bytes per token), exceeds 80% of the 2.0 MiB of RAM "
                                                   "available (a test's figure): set kv_cache_bytes lower "
                                                   "(--kv-cache-mib of `engines repository`, make KV_CACHE_MIB")):
        Limits.from_manifest(manifest, available=(full, "a test's figure"))
    with pytest.raises(ValueError, match="kv_cache_bytes 1.0 MiB exceeds 80% of the 1.0 MiB"):
        Limits.from_manifest(manifest, kv_cache_bytes=1 << 20, available=(1 << 20, "a test's figure"))
    # the prefix cache's host pool maps as much again ahead of use: 2 + 2 MiB pass 80% of 4 MiB, 2 alone do not
    room = (2 * full, "a test's figure")
    assert Limits.from_manifest(manifest, available=room).kv_reserved_bytes == full
    with pytest.raises(ValueError, match=re.escape("and as much of the host block pool mapped ahead (2.0 MiB) "
                                                   "together exceed 80% of the 4.0 MiB")):
        Limits.from_manifest(manifest, available=room, host_pool_bytes=1 << 30)
    with LLMEngine(long_dir, threads=1) as engine:  # a prompt of the whole context runs with default settings
        out, = engine.generate([long_prompt(SERVING_CONTEXT - 4)], GREEDY)
        assert out.prompt_tokens == SERVING_CONTEXT - 4 and len(out.token_ids) == 4
        assert engine.stats()["kv_cache_bytes"] == full


def test_a_request_that_can_never_fit_is_refused_with_its_numbers(long_dir):
    with LLMEngine(long_dir, threads=1, kv_cache_bytes=1 << 20) as engine:
        with pytest.raises(RequestError, match=re.escape(
                "needs 1280 KV tokens (the capacity bucket of its 1100-token prompt plus max_tokens 4) but the cache "
                "holds 1024 (kv_cache_bytes 1.0 MiB at 1024 bytes per token), so it could never run")):
            engine.submit(long_prompt(1100), GREEDY)
        assert len(engine.generate([long_prompt(900)], GREEDY)[0].token_ids) == 4


def test_prompt_chunks_narrow_as_the_context_grows(long_dir):
    """A 1,500-token prompt under a scores budget of 256 KiB: every step's chunk rows x width x
    keys x heads x 4 B stays within it, and the tokens are those of unbounded chunks."""
    heads = Manifest.load(long_dir).model.num_heads
    budget = 256 << 10
    with LLMEngine(long_dir, threads=1, prefix_cache=False) as reference:
        expected = reference.generate([long_prompt(1500)], GREEDY)[0].token_ids
    with LLMEngine(long_dir, threads=1, prefix_cache=False, attention_scores_bytes=budget) as engine:
        steps, step = [], engine.runner.step

        def recorded(input_ids, write_positions, num_new, *args):
            multi = num_new > 1
            if multi.any():
                steps.append((int(multi.nonzero()[0][-1]) + 1, input_ids.shape[1], int((write_positions + num_new)[multi].max())))
            return step(input_ids, write_positions, num_new, *args)

        engine.runner.step = recorded
        assert engine.generate([long_prompt(1500)], GREEDY)[0].token_ids == expected
    assert all(rows * width * keys * heads * 4 <= budget for rows, width, keys in steps)
    widths = [width for _, width, _ in steps]
    assert widths[0] > widths[-1] >= 2 and sum(widths) >= 1499


def test_the_step_model_scores_in_chunks_and_bounds_its_logits(long_dir, monkeypatch):
    runner = open_runner(long_dir)
    sequences = [np.array(long_prompt(300), np.int64), np.array(long_prompt(120)[::-1], np.int64)]
    scorer = Scorer(long_dir, max_rows=2, scores_bytes=256 << 10)  # chunks of tens of tokens
    for ids, logits in zip(sequences, scorer.score([scorer.check(ids[None]) for ids in sequences])):
        runner.allocate(1, runner.bucket_for(len(ids)))
        np.testing.assert_allclose(logits, runner.step(ids[None], np.array([0]), np.array([len(ids)]))[0], atol=1e-4)
    monkeypatch.setattr(limits, "SCORE_LOGITS_BYTES", 100 * 4096 * 4)
    bounded = Scorer(long_dir, max_rows=1)
    assert bounded.check(np.zeros((1, 100), np.int64)).shape == (100,)
    with pytest.raises(RequestError, match=re.escape("input_ids must hold 1..100 tokens, got 101 (the context is "
                                                     "2048 tokens; the logits of 100 tokens x 4096 vocabulary")):
        bounded.check(np.zeros((1, 101), np.int64))


def test_recompute_is_priced_with_its_quadratic_attention_term():
    cost = RecomputeCost()
    assert cost.seconds(0, 100) is None
    cost.measured(64, 64, 64 * 1e-3)  # one span measured: a flat rate, as before
    assert cost.seconds(0, 1000) == pytest.approx(1.0)
    cost, a, b = RecomputeCost(), 1e-3, 1e-7  # per token, and per token per key
    for keys in (512, 4096, 1024, 16384, 2048):
        cost.measured(256, keys, 256 * (a + b * keys))
    assert cost.coefficients() == pytest.approx((a, b))
    # 100K tokens: a linear rate fitted at 2K keys would say 100 s + 20 s; attention adds 500 s
    assert cost.seconds(0, 100_000) == pytest.approx(a * 100_000 + b * 100_000 ** 2 / 2)
    assert cost.seconds(90_000, 100_000) == pytest.approx(a * 10_000 + b * (100_000 ** 2 - 90_000 ** 2) / 2)


def test_a_server_refuses_a_request_that_can_never_fit_and_keeps_serving(long_dir, tmp_path):
    """Through Triton (gRPC) and the OpenAI API, on a server whose KV budget is 1 MiB (1,024
    tokens): a 1,173-token prompt is that request's error (400), and the server serves the next."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    repo = tmp_path / "repo"
    write_repository(long_dir, repo, slots=2, kv_cache_bytes=1 << 20)
    prompt = " ".join(f"w{i}" for i in range(400))  # 1,173 tokens
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai_port) as server:
        client = LLMClient(server.grpc_url, "grpc")
        with pytest.raises(GenerationError, match="so it could never run"):
            client.generate(prompt, max_tokens=4, stream=False)
        api = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="so it could never run"):
            api.completions.create(model="llm", prompt=prompt, max_tokens=4)
        assert len(client.generate("def f(x):", max_tokens=3).token_ids) == 3
        assert api.completions.create(model="llm", prompt="import os", max_tokens=2).usage.completion_tokens == 2


def test_the_tier_table_bench_serves_each_length_from_every_tier(long_dir, tmp_path):
    """bench.long_context --tiers on the tiny preset: every length's prompt answered the same cold,
    from RAM, after a restart with the disk tier and on a second engine with Redis. Whether a tier
    load beat its deadline depends on the machine's speed, so only RAM's hit is asserted."""
    from bench.long_context import tier_report, tier_table

    result = tier_table(long_dir, [256, 512], threads=1, scores_bytes=64 << 20)
    block = KV_BLOCK_TOKENS
    assert [r["tokens"] for r in result["rows"]] == [256, 512]
    for row in result["rows"]:
        assert row["same_text"], row
        assert row["ram_cached_tokens"] >= row["tokens"] - block, row
    tier_report(result, tmp_path / "tiers.json")
    assert (tmp_path / "tiers.png").stat().st_size > 0


def test_long_document_qa_answers_the_same_from_every_configuration(long_dir, patient, tmp_path):
    """bench.long_context --doc-qa on the tiny preset: 3 documents of 320 tokens, a host pool of
    2 (RAM alone must evict), 2 question rounds at concurrency 2. Every configuration's greedy
    tokens equal no caching's; RAM only evicted; the tiers run read documents back from a tier.
    `patient` pins the load deadline, so a tier hit does not depend on this machine's speed."""
    from bench.long_context import QA_CONFIGURATIONS, doc_qa, doc_qa_report

    result = doc_qa(long_dir, docs=3, doc_tokens=320, questions=2, concurrency=2, answer_tokens=3,
                    pool_documents=None, threads=1, scores_bytes=64 << 20)
    runs = result["configurations"]
    assert list(runs) == list(QA_CONFIGURATIONS) and result["correct"], runs
    assert result["pool_documents"] == 2 and result["kv_host_bytes"] < result["working_set_bytes"]
    for name, r in runs.items():
        assert (r["requests"], r["completed"], r["errors"]) == (6, 6, []), (name, r)
        assert r["same_tokens_as_no_caching"] and r["differing_requests"] == [], (name, r)
    assert runs["no caching"]["cached_tokens"] == 0
    assert runs["RAM only"]["ram_evicted_blocks"] > 0
    tiers = runs["tiers"]["hit_tokens"]
    assert tiers.keys() == {"ram", "disk", "redis"} and tiers["disk"] + tiers["redis"] > 0, tiers
    doc_qa_report(result, tmp_path / "doc_qa.json")
    assert (tmp_path / "doc_qa.png").stat().st_size > 0


def test_long_decode_reports_rate_bytes_and_kernels_per_kv_dtype(exports, long_dir, tmp_path):
    """bench.long_decode on the tiny preset, kvforge only: a point per context and KV dtype with
    the bytes its step reads (the context's KV in that dtype), one profiled step's kernel time by
    op, the table and the plot."""
    from bench.long_decode import kernel_split, kvforge_points, report

    dirs = {"fp32": long_dir, "int8": exports(dtype="int8", max_seq_len=SERVING_CONTEXT)}
    kvforge = {dtype: kvforge_points(directory, [256, 1024], threads=1) for dtype, directory in dirs.items()}
    for dtype, points in kvforge.items():
        per_token = Manifest.load(dirs[dtype]).kv_bytes_per_token
        assert [p["context"] for p in points] == [256, 1024]
        for p in points:
            assert p["kv_bytes_per_step"] == p["context"] * per_token, (dtype, p)
            assert p["weight_bytes_per_step"] > 0 and p["tokens_per_s"] > 0 and p["gb_per_s"] > 0
    assert kvforge["int8"][1]["kv_bytes_per_step"] < kvforge["fp32"][1]["kv_bytes_per_step"] / 3
    split = kernel_split(long_dir, 1024, threads=1)
    assert split["kernel_ms_per_step"] > 0 and "MatMul" in split["percent_by_op"]
    assert 0 < sum(split["percent_by_op"].values()) <= 100.5
    report({"model": "tiny-llama", "threads": 1, "kvforge": kvforge, "profile": [split]}, tmp_path / "decode.json")
    assert (tmp_path / "decode.png").stat().st_size > 0


def test_disaggregated_and_aggregated_while_a_long_prompt_prefills(long_dir, tmp_path):
    """bench.long_context --pd on the tiny preset: each configuration answers the long prompt
    while the stream decodes, the disaggregated one through its prefill worker, and the report
    has its table and plot."""
    from bench.long_context import PD_CONFIGURATIONS, pd_report, pd_run

    result = pd_run(long_dir, 1500, 64 << 20)
    runs = result["runs"]
    assert list(runs) == list(PD_CONFIGURATIONS)
    for name, r in runs.items():
        assert r["answered"] and r["ttft_s"] > 0 and r["gap_max_ms"] >= r["gap_p99_ms"] >= r["gap_p50_ms"] > 0, (name, r)
    assert (runs["aggregated"]["remote_prefills"], runs["disaggregated"]["remote_prefills"]) == (0, 1)
    pd_report(result, tmp_path / "pd.json")
    assert (tmp_path / "pd.png").stat().st_size > 0
