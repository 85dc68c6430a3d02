"""Multi-head Latent Attention (DeepSeek-V2/V3, dense layers): tiny Hugging Face checkpoints with
random weights, exported with a latent cache, checked against transformers and served in process."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from kvforge.manifest import (Manifest, ManifestError, ModelSpec, io_tensors, kv_block_spec, kv_bytes_per_token,
                              kv_pairs)
from kvforge.onnx_graphs import all_nodes

VOCAB = 512
STEPS = 64  # greedy tokens checked per row
# Dims that all differ (r != dn != dv != dr != q_lora_rank) so a mixed-up split cannot pass.
COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4,  # = heads: transformers' eager attention repeats K/V by heads // kv heads
              vocab_size=VOCAB, max_position_embeddings=256, kv_lora_rank=32, qk_nope_head_dim=16,
              qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=2,  # >= layers: every layer dense
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.707,
            beta_fast=32, beta_slow=1)
VARIANTS = {
    # V3 as released: interleaved rope, a query LoRA, yarn with mscale_all_dim (softmax scale x mscale^2)
    "v3-interleave-qlora-yarn": ("v3", dict(rope_interleave=True, q_lora_rank=24, rope_scaling=YARN)),
    # V3 without interleave and with q_proj straight from the hidden state
    "v3-halves-noqlora": ("v3", dict(rope_interleave=False, q_lora_rank=None)),
    # V2: complex (pairwise) rope; attention biases on q_a/kv_a/o
    "v2-pairs-bias": ("v2", dict(q_lora_rank=24, attention_bias=True)),
    # MiniCPM3: DeepSeek's attention with half-split rope; embeddings x scale_emb (12), residual
    # branches x scale_depth / sqrt(layers), hidden / (hidden / dim_model_base) before the tied lm_head
    "minicpm3-scaled-tied": ("minicpm3", dict(q_lora_rank=24, dim_model_base=16)),
}


def hf_config(version: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config, MiniCPM3Config

    cls = {"v3": DeepseekV3Config, "v2": DeepseekV2Config, "minicpm3": MiniCPM3Config}[version]
    config = cls(**{**COMMON, **overrides})
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    return config


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A small byte-level BPE (VOCAB tokens) trained in well under a second."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from export.presets import SPECIAL_TOKENS, stdlib_corpus, write_tokenizer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(stdlib_corpus(64 << 10), trainer=trainer)
    directory = tmp_path_factory.mktemp("mla-tokenizer")
    write_tokenizer(tokenizer, directory)
    return directory


def save_checkpoint(directory, config, tokenizer_dir):
    """A Hugging Face checkpoint directory (safetensors) with random weights large enough that
    logits spread over a few units (the default 0.02 init makes near-ties of greedy tokens)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if p.dim() == 1 and "norm" in name else p.normal_(0.0, 0.1)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    root = tmp_path_factory.mktemp("mla-checkpoints")
    return {name: save_checkpoint(root / name, hf_config(version, **kw), tokenizer_dir)
            for name, (version, kw) in VARIANTS.items()}


@pytest.fixture(scope="module")
def mla_exports(tmp_path_factory, checkpoints):
    """mla_exports(variant, layout="inplace", dtype="fp32") -> export dir, made once."""
    from export.__main__ import export

    root = tmp_path_factory.mktemp("mla-exports")
    made = {}

    def make(variant, layout="inplace", dtype="fp32"):
        key = (variant, layout, dtype)
        if key not in made:
            out = root / f"{variant}-{layout}-{dtype}"
            export(str(checkpoints[variant]), out, layout, dtype, 160)
            made[key] = out
        return made[key]

    return make


# ---------------------------------------------------------------- the manifest contract


