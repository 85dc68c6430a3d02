"""The families beyond Llama 2 / Mistral / Qwen2: Llama 3.x (llama3 RoPE), Qwen2 with YaRN, Qwen3
(q/k norms, linear RoPE) and SmolLM3 (NoPE layers), as tiny Hugging Face checkpoints with random
weights, exported in both layouts and run by the in-process engine against transformers'
generate(); Mistral's and Qwen2's sliding windows as transformers applies them, generating past
them; Gemma 2, Gemma 3 (text) and Phi-3 (fused projections, partial RoPE); Phi-3.5 and Phi-4-mini
LongRoPE (short/long factors per row, recomputed past the original length as generate() does,
kept across chunked prefill and in the prefix cache's hash chain); instruct checkpoints
with the public chat templates of Llama 3.1, Qwen3 and Gemma 3 (generation_config.json's stop ids,
chat_template.jinja, the prompt ids apply_chat_template makes, served through Triton); every
family served from one Triton server, one model each, one of them built by `make build-engines`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from kvforge.manifest import Manifest, ManifestError, ModelSpec
from tests.conftest import ROOT
from tests.families import (COMMON, EXPORT_CONTEXT, FAMILIES, INSTRUCT, NEW_TOKENS, ORIGINAL, PROMPT_TOKENS, TEMPLATES,
                            VOCAB, Chat, greedy_reference, hf_config)

LOGPROB_TOLERANCE = 2e-3
LONGROPE = ("phi3.5-longrope", "phi4-mini-longrope")
LONG_PROMPT = 40  # past ORIGINAL: the long factors from the prompt on
WINDOWED = ("mistral-window", "qwen2-window")
# Ring exports (sliding layers hold window + RING_CHUNK - 1 positions): a Gemma-3-shaped hybrid and
# a Mistral-shaped all-sliding model; the 28-token prompt prefills in 12 + 12 + 4 and generation
# runs to position 71, past each ring (34 and 32 cells) twice.
RING_CHUNK = 12
RINGED = ("gemma3", "mistral-window")
# A chat template in Llama 3.1's manner, using every helper transformers gives templates.
CHAT_TEMPLATE = """{{- bos_token }}
{%- set date = strftime_now("%d %b %Y") %}
{%- if tools is not none %}{{- "Tools: " + tools | tojson(indent=2) + "\\n" }}{% endif %}
{%- if documents %}{{- "Documents: " + documents | tojson + "\\n" }}{% endif %}
{%- for message in messages %}
    {%- if message.role not in ["system", "user", "assistant"] %}{{ raise_exception("unknown role " + message.role) }}{% endif %}
    {%- if message.role == "system" and not loop.first %}{% continue %}{% endif %}
    {{- "<|" + message.role + "|>" }}
    {%- if message.role == "assistant" %}{% generation %}{{ message.content | trim }}{% endgeneration %}
    {%- else %}{{ message.content | tojson }}{% endif %}
    {{- "\\n" }}
    {%- if loop.index == 5 %}{% break %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|assistant|>" + ("" if thinking is undefined else "think=" + thinking | string) }}{% endif %}"""


# ---------------------------------------------------------------- the config facts


def test_rope_frequencies_are_transformers_bits():
    """One implementation of every scaling (MLA's yarn included) gives transformers' inverse
    frequencies bit for bit and its cos/sin factor, from either config form."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from export.model import rope_frequencies

    for family in FAMILIES:
        config = hf_config(family)
        rope = config.rope_parameters
        if "rope_type" not in rope:  # Gemma 3's per layer type: test_gemma3_rope_from_both_config_forms
            continue
        spec = ModelSpec.from_hf_config(config.to_dict())
        assert spec.rope_type == rope["rope_type"]
        if rope["rope_type"] == "default":
            continue
        expected, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        got, got_factor = rope_frequencies(spec)
        assert got.dtype == expected.dtype and bool((got == expected).all()) and got_factor == factor
        if rope["rope_type"] == "longrope":  # the long factors: what transformers takes past the original length
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=ORIGINAL + 1)
            assert bool((rope_frequencies(spec, long=True)[0] == long).all()) and not bool((long == expected).all())
    # transformers 4's rope_scaling beside a rope_theta, and 5's rope_parameters holding it: the same spec
    old = {**hf_config("llama3.1").to_dict(), "rope_theta": 5e5}
    old["rope_scaling"] = {k: v for k, v in old.pop("rope_parameters").items() if k != "rope_theta"}
    new = hf_config("llama3.1").to_dict()
    new["rope_parameters"]["rope_theta"] = 5e5
    assert ModelSpec.from_hf_config(old) == ModelSpec.from_hf_config(new)
    assert ModelSpec.from_hf_config(new).rope_theta == 5e5
    yarn = ModelSpec.from_hf_config(hf_config("qwen2-yarn").to_dict())
    assert yarn.max_positions == 256 and yarn.rope_scaling["factor"] == 4.0  # max(256, 32 x 4)
    qwen25 = {**hf_config("qwen2-yarn").to_dict(), "max_position_embeddings": 32768,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert ModelSpec.from_hf_config(qwen25).max_positions == 131072  # what Qwen2.5's model card stretches to
    with pytest.raises(ManifestError, match="unsupported rope scaling 'longrope'.*Phi-3"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}})
    with pytest.raises(ManifestError, match="llama3 rope scaling needs low_freq_factor"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["LlamaForCausalLM"],
                                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}})


def _spec(prefix: str, **overrides) -> ModelSpec:
    return ModelSpec.from_hf_config({**COMMON, "architectures": [f"{prefix}ForCausalLM"], **overrides})


def test_sliding_windows_as_transformers_applies_them():
    """Qwen2/Qwen3 slide only with use_sliding_window, and only the layers from max_window_layers
    (or as layer_types says); Mistral slides every layer; a window caps nothing: the engine's
    max_seq_len goes past it (the mask applies it)."""
    for prefix in ("Qwen2", "Qwen3"):
        off = _spec(prefix, sliding_window=24, use_sliding_window=False, max_window_layers=0)
        assert (off.sliding_window, off.max_positions) == (None, 256)
        on = _spec(prefix, sliding_window=24, use_sliding_window=True, max_window_layers=1)
        assert (on.sliding_window, on.sliding_layers) == (24, (1,))
        beyond = _spec(prefix, sliding_window=24, use_sliding_window=True, max_window_layers=2)
        assert beyond.sliding_window is None  # max_window_layers >= layers: no layer slides
        typed = _spec(prefix, sliding_window=24, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention"])
        assert typed.sliding_layers == (0,)
    assert _spec("Mistral", sliding_window=24).sliding_layers == (0, 1)
    assert _spec("Mistral", sliding_window=None).sliding_window is None
    assert _spec("Llama", sliding_window=24).sliding_window is None  # Llama has no windows
    smol = _spec("SmolLM3", no_rope_layers=[1, 0], sliding_window=24, use_sliding_window=True)
    assert (smol.nope_layers, smol.sliding_layers) == ((1,), (1,))  # transformers slides its NoPE layers

    def manifest(spec, max_seq_len):
        return Manifest(model=spec, kv_layout="inplace", kv_dtype="fp32", max_seq_len=max_seq_len,
                        tokenizer={}, source={}, versions={})

    assert manifest(off, 256).max_seq_len == 256 and manifest(on, 256).max_seq_len == 256
    round_trip = manifest(_spec("Mistral", sliding_window=64), 64)
    assert Manifest(**{**round_trip.__dict__, "model": ModelSpec(**json.loads(json.dumps(
        round_trip.to_dict()["model"])))}) == round_trip  # tuples come back from the manifest's JSON lists


def test_later_families_stay_refused():
    with pytest.raises(ManifestError, match="longrope's long_factor has 7 entries; the 8 rotary frequencies"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["Phi3ForCausalLM"], "rope_scaling": {
            "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 7}})
    with pytest.raises(ManifestError, match="partial_rotary_factor .* Phi3ForCausalLM only"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5})
    with pytest.raises(ManifestError, match="Gemma3ForConditionalGeneration .*vision.*Gemma3ForCausalLM"):
        ModelSpec.from_hf_config({**COMMON, "architectures": ["Gemma3ForConditionalGeneration"]})


def test_every_supported_architecture_has_its_family_model():
    """export.model.FAMILIES names the model class of every architecture the manifest accepts."""
    from export.model import FAMILIES
    from kvforge.manifest import SUPPORTED_ARCHITECTURES

    assert sorted(FAMILIES) == sorted(SUPPORTED_ARCHITECTURES)


def test_gemma_config_facts():
    """Gemma 2 slides every other layer and Gemma 3 five of six unless layer_types says otherwise;
    Gemma 3's RoPE reads the same from 5.24's per-layer-type rope_parameters and from rope_theta /
    rope_scaling / rope_local_base_freq; another activation is refused."""
    gemma2 = _spec("Gemma2", num_hidden_layers=4, sliding_window=22)
    assert gemma2.sliding_layers == (0, 2) and gemma2.attention_softcap == 50.0 and gemma2.logit_softcap == 30.0
    assert gemma2.attention_scale == 256 ** -0.5 and gemma2.embedding_multiplier == 64 ** 0.5
    gemma3 = _spec("Gemma3", num_hidden_layers=7, sliding_window=23)
    assert gemma3.sliding_layers == (0, 1, 2, 3, 4, 6) and gemma3.qk_norm and gemma3.logit_softcap is None
    new = hf_config("gemma3").to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert ModelSpec.from_hf_config(old) == ModelSpec.from_hf_config(new)
    spec = ModelSpec.from_hf_config(new)
    assert (spec.rope_theta, spec.local_rope_theta, spec.rope_scaling) == (1e6, 1e4, {"rope_type": "linear",
                                                                                      "factor": 2.0})
    with pytest.raises(ManifestError, match="only the gelu_pytorch_tanh MLP"):
        _spec("Gemma2", hidden_activation="relu")


def test_windowed_checkpoints_differ_without_their_window(family_checkpoints, tmp_path):
    """The window changes what transformers generates here, so the parity tests below see it."""
    import torch
    from transformers import AutoModelForCausalLM

    for family in WINDOWED:
        directory, prompt, tokens = family_checkpoints[family][:3]
        unwindowed = shutil.copytree(directory, tmp_path / family)
        config = json.loads((unwindowed / "config.json").read_text())
        config.update(sliding_window=4096, use_sliding_window=False, layer_types=None)  # past every position
        (unwindowed / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        assert greedy_reference(AutoModelForCausalLM.from_pretrained(unwindowed).eval(), prompt)[0] != tokens


# ---------------------------------------------------------------- parity with transformers' generate()


def runner_greedy(directory, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy on the export's runner alone (LLMEngine batches in place only): tokens and log p."""
    from runtime.greedy import followed_logprobs
    from runtime.runners import open_runner

    tokens, (logprobs,) = followed_logprobs([open_runner(directory, threads=1)], prompt, NEW_TOKENS)
    return tokens, logprobs


@pytest.mark.parametrize("layout", ["inplace", "concat"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_generates_what_transformers_generates(family_exports, family_checkpoints, family, layout):
    """Greedy past original_max_position_embeddings, the prompt in one call, then decode: through
    LLMEngine (in place) or the runner (concat), the same tokens as transformers' generate() and
    log-probs within LOGPROB_TOLERANCE."""
    from runtime.llm_engine import LLMEngine, SamplingParams

    _, prompt, tokens, logprobs = family_checkpoints[family][:4]
    directory = family_exports(family, layout)
    if layout == "inplace":
        with LLMEngine(directory, threads=1, prefix_cache=False) as engine:
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
            result = engine.generate([prompt], params)[0]
        got = result.token_ids, result.logprobs
    else:
        got = runner_greedy(directory, prompt)
    assert got[0] == tokens
    assert len(set(tokens)) > 8  # not a degenerate loop
    assert max(abs(a - b) for a, b in zip(got[1], logprobs)) <= LOGPROB_TOLERANCE


@pytest.fixture(scope="module")
def longrope_long_prompts(family_checkpoints):
    """family -> a LONG_PROMPT-token prompt past the original length (the short prompt's 28 tokens
    lead), transformers' greedy tokens after it and their log-probs."""
    from transformers import AutoModelForCausalLM

    made = {}
    for family in LONGROPE:
        directory, prompt, tokens = family_checkpoints[family][:3]
        long_prompt = prompt + tokens[:LONG_PROMPT - PROMPT_TOKENS]
        made[family] = (long_prompt, *greedy_reference(AutoModelForCausalLM.from_pretrained(directory).eval(),
                                                       long_prompt))
    return made


@pytest.mark.parametrize("family", LONGROPE)
def test_longrope_long_prompt_chunked_and_cached(family_exports, family_checkpoints, longrope_long_prompts, family):
    """A prompt past the original length runs on longrope's long factors from its first chunk:
    in one call (the concat runner) and in chunks of 8 (the engine), transformers' generate()
    tokens and log-probs. The prefix cache's chain starts from the factor choice: blocks a short
    prompt stored never serve a long prompt with the same first tokens, its own blocks do, and
    the short prompt's still serve it."""
    from runtime.llm_engine import LLMEngine, SamplingParams

    prompt, tokens = family_checkpoints[family][1:3]
    long_prompt, expected, logprobs = longrope_long_prompts[family]
    assert runner_greedy(family_exports(family, "concat"), long_prompt)[0] == expected
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
    with LLMEngine(family_exports(family), threads=1, prefill_budget=8, solo_prefill_tokens=1) as engine:
        short = engine.generate([prompt], SamplingParams(max_tokens=1))[0]  # stores its first block, short factors
        assert short.token_ids == tokens[:1]
        first, again = (engine.generate([long_prompt], params)[0] for _ in range(2))
        short_again = engine.generate([prompt], SamplingParams(max_tokens=1))[0]
        chunks = engine.stats()["prefill_steps"]
        # one batch, each row on its own factors: the short prompt recomputed when it passes the
        # original length (its n-gram drafts never cross it on the short factors), the long one not
        drafting = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, speculative="ngram")
        together = engine.generate([prompt, long_prompt], drafting)
        recomputes = engine.stats()["longrope_recomputes"]
    assert [r.token_ids for r in together] == [tokens, expected] and recomputes == 1
    assert first.cached_tokens == 0 and first.token_ids == expected
    assert max(abs(a - b) for a, b in zip(first.logprobs, logprobs)) <= LOGPROB_TOLERANCE
    assert again.cached_tokens == 32 and again.token_ids == expected  # its own blocks, long factors
    assert short_again.cached_tokens == 16 and short_again.token_ids == tokens[:1]
    assert chunks >= LONG_PROMPT // 8


@pytest.mark.parametrize("layout", ["inplace", "concat"])
def test_longrope_verify_runs_past_the_switch(family_exports, layout):
    """export.verify adds a prompt past the original length and one that decodes past it, and the
    runner's recompute there keeps every logit within tolerance of transformers' recompute."""
    from export.verify import verify

    report = verify(family_exports("phi3.5-longrope", layout), steps=32)
    assert report.rows == 5 and report.passed, report


def test_concat_windows_count_positions_across_a_shorter_rows_gap(family_exports, family_checkpoints):
    """Concat rows step together, so a shorter prompt's row has padding columns between its prompt
    and its generated tokens: its window counts token positions (attention_mask's running count),
    not columns, and the row generates what it generates alone."""
    from runtime.greedy import Greedy
    from runtime.runners import open_runner

    prompt, tokens = family_checkpoints["mistral-window"][1:3]
    directory, short = family_exports("mistral-window", "concat"), prompt[:PROMPT_TOKENS - 9]
    run = Greedy(open_runner(directory, threads=1), [prompt, short], NEW_TOKENS)
    run.prefill(every_position=False)
    together = [run.next_tokens.tolist()]
    for _ in range(NEW_TOKENS - 1):
        run.step()
        together.append(run.next_tokens.tolist())
    assert [row[0] for row in together] == tokens
    assert [row[1] for row in together] == runner_greedy(directory, short)[0]


@pytest.mark.parametrize("layout", ["inplace", "concat"])
@pytest.mark.parametrize("family", RINGED)
def test_ring_cache_generates_what_transformers_generates(family_exports, family_checkpoints, family, layout):
    """Sliding layers holding only a ring of window + max_chunk - 1 positions: the manifest says so
    per tensor, the prompt (longer than the window) prefills in chunks of max_chunk and generation
    runs past every ring, with transformers' greedy tokens and log-probs within LOGPROB_TOLERANCE."""
    from runtime.llm_engine import LLMEngine, SamplingParams

    _, prompt, tokens, logprobs = family_checkpoints[family][:4]
    directory = family_exports(family, layout, RING_CHUNK)
    manifest = Manifest.load(directory)
    spec = manifest.model
    ring = max(spec.sliding_window, 16) + RING_CHUNK - 1
    assert manifest.max_chunk == RING_CHUNK and ring < PROMPT_TOKENS + NEW_TOKENS
    for t in manifest.cache_tensors:
        sliding = int(t.name.split(".")[1]) in spec.sliding_layers
        assert (t.window, t.tokens) == ((spec.sliding_window, ring) if sliding else (None, EXPORT_CONTEXT))
    listed = json.loads((directory / "manifest.json").read_text())["kv"]["tensors"]
    assert [(t["name"], t["tokens"], t["window"]) for t in listed] == [(t.name, t.tokens, t.window)
                                                                        for t in manifest.cache_tensors]
    if layout == "inplace":
        with LLMEngine(directory, threads=1, prefix_cache=False) as engine:
            params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)
            result = engine.generate([prompt], params)[0]
            assert engine.stats()["prefill_steps"] == 3  # 12 + 12 + 4: never a chunk past max_chunk
        got = result.token_ids, result.logprobs
    else:
        got = runner_greedy(directory, prompt)
    assert got[0] == tokens
    assert max(abs(a - b) for a, b in zip(got[1], logprobs)) <= LOGPROB_TOLERANCE


def test_ring_cache_holds_what_the_manifest_says(family_exports):
    """The engine's KV buffers are the manifest's arithmetic (rings whole at any capacity, global
    layers at the capacity), smaller than caching every position, and admission counts the same;
    a repeated prompt hits the prefix cache for more positions than a ring holds and generates what
    its first run (a miss) did; a row's blocks copied out and back in (a swap) leave every cell as
    it was; a step wider than max_chunk and TensorRT are refused, naming why."""
    import onnx

    from engines.__main__ import choose_backend
    from kvforge.manifest import cache_tensors, slot_bytes
    from kvforge.onnx_graphs import all_nodes
    from runtime.greedy import Greedy
    from runtime.llm_engine import LLMEngine, SamplingParams
    from runtime.runners import open_runner

    prompt = np.random.default_rng(1).integers(3, VOCAB, 61).tolist()  # 3 blocks hit (never the last token's)
    directory = family_exports("gemma3", "inplace", RING_CHUNK)
    manifest = Manifest.load(directory)
    full = cache_tensors(manifest.model, "fp32", manifest.max_seq_len)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLMEngine(directory, threads=1, slots=2) as engine:
        first = engine.generate([prompt], params)[0]
        again = engine.generate([prompt], params)[0]
        stats, runner = engine.stats(), engine.runner
        assert stats["kv_bytes_allocated"] == runner.slots * slot_bytes(manifest.cache_tensors, runner.capacity)
        assert stats["kv_bytes_allocated"] < runner.slots * slot_bytes(full, runner.capacity)
        assert {name: buf.shape[2] for name, buf in runner.kv_arrays.items()} == {
            t.name: t.held(runner.capacity) for t in manifest.cache_tensors}
        assert engine.limits.slots == 2
        assert stats["kv_bytes_held"] == runner.reservation.nbytes >= 2 * slot_bytes(manifest.cache_tensors,
                                                                                    manifest.max_seq_len)
    ring = next(t for t in manifest.cache_tensors if t.window is not None)
    runner = open_runner(directory, threads=1)
    run = Greedy(runner, [prompt], NEW_TOKENS)
    run.prefill(every_position=False)
    for _ in range(NEW_TOKENS - 1):
        run.step()
    before = {name: buf[0].copy() for name, buf in runner.kv_arrays.items()}
    blocks = runner.read_blocks(0, 0, -(-int(run.lengths[0]) // 16))
    for buf in runner.kv_arrays.values():
        buf[0] = 0
    runner.write_blocks(0, 0, blocks)
    assert all(np.array_equal(buf[0], before[name]) for name, buf in runner.kv_arrays.items())
    with pytest.raises(ValueError, match="exceeds the export's max_chunk 12"):
        runner.step(np.ones((1, RING_CHUNK + 1), np.int64), np.zeros(1, np.int64), np.array([RING_CHUNK + 1]))
    assert first.cached_tokens == 0 and again.cached_tokens == 48 > ring.tokens
    assert again.token_ids == first.token_ids and len(set(first.token_ids)) > 8
    modes = [next(a.s.decode() for a in n.attribute if a.name == "mode")
             for n in all_nodes(onnx.load(str(directory / "model.onnx")).graph) if n.op_type == "TensorScatter"]
    assert sorted(modes) == ["circular"] * 2 + ["linear"] * 2  # layer 1 slides: its key and value in a ring
    with pytest.raises(ManifestError, match="ring-cache export: TensorRT is not built"):
        choose_backend("tensorrt", manifest, directory)


def test_ring_cache_resizes_within_the_reservation(family_exports):
    """Rings live in the startup reservation too, whole at every capacity (below their cells as
    well): every layout holds what buffers made per layout hold, and the reservation is what the
    manifest's arithmetic says the largest layouts hold (the rings of every slot, the global
    layers' positions of the widest layout)."""
    from kvforge.manifest import slot_bytes
    from tests.test_runtime import resizes_keep_every_row

    directory = family_exports("gemma3", "inplace", RING_CHUNK)
    reserved = resizes_keep_every_row(directory, slots=8, capacity=64)  # capacities 16 (below a ring), 32, 64
    tensors = reserved.manifest.cache_tensors
    rings = [t for t in tensors if t.window is not None]
    assert rings and all(t.tokens > 16 for t in rings)
    budget = 8 * slot_bytes(tensors, 64)
    widest = max(s * c for s in range(1, 9) for c in range(1, EXPORT_CONTEXT + 1)
                 if s * slot_bytes(tensors, c) <= budget)
    assert reserved.kv_bytes_held == sum(t.bytes_per_token * (8 * t.tokens if t.window else widest) for t in tensors)


def test_ring_cache_rows_swap_out_and_back(family_exports):
    """Six Gemma-3-shaped ring sequences in a budget of two at their promised length: optimistic
    admission starts them all and swaps the youngest out to the host pool as they grow (ring
    cells and all) and back in; every sequence generates what it does when reserved up front."""
    from kvforge.manifest import slot_bytes
    from runtime.llm_engine import LLMEngine, SamplingParams

    directory = family_exports("gemma3", "inplace", RING_CHUNK)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, VOCAB, 40 + i).tolist() for i in range(6)]
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    options = dict(threads=1, slots=8, kv_cache_bytes=2 * slot_bytes(Manifest.load(directory).cache_tensors, 160))
    with LLMEngine(directory, admission="reserve", **options) as reserving:
        expected = [o.token_ids for o in reserving.generate(prompts, params)]
    with LLMEngine(directory, **options) as engine:
        got = [o.token_ids for o in engine.generate(prompts, params)]
        stats = engine.stats()
    assert got == expected and stats["preempted_swap"] > 0 and stats["preempted_recompute"] == 0, stats


def test_ring_cache_hands_prompts_over(family_exports, patient):
    """A prefill worker prefills Gemma-3-shaped ring prompts and hands their blocks over (as a
    prefix hit past the ring's 34 cells); the decode side generates what it does alone."""
    from runtime.disaggregation import Disaggregation
    from runtime.llm_engine import LLMEngine, SamplingParams
    from tests.waiting import wait_for

    directory = family_exports("gemma3", "inplace", RING_CHUNK)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, VOCAB, n).tolist() for n in (61, 50)]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLMEngine(directory, threads=1, prefix_cache=False) as alone:
        expected = [o.token_ids for o in alone.generate(prompts, params)]
    with LLMEngine(directory, threads=1, disaggregation=Disaggregation(threads=1, threshold_tokens=0)) as engine:
        wait_for(lambda: engine.pd.up, "the prefill worker to start", 120.0)
        outputs = engine.generate(prompts, params)
        stats = engine.stats()
    assert [o.token_ids for o in outputs] == expected
    assert [o.cached_tokens for o in outputs] == [48, 48] and stats["pd_handoffs"] == 2, stats