def test_manifest_fields_and_latent_tensors(mla_exports):
    directory = mla_exports("v3-interleave-qlora-yarn")
    manifest = Manifest.load(directory)
    spec = manifest.model
    assert (spec.attention, spec.kv_lora_rank, spec.q_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim,
            spec.v_head_dim) == ("mla", 32, 24, 16, 8, 12)
    assert spec.rope_interleave == "pairs-to-halves" and spec.rope_scaling["factor"] == 4.0
    assert (spec.num_kv_heads, spec.head_dim) == (1, 32 + 8)  # one latent "head" of r + dr, not config's head_dim
    assert manifest.kv_bytes_per_token == 2 * (32 + 8) * 4  # layers x (r + dr) x 4 bytes: no factor 2
    assert kv_pairs(spec, "fp32") == [("past_key_values.0.latent", "present.0.latent"),
                                      ("past_key_values.1.latent", "present.1.latent")]
    block = kv_block_spec(manifest)
    assert block.names == ("past_key_values.0.latent", "past_key_values.1.latent")
    assert block.block_shape("past_key_values.0.latent") == (1, 16, 40)
    assert block.bytes_per_block == 16 * manifest.kv_bytes_per_token
    data = json.loads((directory / "manifest.json").read_text())
    assert data["model"]["attention"] == "mla" and data["kv"]["bytes_per_token"] == 320
    assert Manifest.load(directory) == manifest  # round trip
    model = onnx.load(str(directory / "model.onnx"))
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert inputs["past_key_values.0.latent"] == ["batch", 1, "capacity", 40]
    nodes = list(all_nodes(model.graph))
    ops = [n.op_type for n in nodes]
    # per layer: one latent, an If on the chunk width and one on the decode span
    assert ops.count("TensorScatter") == 2 and ops.count("If") == 4
    assert ops.count("Attention") == 8  # per layer the chunk's two and the decode query's two, in the Ifs' branches


@pytest.mark.parametrize("variant,layout,dtype", [("v3-interleave-qlora-yarn", "inplace", "fp32"),
                                                  ("v3-interleave-qlora-yarn", "concat", "fp32"),
                                                  ("v3-interleave-qlora-yarn", "inplace", "int8"),
                                                  ("v3-interleave-qlora-yarn", "concat", "int8"),
                                                  ("v3-halves-noqlora", "inplace", "fp16")])
def test_every_latent_export_uses_standard_ops_only(mla_exports, variant, layout, dtype):
    """No contrib kernels in any layout or KV dtype: the graph runs on any ONNX runtime."""
    model = onnx.load(str(mla_exports(variant, layout, dtype) / "model.onnx"))
    nodes = list(all_nodes(model.graph))
    assert {"past_key_values.1.latent", "present.1.latent"} <= {t.name for t in [*model.graph.input, *model.graph.output]}
    assert {n.domain for n in nodes} <= {"", "ai.onnx"}
    assert all(o.domain in ("", "ai.onnx") for o in model.opset_import)


def test_absorbed_and_decompressed_steps_agree(mla_exports):
    """The If's condition is export.model.decompresses(spec, chunk width, the chunk's key span): a
    prompt prefilled in one wide step (its span is its width: decompressed) and in narrow chunks
    (after the first, each spans at least 16 positions: absorbed) gives the same logits at every
    position (and verify checks both paths against transformers)."""
    from export.model import decompresses
    from runtime.runners import open_runner

    directory = mla_exports("v2-pairs-bias")
    runner = open_runner(directory)
    wide, narrow, capacity = 48, 8, 64
    spec = runner.manifest.model
    assert decompresses(spec, wide, wide) and decompresses(spec, narrow, narrow)  # fresh prompts
    assert not any(decompresses(spec, narrow, start + narrow) for start in range(narrow, wide, narrow))
    assert not decompresses(spec, 1, capacity) and not decompresses(spec, 20, 1 << 20)  # decode; long context
    prompt = np.random.default_rng(4).integers(3, VOCAB, wide)[None]
    runner.allocate(1, capacity)
    one_step = runner.step(prompt, np.array([0]), np.array([wide]), logit_positions=None)[0]
    runner.allocate(1, capacity)
    chunks = [runner.step(prompt[:, i:i + narrow], np.array([i]), np.array([narrow]), logit_positions=None)[0]
              for i in range(0, wide, narrow)]
    np.testing.assert_allclose(one_step, np.concatenate(chunks), atol=1e-5, rtol=0)


def test_older_manifests_read_as_mha():
    """The MLA fields have defaults, so a Llama's model spec without them means MHA."""
    from export.presets import hf_config as preset_config

    spec = ModelSpec.from_hf_config(preset_config("tiny-llama"))
    old = {k: v for k, v in spec.__dict__.items() if k in list(ModelSpec.__dataclass_fields__)[:13]}
    assert ModelSpec(**old) == spec and spec.attention == "mha"
    assert kv_bytes_per_token(spec, "fp32") == 2 * 2 * 2 * 32 * 4