def test_qwen3_norms_stay_standard_ops(family_exports):
    """q/k norms are RMSNormalization nodes (two per layer beside the two layer norms and the
    final one), never ORT's CUDA-only fused q/k norm; SmolLM3's NoPE layer has no RotaryEmbedding."""
    import onnx

    from kvforge.onnx_graphs import all_nodes

    qwen3 = [n for n in all_nodes(onnx.load(str(family_exports("qwen3-linear") / "model.onnx")).graph)]
    assert [n.op_type for n in qwen3].count("RMSNormalization") == 2 * 4 + 1
    assert {n.domain for n in qwen3} <= {"", "ai.onnx"}
    smol = [n.op_type for n in all_nodes(onnx.load(str(family_exports("smollm3") / "model.onnx")).graph)]
    assert smol.count("RotaryEmbedding") == 2  # layer 0's query and key


def test_gemma_and_phi3_graphs_stay_standard_ops(family_exports):
    """Gemma's (1 + weight) norms stay one RMSNormalization each (four per layer, Gemma 3's q/k norms
    beside them), its GLU one Gelu per layer, its attention softcap Attention's own attribute at opset
    24; Phi-3's partial RoPE is RotaryEmbedding's rotary_embedding_dim."""
    import onnx

    from kvforge.onnx_graphs import all_nodes

    def graph(family):
        model = onnx.load(str(family_exports(family) / "model.onnx"))
        nodes = list(all_nodes(model.graph))
        assert {n.domain for n in nodes} <= {"", "ai.onnx"} and model.opset_import[0].version == 24
        return nodes

    gemma2, gemma3 = graph("gemma2"), graph("gemma3")
    assert [n.op_type for n in gemma2].count("RMSNormalization") == 4 * 2 + 1
    assert [n.op_type for n in gemma3].count("RMSNormalization") == (4 + 2) * 2 + 1
    assert [n.op_type for n in gemma2].count("Gelu") == 2
    attentions = [n for n in gemma2 if n.op_type == "Attention"]
    assert attentions and all(any(a.name == "softcap" and a.f == 2.0 for a in n.attribute) for n in attentions)
    ropes = [n for n in graph("phi3") if n.op_type == "RotaryEmbedding"]
    assert ropes and all(any(a.name == "rotary_embedding_dim" and a.i == 8 for a in n.attribute) for n in ropes)