# ---------------------------------------------------------------- parity with transformers


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_inplace_export_matches_transformers(mla_exports, variant):
    """fp32: logits within 1e-4 of transformers at every prefill position of three rows of
    different lengths and at each of 64 greedy steps (each checked against a full recompute,
    so the greedy generations are identical)."""
    from export.verify import verify

    report = verify(mla_exports(variant), steps=STEPS)
    assert report.max_abs_diff <= 1e-4 and report.greedy_agreement == 1.0, report


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_concat_export_matches_transformers(mla_exports, variant):
    from export.verify import verify

    report = verify(mla_exports(variant, "concat"), steps=STEPS)
    assert report.max_abs_diff <= 1e-4 and report.greedy_agreement == 1.0, report


def test_fp16_latent_cache(mla_exports):
    from export.verify import verify

    directory = mla_exports("v3-halves-noqlora", dtype="fp16")
    assert Manifest.load(directory).kv_bytes_per_token == 2 * 40 * 2
    report = verify(directory, steps=16)
    assert report.passed and 0 < report.max_abs_diff <= 2e-2, report


INT8_LOGIT_BOUND = 0.1  # max abs logit difference of the int8 latent from fp32 transformers (measured 0.038)


@pytest.mark.parametrize("layout", ["inplace", "concat"])
def test_int8_latent_cache(mla_exports, checkpoints, layout):
    """int8 latent: one fp16 scale per token for c_kv and one for k_pe (latent_scale [B, 1, T, 2]),
    logits within INT8_LOGIT_BOUND of fp32 transformers (logits of these models span ~10 units);
    after a prefill the scales are each part's max |value| / 127 and the latent decodes to
    transformers' cache within half a quantization step."""
    import torch
    from transformers import AutoModelForCausalLM

    from export.verify import verify
    from runtime.runners import open_runner

    directory = mla_exports("v3-interleave-qlora-yarn", layout, "int8")
    manifest = Manifest.load(directory)
    assert manifest.kv_bytes_per_token == 2 * (40 + 2 * 2)  # layers x (r + dr int8 + two fp16 scales)
    assert kv_block_spec(manifest).names == ("past_key_values.0.latent", "past_key_values.0.latent_scale",
                                             "past_key_values.1.latent", "past_key_values.1.latent_scale")
    inputs = {t.name: t for t in manifest.io()[0]}
    assert inputs["past_key_values.1.latent"].dtype == "int8"
    assert (inputs["past_key_values.1.latent_scale"].dtype, inputs["past_key_values.1.latent_scale"].shape[1:]) == \
        ("float16", (1, "capacity" if layout == "inplace" else "past", 2))
    report = verify(directory, steps=STEPS)
    assert report.passed and report.max_abs_diff <= INT8_LOGIT_BOUND, report
    if layout == "concat":
        return
    prompt = np.random.default_rng(1).integers(3, VOCAB, 21)
    runner = open_runner(directory)
    runner.allocate(1, 64)
    runner.step(prompt[None], np.array([0]), np.array([len(prompt)]))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["v3-interleave-qlora-yarn"], dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor(prompt[None]), use_cache=True).past_key_values
    for i in range(2):  # each part of each token has its own max: an int8 value of +-127 in both
        latent = runner.kv_arrays[f"past_key_values.{i}.latent"][0, 0, :len(prompt)].astype(np.int32)
        assert (np.abs(latent[:, :32]).max(-1) == 127).all() and (np.abs(latent[:, 32:]).max(-1) == 127).all()
    # layer 0 sees the same input as transformers' (later layers see the int8 cache's effect)
    c_kv, k_pe = cache.layers[0].keys[0, 0].numpy(), cache.layers[0].values[0, 0].numpy()  # [T, r], [T, dr]
    scale = runner.kv_arrays["past_key_values.0.latent_scale"][0, 0, :len(prompt)].astype(np.float32)  # [T, 2]
    expected = np.stack([np.abs(c_kv).max(-1), np.abs(k_pe).max(-1)], axis=-1) / 127
    np.testing.assert_allclose(scale, expected, rtol=1e-3)  # fp16 storage: 11 significant bits
    assert (scale[:, 0] != scale[:, 1]).all()
    latent = runner.kv_arrays["past_key_values.0.latent"][0, 0, :len(prompt)].astype(np.float32)
    step = np.repeat(scale, [32, 8], axis=-1)  # each channel's quantization step
    assert (np.abs(latent * step - np.concatenate([c_kv, k_pe], -1)) <= 0.5 * step + 1e-6).all()


@pytest.mark.parametrize("variant,layout", [("v3-interleave-qlora-yarn", "inplace"), ("v2-pairs-bias", "inplace"),
                                            ("v3-interleave-qlora-yarn", "concat"), ("v2-pairs-bias", "concat")])