def test_longrope_graph_input_and_tensorrt_profile(family_exports):
    """One Where per graph picks each token's frequencies; prompt_lengths is an input of longrope
    exports only, packed per token in place; the TensorRT profile covers it as the packed inputs
    and the offline op check finds nothing TensorRT would reject (no TensorRT runs here)."""
    import onnx

    from engines import trt_ops
    from engines.tensorrt_build import profile_shapes
    from kvforge.onnx_graphs import all_nodes

    directory = family_exports("phi4-mini-longrope")
    nodes = [n.op_type for n in all_nodes(onnx.load(str(directory / "model.onnx")).graph)]
    assert nodes.count("Where") == 1 and trt_ops.unsupported_ops(directory / "model.onnx") == []
    manifest = Manifest.load(directory)
    inputs = {t.name: t.shape for t in manifest.io()[0]}
    assert inputs["prompt_lengths"] == ("tokens",)
    assert "prompt_lengths" not in {t.name for t in Manifest.load(family_exports("phi3")).io()[0]}
    shapes = profile_shapes(manifest, max_slots=4, max_new_tokens=16)
    assert shapes["prompt_lengths"] == shapes["input_ids"]


def test_shards_are_read_through_the_index(family_checkpoints):
    """The llama3.1 checkpoint's zeroed consolidated.safetensors is not read (the parity test would fail)."""
    from export.checkpoint import weight_files

    directory = family_checkpoints["llama3.1"][0]
    files = weight_files(directory)
    assert len(files) > 1 and "consolidated.safetensors" not in {f.name for f in files}


# ---------------------------------------------------------------- instruct checkpoints


@pytest.mark.parametrize("family", list(INSTRUCT))
def test_generation_config_eos_ids_stop_generation(family_exports, family_checkpoints, family):
    """The export carries the public template and generation_config.json; its turn end stops the chat."""
    from runtime.llm_engine import LLMEngine, SamplingParams

    directory, chat = family_exports(family), family_checkpoints[family].chat
    manifest = Manifest.load(directory)
    assert manifest.tokenizer["eos_token_ids"] == [2, chat.turn_end]
    assert {"generation_config.json", "chat_template.jinja"} <= set(manifest.tokenizer["files"])
    assert (directory / "chat_template.jinja").read_text() == (TEMPLATES / INSTRUCT[family][0]).read_text()
    with LLMEngine(directory, threads=1) as engine:
        result = engine.generate([chat.ids], SamplingParams(max_tokens=NEW_TOKENS))[0]
    assert result.token_ids == chat.answer and result.finish_reason == "stop"


MESSAGES = [{"role": "system", "content": "Be brief. <&>'\u00e9"}, {"role": "user", "content": "def f(x):"},
            {"role": "assistant", "content": " return x "}, {"role": "system", "content": "skipped"},
            {"role": "user", "content": "and g?"}, {"role": "user", "content": "after the break"}]