def test_latent_cache_equals_transformers_cache(mla_exports, checkpoints, variant, layout):
    """After a prefill the runner's latent is cat(keys, values) of transformers' cache, layer by
    layer (the int8 latent: test_int8_latent_cache)."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.runners import open_runner

    prompt = np.random.default_rng(1).integers(3, VOCAB, 21)
    runner = open_runner(mla_exports(variant, layout))
    runner.allocate(1, 64)
    runner.step(prompt[None], np.array([0]), np.array([len(prompt)]))
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[variant], dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor(prompt[None]), use_cache=True).past_key_values
    for i, layer in enumerate(cache.layers):
        expected = torch.cat([layer.keys, layer.values], dim=-1)[0].numpy()  # [1, T, r + dr]
        got = runner.kv_arrays[f"past_key_values.{i}.latent"][0, :, :len(prompt)]
        assert got.shape == expected.shape == (1, 21, 40)
        np.testing.assert_allclose(got, expected, atol=2e-5, rtol=0)
        assert not runner.kv_arrays[f"past_key_values.{i}.latent"][0, :, len(prompt):].any()


# ---------------------------------------------------------------- serving in process


def _prompts():
    rng = np.random.default_rng(2)
    return [rng.integers(3, VOCAB, n).tolist() for n in (37, 5, 19, 50)]


def test_continuous_batching_equals_solo(mla_exports):
    """Rows of an LLMEngine (chunked prefill, joins, leaves, moves, capacity buckets) generate
    what each prompt generates alone on the runner."""
    from runtime.greedy import greedy_tokens
    from runtime.llm_engine import LLMEngine, SamplingParams
    from runtime.runners import open_runner

    directory = mla_exports("v3-interleave-qlora-yarn")
    prompts, max_tokens = _prompts(), [30, 12, 24, 40]
    with LLMEngine(directory, slots=3, prefill_budget=32, threads=1) as engine:
        results = engine.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
        stats = engine.stats()
    assert stats["multi_row_steps"] > 5 and stats["max_rows"] == 3
    runner = open_runner(directory, threads=1)
    for prompt, n, result in zip(prompts, max_tokens, results):
        assert result.token_ids == greedy_tokens(runner, prompt, n, {2})  # 2: the EOS


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_prefix_cache_hit_equals_miss_disk_tier_and_swap(mla_exports, tmp_path, dtype, patient):
    """The block spec, the host pool, the disk tier and the copies are the ones of key/value
    caches: a hit (from RAM, or from disk after a restart) changes nothing, and a row swapped out
    and back decodes on as before; int8 blocks carry their latent_scale."""
    from runtime.kv.block_pool import HostBlockPool
    from runtime.kv.manager import KVManager
    from runtime.llm_engine import LLMEngine, SamplingParams
    from runtime.runners import open_runner
    from runtime.sequence import Sequence
    from tests.waiting import wait_written

    from kvforge.manifest import cache_namespace

    directory = mla_exports("v2-pairs-bias", dtype=dtype)
    document = np.random.default_rng(3).integers(3, VOCAB, 70).tolist()
    prompt = document + [7, 8, 9]
    params = SamplingParams(max_tokens=24)
    with LLMEngine(directory, prefix_cache=False, threads=1) as engine:
        expected = engine.generate([prompt], params)[0]
    with LLMEngine(directory, threads=1) as engine:
        cold = engine.generate([prompt], params)[0]
        warm = engine.generate([prompt], params)[0]
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 64)
    assert cold.token_ids == warm.token_ids == expected.token_ids
    runs = []
    for _ in range(2):  # the second engine starts with an empty RAM pool and reads the disk
        with LLMEngine(directory, threads=1, kv_disk_dir=tmp_path) as engine:
            runs.append(engine.generate([prompt], params)[0])
            if len(runs) == 1:  # all on disk before the close (whose drain is bounded in time)
                wait_written(engine, "disk", (len(prompt) + len(runs[0].token_ids) - 1) // 16)
            disk = engine.stats()["tiers"]["disk"]
    assert [r.cached_tokens for r in runs] == [0, 64]
    assert disk["hit_blocks"] == 4 and disk["read_bytes"] > 0
    assert all(r.token_ids == expected.token_ids for r in runs)

    runner = open_runner(directory, threads=1)
    pool = HostBlockPool(runner.block, 8 * runner.block.bytes_per_block)
    kv = KVManager(runner, slots=2, kv_cache_bytes=1 << 30, pool=pool, namespace=cache_namespace(runner.manifest))
    seq = Sequence(1, document, params, print, None, frozenset())
    kv.rows.fit_capacity(len(document) + 16)
    kv.rows.take_copies().run()  # the copies the engine runs at a step's start
    logits = runner.step(np.array([document]), np.array([0]), np.array([len(document)]))[0, -1]
    seq.num_cached = len(document)
    tokens = [int(logits.argmax())]
    blocks = kv.swap_out(seq, 0)
    kv.rows.take_copies().run()
    assert len(blocks) == 5 and pool.bytes_used == 5 * runner.block.bytes_per_block
    runner.step(np.array([prompt]), np.array([0]), np.array([len(prompt)]))  # clobbers row 0
    kv.swap_in(seq, 0, blocks)
    kv.rows.take_copies().run()
    for i in range(8):
        logits = runner.step(np.array([[tokens[-1]]]), np.array([len(document) + i]), np.array([1]))[0, 0]
        tokens.append(int(logits.argmax()))
    from runtime.greedy import greedy_tokens

    assert tokens == greedy_tokens(open_runner(directory, threads=1), document, 9)


def test_two_engines_share_latent_blocks_through_redis(mla_exports, patient):
    """A real redis-server: what one engine stored (int8 latent and its scales), a second engine
    with an empty RAM pool hits, with the output of a run without any cache."""
    from launcher.harness import free_ports
    from launcher.redis_server import RedisServer
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.waiting import wait_written

    directory = mla_exports("v2-pairs-bias", dtype="int8")
    prompt = np.random.default_rng(5).integers(3, VOCAB, 73).tolist()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    stored_blocks = (len(prompt) + params.max_tokens - 1) // 16  # the last token's KV is never computed
    with LLMEngine(directory, prefix_cache=False, threads=1) as engine:
        expected = engine.generate([prompt], params)[0]
    with RedisServer(free_ports(1)[0]) as server:
        with LLMEngine(directory, threads=1, kv_redis_url=server.url) as first:
            cold = first.generate([prompt], params)[0]
            wait_written(first, "redis", stored_blocks)
        with LLMEngine(directory, threads=1, kv_redis_url=server.url) as second:
            warm = second.generate([prompt], params)[0]
            redis = second.stats()["tiers"]["redis"]
    assert (cold.cached_tokens, warm.cached_tokens) == (0, 64)
    assert redis["hit_blocks"] == 4 and redis["errors"] == 0
    assert cold.token_ids == warm.token_ids == expected.token_ids


def test_inplace_latent_updates_the_bound_buffers_without_copies(mla_exports, capfd):
    """IOBinding aliases past and present latent buffers as for K/V: TensorScatter writes in place
    (ONNX Runtime logs when it has to copy; the control binds present elsewhere and sees the log)."""
    from tests.test_engines import _step_logging_inplace_warnings

    directory = mla_exports("v3-interleave-qlora-yarn")
    runner, pointers, log = _step_logging_inplace_warnings(directory, capfd, alias=True)
    assert runner.data_pointers() == pointers
    latent = runner.buffers["past_key_values.1.latent"]
    assert np.abs(latent[:, :, :60]).sum() > 0 and not latent[:, :, 60:].any()  # 20 steps x 3 tokens
    assert "in-place optimization not activated" not in log
    _, _, control = _step_logging_inplace_warnings(directory, capfd, alias=False)
    assert "in-place optimization not activated" in control


# ---------------------------------------------------------------- refusals and sizes


def _config_dict(version="v3", **overrides):
    config = hf_config(version, **overrides).to_dict()
    return config


def test_moe_layers_fp8_and_unmeasured_kv_dtypes(tmp_path, checkpoints):
    """MoE layers from first_k_dense_replace on (tests/test_deepseek_moe.py exports them); fp8 and
    the KV dtypes not measured on the latent are refused."""
    assert ModelSpec.from_hf_config(_config_dict(first_k_dense_replace=1)).sparse_layers == (1,)
    assert ModelSpec.from_hf_config({**_config_dict(first_k_dense_replace=1), "n_routed_experts": None}).attention == "mla"
    moe = ModelSpec.from_hf_config(_config_dict(first_k_dense_replace=0), cache_only=True)  # kv_size reads MoE configs
    assert kv_bytes_per_token(moe, "fp32") == 2 * 40 * 4
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                "original_max_position_embeddings": 128}
    with pytest.raises(ManifestError, match="unsupported rope scaling 'longrope' for MiniCPM3ForCausalLM.*MiniCPM3-4B"):
        ModelSpec.from_hf_config({**_config_dict("minicpm3"), "rope_parameters": longrope})
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ManifestError, match="quantization_config.*fp8"):
        ModelSpec.from_hf_config({**_config_dict(), "quantization_config": fp8})
    spec = ModelSpec.from_hf_config(_config_dict())
    for dtype in ("int8-static", "int4", "fp8"):
        with pytest.raises(ManifestError, match=f"KV dtype {dtype} is not available for MLA.*supports fp32, fp16, "
                                                "int8: the latent"):
            io_tensors(spec, "inplace", dtype)
    from tests.conftest import run_cli

    result = run_cli("export", "--model", str(checkpoints["v3-halves-noqlora"]), "--out", str(tmp_path / "o"),
                     "--kv-dtype", "int4")
    assert result.returncode == 2 and "not available for MLA" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


def test_tensorrt_is_refused_for_mla(mla_exports):
    from engines.__main__ import choose_backend

    directory = mla_exports("v3-halves-noqlora")
    manifest = Manifest.load(directory)
    with pytest.raises(ManifestError, match="TensorRT is not built for MLA"):
        choose_backend("tensorrt", manifest, directory)
    assert choose_backend("auto", manifest, directory) == "onnxruntime"


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "head_dim": 64, "intermediate_size": 18432,
               "vocab_size": 129280, "max_position_embeddings": 163840, "kv_lora_rank": 512, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
               "first_k_dense_replace": 3, "n_routed_experts": 256,
               "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}


def test_kv_size_shows_mla_beside_mha_and_gqa(tmp_path):
    """DeepSeek-V3's real dims (its MoE does not matter to the cache size: kv_size reads the
    attention only)."""
    from tests.conftest import run_cli

    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    result = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "4096", "--kv-dtype", "fp16",
                     "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["attention"]: row for row in json.loads(result.stdout)["rows"]}
    assert rows["mla"]["bytes_per_token"] == 61 * (512 + 64) * 2 == 70272
    assert rows["mha"]["bytes_per_token"] == 61 * 128 * (192 + 128) * 2  # the decompressed K and V
    assert rows["gqa-8"]["bytes_per_token"] == 2 * 61 * 8 * 128 * 2
    table = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "4096")
    assert table.returncode == 0, table.stderr
    assert "mla" in table.stdout and "gqa-8" in table.stdout and "int4" not in table.stdout
    int8 = run_cli("export.kv_size", "--model", str(tmp_path), "--context", "4096", "--kv-dtype", "int8", "--json")
    rows = {row["attention"]: row for row in json.loads(int8.stdout)["rows"]}
    assert rows["mla"]["bytes_per_token"] == 61 * (512 + 64 + 2 * 2)  # int8 latent and its two fp16 scales


# ---------------------------------------------------------------- through Triton


def test_streamed_through_triton_equals_in_process(mla_exports, tmp_path):
    """What `make build-engines MODEL=<dir>` and `make serve` run, on an int8-latent DeepSeek-V3
    export: `engines build` (its parity gate included), `engines repository`, the launcher with a
    real tritonserver and its OpenAI API; a streamed greedy answer through `llm` (tritonclient) and
    through the `openai` client equals LLMEngine's in process."""
    import openai

    from clients.api import LLMClient
    from launcher.harness import TritonServer, free_ports
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.conftest import run_cli

    engine_dir, repo = tmp_path / "engine", tmp_path / "model_repository"
    run_cli("engines", "build", str(mla_exports("v3-interleave-qlora-yarn", dtype="int8")), "--backend", "auto",
            "--out", str(engine_dir), check=True)
    run_cli("engines", "repository", str(engine_dir), "--repo", str(repo), check=True)
    prompt = "def fibonacci(n):"
    with LLMEngine(engine_dir) as engine:
        expected = engine.generate([prompt], SamplingParams(max_tokens=24))[0]
    # The server runs from this checkout (the harness's cwd), and so does its python stub: the
    # int8-latent manifest would not load with code older than this test.
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai_port) as server:
        deltas = list(LLMClient(server.grpc_url, "grpc").stream(prompt, max_tokens=24))
        client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
        chunks = client.completions.create(model="llm", prompt=prompt, max_tokens=24, temperature=0, stream=True)
        openai_text = "".join(chunk.choices[0].text for chunk in chunks)
    assert len(deltas) > 1  # streamed, one response per token
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert "".join(d.text for d in deltas) == openai_text == expected.text