TOOLS = [{"type": "function", "function": {"name": "z_last", "parameters": {"b": 1, "a": "<é>"}}}]


@pytest.fixture(scope="module")
def helper_template_dir(family_tokenizer_dir, tmp_path_factory):
    """The families' tokenizer with CHAT_TEMPLATE as chat_template.jinja, over the template
    tokenizer_config.json holds."""
    directory = tmp_path_factory.mktemp("helper-template")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(family_tokenizer_dir / name, directory / name)
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return directory


def test_chat_template_renders_as_transformers_with_hf_helpers(helper_template_dir):
    """chat_template.jinja (over tokenizer_config's template) with strftime_now, tojson (keys in
    order, no HTML escaping, non-ASCII kept, indent), loopcontrols, {% generation %},
    raise_exception, tools, documents and extra kwargs: the same text as apply_chat_template."""
    from transformers import AutoTokenizer

    from frontend.chat_template import ChatTemplate, ChatTemplateError

    template = ChatTemplate(helper_template_dir)
    hf = AutoTokenizer.from_pretrained(helper_template_dir)
    documents = [{"title": "t", "text": "x > y"}]
    for kwargs in ({}, {"tools": TOOLS, "documents": documents, "thinking": False}):
        text = template.render(MESSAGES, **kwargs)
        assert text == hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    assert '"z_last"' in text and text.index('"b"') < text.index('"a"') and "<é>" in text and "\\u" not in text
    assert '"x > y"' in text and text.endswith("<|assistant|>think=False")
    assert "skipped" not in text and "after the break" not in text
    assert '"Be brief. <&>\'\u00e9"' in text and "<|assistant|>return x\n" in text
    assert template.render(MESSAGES[:1], add_generation_prompt=False) == '<s><|system|>"Be brief. <&>\'\u00e9"\n'
    with pytest.raises(ChatTemplateError, match="refused the messages: unknown role tool"):
        template.render([{"role": "tool", "content": "x"}])


@pytest.mark.parametrize("family", list(INSTRUCT))
def test_chat_prompt_ids_are_apply_chat_templates(family_exports, family_checkpoints, family, tmp_path):
    """The ids the front sends the engine for a chat, and those the router hashes, are
    apply_chat_template(tokenize=True)'s, though the tokenizer's post-processor puts <s> before
    every text: one BOS where the template writes it (Llama 3.1, Gemma 3), none where it does not
    (Qwen3). A text sent as such (a completion) gets the post-processor's BOS, and keeps a rendered
    chat's own instead of doubling it."""
    from engines.repository import write_repository
    from frontend.openai_api import ChatRequest, render_chat
    from frontend.router.prompts import Prompts

    directory, chat = family_exports(family), family_checkpoints[family].chat
    body = {"model": "llm", **INSTRUCT[family][1]}
    write_repository(directory, tmp_path)
    prompts = Prompts(tmp_path)
    front = prompts.openai
    assert front.chat_prompt(ChatRequest.model_validate(body)) == chat.ids
    assert prompts.of_openai("/v1/chat/completions", json.dumps(body).encode())[0][0].ids == chat.ids
    writes_bos = family != "qwen3-linear"
    assert chat.ids.count(1) == int(writes_bos) and (chat.ids[0] == 1) == writes_bos
    rendered = render_chat(front.chat_template, ChatRequest.model_validate(body))
    assert front.tokenizer.encode(rendered) == (chat.ids if writes_bos else [1] + chat.ids)
    assert front.tokenizer.encode("def f") == [1] + front.tokenizer.encode("def f", add_special_tokens=False)


# ---------------------------------------------------------------- through Triton


def chat_served(server, directory: Path, family: str, chat: Chat) -> None:
    """Through the front's OpenAI API, with the official client: the chat's prompt is the one
    apply_chat_template makes (its token count), and the answer transformers' greedy one, ended by
    generation_config.json's turn end."""
    import openai

    from runtime.tokenizer import Tokenizer

    body = INSTRUCT[family][1]
    client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0)
    answer = client.chat.completions.create(model="llm", messages=body["messages"], max_tokens=NEW_TOKENS,
                                            temperature=0, extra_body={k: v for k, v in body.items() if k != "messages"})
    assert answer.usage.prompt_tokens == len(chat.ids)
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == len(chat.answer)
    assert answer.choices[0].message.content == Tokenizer(directory, Manifest.load(directory)).decode(chat.answer)


# The instruct family whose engine `make build-engines MODEL=<its checkpoint>` builds as the
# families' server's `llm` (the OpenAI API's model); every family's export is a model of its own
# name there, the RINGED exports as "<family>-ring".
MADE_BY_MAKE = "gemma3"
RING_MODELS = {f"{family}-ring": family for family in RINGED}


@pytest.fixture(scope="module")
def families_server(family_checkpoints, family_exports, tmp_path_factory):
    """One launcher (tritonserver, the front, the OpenAI API) for every family: `llm` built by `make
    build-engines MODEL=<the MADE_BY_MAKE checkpoint> REPO=<repository>` (export, engine build and its
    parity gate, the repository), then each family's in-place export added as a model of its name
    (what `python -m engines repository EXPORT --repo REPO --name FAMILY` writes), two KV slots each;
    a name that would replace llm's companions is refused."""
    import subprocess

    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    work = tmp_path_factory.mktemp("families-served")
    repo = work / "model_repository"
    made = subprocess.run(["make", "build-engines", f"MODEL={family_checkpoints[MADE_BY_MAKE].directory}",
                           f"EXPORT_DIR={work / 'export'}", f"REPO={repo}", f"MAX_SEQ_LEN={EXPORT_CONTEXT}", "SLOTS=2"],
                          cwd=ROOT, capture_output=True, text=True)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-3000:]
    assert Manifest.load(repo / "llm" / "1" / "engine").engine["backend"] == "onnxruntime"
    exports = {**{family: family_exports(family) for family in FAMILIES},
               **{name: family_exports(family, "inplace", RING_CHUNK) for name, family in RING_MODELS.items()}}
    for name, directory in exports.items():
        assert write_repository(directory, repo, name=name, slots=2) == [name]
    with pytest.raises(ValueError, match="other than step, ensemble"):
        write_repository(exports["gemma2"], repo, name="step")
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai_port) as server:
        yield server


def served_greedy(server, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """NEW_TOKENS greedy tokens after the prompt (sent as ids) and their log-probs, from `model`
    over the front's /v2/models/MODEL/generate."""
    import httpx

    answer = httpx.post(f"http://{server.http_url}/v2/models/{model}/generate", timeout=300, json={
        "input_ids": prompt, "input_lengths": len(prompt), "max_tokens": NEW_TOKENS, "ignore_eos": True,
        "return_log_probs": True})
    assert answer.status_code == 200, answer.text
    return answer.json()["output_ids"], answer.json()["output_log_probs"]


@pytest.mark.parametrize("model", [*FAMILIES, *RING_MODELS])
def test_served_family_generates_what_transformers_generates(families_server, family_checkpoints, model):
    """Every family through Triton (its own model in one server), the ring exports too: the prompt
    in one call, generation past every window and LongRoPE's original length, transformers' greedy
    tokens and log-probs within LOGPROB_TOLERANCE."""
    _, prompt, tokens, logprobs = family_checkpoints[RING_MODELS.get(model, model)][:4]
    got, got_logprobs = served_greedy(families_server, model, prompt)
    assert got == tokens
    assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) <= LOGPROB_TOLERANCE


@pytest.mark.parametrize("family", LONGROPE)
def test_served_longrope_long_prompt(families_server, longrope_long_prompts, family):
    """A prompt past the original length, served: the long factors from the prompt on, as
    transformers' generate(), though the served engine's prefix cache holds the blocks of the short
    prompt it starts with (the parity test above served that one, whose generation passes the
    original length)."""
    long_prompt, tokens, logprobs = longrope_long_prompts[family]
    got, got_logprobs = served_greedy(families_server, family, long_prompt)
    assert got == tokens
    assert max(abs(a - b) for a, b in zip(got_logprobs, logprobs, strict=True)) <= LOGPROB_TOLERANCE


def test_make_built_engine_serves_the_chat(families_server, family_checkpoints):
    """The engine `make build-engines MODEL=<checkpoint>` built, served as `llm`: the OpenAI chat
    with the family's public template (chat_served)."""
    directory = Path(families_server.repo) / "llm" / "1" / "engine"
    chat_served(families_server, directory, MADE_BY_MAKE, family_checkpoints[MADE_BY_MAKE].chat)


@pytest.mark.parametrize("family", [family for family in INSTRUCT if family != MADE_BY_MAKE])
def test_served_chat_with_the_public_template(family_exports, family_checkpoints, family, tmp_path):
    """The other instruct families, each its own server (the OpenAI API serves one model, `llm`):
    the chat with the public template (chat_served)."""
    from engines.repository import write_repository
    from launcher.harness import TritonServer, free_ports

    directory = family_exports(family)
    write_repository(directory, tmp_path, slots=2)
    http, grpc, metrics, openai_port = free_ports(4)
    with TritonServer(tmp_path, http_port=http, grpc_port=grpc, metrics_port=metrics, openai_port=openai_port) as server:
        chat_served(server, directory, family, family_checkpoints[family].chat)
