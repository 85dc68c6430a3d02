"""Section structured (issue 42): what constrained decoding costs and what jump-forward buys.

- The whole decode step with a JSON schema's mask vs without, at batch 1 and 16, on a model with
  a >= 128K vocabulary: the small-llama preset with its byte-level BPE grown to BIG_VOCAB tokens
  (big_vocab_checkpoint; random weights: the mask's cost does not depend on what the model learned). A step is the gap between one row's outputs
  while every row of the batch decodes (scheduling, the runner, the mask, sampling, outputs).
- Grammar compile time: llguidance's tokenizer (once per engine), a schema compiled cold, and a
  cached one (a copy of the compiled matcher).
- Jump-forward: generated tokens/s (wall time of the whole request, prefill included) of a schema
  with long fixed keys, forcing off and on taking turns, greedy, and whether the tokens are the same.
- On the trained default model (models/stdlib-llama): of the outputs that end with "stop", the
  share that parse and validate against the schema, constrained vs unconstrained on the same
  prompts (both stop at a line end).
--quick runs all of it on the trained model (its 4,096-token vocabulary: the step's share of the
mask is then not the target's) at batch 1 and 4 with a few tokens: ~30 s.
"""
from __future__ import annotations

import json
import statistics
import threading
import time
from pathlib import Path

from bench.common import (TRAINED_MODEL, Artifacts, Params, finish_figure, rendered, say, section_ran,
                          skipped, summary_ms, table, target)

BIG_VOCAB = 131_072  # Llama 3's is 128,256
BIG_SHAPE = "small-llama"  # the preset whose shape the big-vocabulary model has
MASK_SHARE_TARGET = 0.10
# rows of objects with a free string: the mask is computed in string and number states alike, and
# at least `min_items` items keep the grammar from ending before max_tokens
STEP_ITEM = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
             "required": ["name", "count"], "additionalProperties": False}
# long keys, all required in order: the grammar forces `, "key": ` between the values
FIXED_KEYS = {"type": "object", "additionalProperties": False,
              "properties": {"identification_number": {"type": "integer", "minimum": 0, "maximum": 999},
                             "classification_category": {"enum": ["alpha_leaf", "beta_node", "gamma_root"]},
                             "is_currently_available_for_use": {"type": "boolean"},
                             "human_readable_description": {"type": "string", "maxLength": 24},
                             "number_of_dependent_records": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["identification_number", "classification_category", "is_currently_available_for_use",
                           "human_readable_description", "number_of_dependent_records"]}
QUALITY_SCHEMA = {"type": "object", "additionalProperties": False,
                  "properties": {"name": {"type": "string", "maxLength": 32}, "value": {"type": "integer"},
                                 "enabled": {"type": "boolean"}},
                  "required": ["name", "value", "enabled"]}
QUALITY_NAMES = ("settings", "config", "record", "defaults", "options", "entry", "params", "state", "metadata",
                 "payload", "spec", "info")


def shape(quick: bool) -> dict:
    if quick:
        return dict(big_vocab=False, batches=(1, 4), step_tokens=12, step_rounds=2, compile_rounds=2,
                    forced_rounds=1, forced_batches=(1,), quality_prompts=4, quality_tokens=48)
    return dict(big_vocab=True, batches=(1, 16), step_tokens=48, step_rounds=4, compile_rounds=5, forced_rounds=3,
                forced_batches=(1, 16), quality_prompts=2 * len(QUALITY_NAMES), quality_tokens=64)


def big_vocab_checkpoint(artifacts: Artifacts) -> Path:
    """The BIG_SHAPE preset with its vocabulary grown to BIG_VOCAB tokens, random weights; made once.
    The preset's trained BPE (8,192 tokens of Python) gets merges of two of its tokens (in id
    order, the second not starting a word) until BIG_VOCAB: a real BPE whose tokens are byte
    strings like a trained one's, so llguidance's token trie and masks cost what a real 128K
    vocabulary's do (no standard-library corpus here has enough distinct words to train one)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from export.presets import hf_config, random_weights, write_tokenizer
    from kvforge.cli import atomic_directory
    from kvforge.manifest import ModelSpec

    directory = artifacts.root / "checkpoints" / f"{BIG_SHAPE}-{BIG_VOCAB // 1024}k"
    if (directory / "model.safetensors").is_file():
        return directory
    say(f"structured: making {directory.name} (a {BIG_VOCAB}-token vocabulary, random weights)")
    tokenizer = json.loads((artifacts.checkpoint(BIG_SHAPE) / "tokenizer.json").read_text())
    vocab, merges = tokenizer["model"]["vocab"], tokenizer["model"]["merges"]
    specials = {t["content"] for t in tokenizer["added_tokens"]}
    pieces = [t for t in sorted(vocab, key=vocab.get) if t not in specials]
    tails = [t for t in pieces if not t.startswith("Ġ")]
    pairs = ((a, b) for a in pieces for b in tails)
    while len(vocab) < BIG_VOCAB:
        a, b = next(pairs)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b])
    config = dict(hf_config(BIG_SHAPE), vocab_size=BIG_VOCAB)
    with atomic_directory(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(Tokenizer.from_str(json.dumps(tokenizer)), tmp)
        save_file(random_weights(ModelSpec.from_hf_config(config), config["initializer_range"]),
                  str(tmp / "model.safetensors"))
    return directory


def timestamps(engine, prompts: list[str], params) -> list[list[float]]:
    """Every request's output times, the prompts submitted back to back."""
    stamps = [[] for _ in prompts]
    left = threading.Semaphore(0)

    def collector(i):
        def on_output(out):
            stamps[i].append(time.perf_counter())
            if out.finished:
                left.release()
        return on_output

    for i, prompt in enumerate(prompts):
        engine.submit(prompt, params, collector(i))
    for _ in prompts:
        left.acquire()
    return stamps


def step_seconds(engine, prompts: list[str], params) -> list[float]:
    """The gaps between the first row's outputs while every row decodes (after each row's first
    output, before any row's last)."""
    stamps = timestamps(engine, prompts, params)
    start, end = max(s[0] for s in stamps), min(s[-1] for s in stamps)
    times = [t for t in stamps[0] if start <= t < end]
    return [b - a for a, b in zip(times, times[1:])]


def decode_steps(engine, s: dict) -> list[dict]:
    from runtime.grammar import Guide
    from runtime.llm_engine import SamplingParams

    n = s["step_tokens"]
    schema = {"type": "array", "items": STEP_ITEM, "minItems": n}  # each item is several tokens
    modes = {"unconstrained": SamplingParams(max_tokens=n, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=n, guide=Guide("json_schema", json.dumps(schema)))}
    points = []
    for rows in s["batches"]:
        prompts = [f"items_{i} = " for i in range(rows)]
        gaps = {mode: [] for mode in modes}
        for r in range(s["step_rounds"]):  # taking turns
            for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                gaps[mode] += step_seconds(engine, prompts, modes[mode])
        steps = {mode: summary_ms(g) for mode, g in gaps.items()}
        share = steps["json_schema"]["median_ms"] / steps["unconstrained"]["median_ms"] - 1
        points.append({"batch": rows, "step": steps, "mask_share": share})
        say(f"structured: batch {rows}: decode step {steps['unconstrained']['median_ms']:.2f} ms, with the schema "
            f"{steps['json_schema']['median_ms']:.2f} ms ({share:+.1%})")
    return points


def compile_times(engine_dir: Path, engine, s: dict) -> dict:
    from runtime.grammar import Grammars, Guide

    grammars = Grammars(engine_dir / "tokenizer.json", engine.limits.vocab_size, engine.tokenizer.eos_token_ids)
    ends = frozenset(engine.tokenizer.eos_token_ids)
    began = time.perf_counter()
    grammars.constraint(Guide("regex", "a"), ends)  # loads llguidance's tokenizer
    tokenizer_seconds = time.perf_counter() - began
    cold, cached = [], []
    for r in range(s["compile_rounds"]):
        guide = Guide("json_schema", json.dumps(dict(FIXED_KEYS, title=f"round {r}")))  # a new schema each round
        for times in (cold, cached):
            began = time.perf_counter()
            grammars.constraint(guide, ends)
            times.append(time.perf_counter() - began)
    return {"tokenizer_load_ms": round(tokenizer_seconds * 1e3, 2), "cold": summary_ms(cold),
            "cached": summary_ms(cached)}


def jump_forward(engine, forcing, s: dict) -> list[dict]:
    from runtime.grammar import Guide
    from runtime.llm_engine import SamplingParams

    params = SamplingParams(max_tokens=160, guide=Guide("json_schema", json.dumps(FIXED_KEYS)))
    points = []
    for rows in s["forced_batches"]:
        prompts = [f"record_{i} = " for i in range(rows)]
        rates, identical, forced, tokens = {"off": [], "on": []}, True, 0, 0
        for r in range(s["forced_rounds"]):
            got = {}
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                runner = forcing if mode == "on" else engine
                before = runner.stats()["forced_tokens"]
                began = time.perf_counter()
                outputs = runner.generate(prompts, params)
                seconds = time.perf_counter() - began
                got[mode] = [o.token_ids for o in outputs]
                rates[mode].append(sum(map(len, got[mode])) / seconds)
                if mode == "on":
                    forced += runner.stats()["forced_tokens"] - before
                    tokens += sum(map(len, got[mode]))
            identical &= got["off"] == got["on"]
        speedup = statistics.median(on / off for on, off in zip(rates["on"], rates["off"]))
        points.append({"batch": rows, "tokens_per_s": {m: statistics.median(v) for m, v in rates.items()},
                       "speedup": speedup, "identical_tokens": identical, "forced_share": forced / tokens})
        say(f"structured: jump-forward at batch {rows}: {speedup:.2f}x, {forced / tokens:.0%} of tokens forced")
    return points


def quality(s: dict, artifacts: Artifacts, threads: int) -> dict:
    """Constrained vs unconstrained on the trained model: of the outputs ending with stop, how many
    parse and validate."""
    import jsonschema

    from runtime.grammar import Guide
    from runtime.llm_engine import LLMEngine, SamplingParams

    engine_dir = artifacts.export(str(TRAINED_MODEL), "inplace", "fp32")
    prompts = ([f"{name} = " for name in QUALITY_NAMES] + [f"self.{name} = " for name in QUALITY_NAMES])[
        :s["quality_prompts"]]
    modes = {"unconstrained": SamplingParams(max_tokens=s["quality_tokens"], stop=("\n",)),
             "json_schema": SamplingParams(max_tokens=s["quality_tokens"],
                                           guide=Guide("json_schema", json.dumps(QUALITY_SCHEMA)))}
    results = {}
    with LLMEngine(engine_dir, threads=threads) as engine:
        for mode, params in modes.items():
            outputs = engine.generate(prompts, params)
            stopped = [o.text for o in outputs if o.finish_reason == "stop"]
            valid = 0
            for text in stopped:
                try:
                    jsonschema.validate(json.loads(text), QUALITY_SCHEMA)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            results[mode] = {"outputs": len(outputs), "stopped": len(stopped), "valid": valid,
                             "valid_share_of_stopped": valid / len(stopped) if stopped else None,
                             "example": outputs[0].text[:120]}
    return results


def run(params: Params, artifacts: Artifacts) -> dict:
    from runtime.llm_engine import LLMEngine

    s = shape(params.quick)
    checkpoint = big_vocab_checkpoint(artifacts) if s["big_vocab"] else TRAINED_MODEL
    # the export itself (ONNX Runtime optimizes it when the session loads): `engines build` fails
    # on the big model's external weights file
    engine_dir = artifacts.export(str(checkpoint), "inplace", "fp32")
    # no prefix cache: every round prefills, as in the first turn of a conversation
    # `engine` decodes step by step (the mask's own cost; jump-forward's baseline), `forcing` as served
    with LLMEngine(engine_dir, threads=params.threads, prefix_cache=False, jump_forward=False) as engine, \
            LLMEngine(engine_dir, threads=params.threads, prefix_cache=False) as forcing:
        vocab = engine.limits.vocab_size
        say(f"structured: decode steps with and without a JSON schema on {checkpoint.name} ({vocab} tokens)")
        steps = decode_steps(engine, s)
        compiles = compile_times(engine_dir, engine, s)
        forced = jump_forward(engine, forcing, s)
    say("structured: valid outputs on the trained model, constrained and not")
    valid = quality(s, artifacts, params.threads)
    return {"model": checkpoint.name, "vocab_size": vocab, "shape": s, "decode_steps": steps, "compile": compiles,
            "jump_forward": forced, "quality": {"model": TRAINED_MODEL.name, "modes": valid},
            "units": {"median_ms": "milliseconds per whole engine step", "mask_share": "schema step / plain step - 1",
                      "tokens_per_s": "generated tokens / wall seconds of the batch, prefill included",
                      "valid_share_of_stopped": "outputs ending with stop that parse and validate / those ending "
                                                "with stop"},
            "method": "in-process LLMEngine on the fp32 export (no prefix cache); decode step: gaps between the first "
                      "row's outputs while every row decodes, unconstrained (ignore_eos) and schema rounds taking "
                      "turns; jump-forward: greedy, the engine with jump_forward off and on taking turns, speedup "
                      "the median of the rounds' ratios"}


def targets(results: dict) -> list[dict]:
    section = results.get("structured")
    name = f"Structured: the schema mask adds <= {MASK_SHARE_TARGET:.0%} to a batch-16 decode step (>= 128K vocabulary)"
    if not section_ran(section):
        return [skipped(name, "", "the structured section did not run")]
    widest = section["decode_steps"][-1]
    if section["vocab_size"] < 128_000 or widest["batch"] < 16:
        return [skipped(name, f"<= {MASK_SHARE_TARGET:.0%}", f"measured at batch {widest['batch']} on a "
                        f"{section['vocab_size']}-token vocabulary only (--quick): {widest['mask_share']:+.1%}")]
    return [target(name, f"<= {MASK_SHARE_TARGET:.0%}", f"{widest['mask_share']:+.1%}",
                   widest["mask_share"] <= MASK_SHARE_TARGET,
                   f"{widest['step']['unconstrained']['median_ms']:.1f} ms -> "
                   f"{widest['step']['json_schema']['median_ms']:.1f} ms on {section['model']}")]


def plot(plt, results: dict, out) -> None:
    section = results.get("structured")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    if section_ran(section):
        points = section["decode_steps"]
        for i, mode in enumerate(("unconstrained", "json_schema")):
            left.bar([j + 0.4 * i for j in range(len(points))], [p["step"][mode]["median_ms"] for p in points], 0.4,
                     label=mode)
        left.set_xticks([j + 0.2 for j in range(len(points))], [f"batch {p['batch']}" for p in points])
        left.set(ylabel="ms per decode step", title=f"Decode step, {section['model']} ({section['vocab_size']} tokens)")
        left.legend()
        forced = section["jump_forward"]
        for i, mode in enumerate(("off", "on")):
            right.bar([j + 0.4 * i for j in range(len(forced))], [p["tokens_per_s"][mode] for p in forced], 0.4,
                      label=f"jump-forward {mode}")
        right.set_xticks([j + 0.2 for j in range(len(forced))], [f"batch {p['batch']}" for p in forced])
        right.set(ylabel="tokens/s", title="Schema with long fixed keys")
        right.legend()
    finish_figure(plt, fig, out / "structured.png", section, "structured", [left, right])


def valid_cell(q: dict) -> str:
    share = q["valid_share_of_stopped"]
    return "-" if share is None else f"{q['valid']} ({share:.0%})"


def markdown(results: dict) -> list[str]:
    section = results.get("structured")
    if not rendered(section):
        return []
    compiled, quality_rows = section["compile"], section["quality"]
    return ["## Structured outputs (issue 42)", "",
            f"{section['model']}, {section['vocab_size']}-token vocabulary.", "",
            *table(["batch", "decode step ms", "with a JSON schema ms", "mask adds"],
                   [[p["batch"], f"{p['step']['unconstrained']['median_ms']:.2f}",
                     f"{p['step']['json_schema']['median_ms']:.2f}", f"{p['mask_share']:+.1%}"]
                    for p in section["decode_steps"]]), "",
            *table(["grammar compile", "ms"], [["llguidance tokenizer (once)", f"{compiled['tokenizer_load_ms']:.1f}"],
                                             ["schema, cold", f"{compiled['cold']['median_ms']:.2f}"],
                                             ["schema, cached", f"{compiled['cached']['median_ms']:.3f}"]]), "",
            *table(["jump-forward", "off tok/s", "on tok/s", "speedup", "tokens forced", "identical tokens"],
                   [[f"batch {p['batch']}", f"{p['tokens_per_s']['off']:.1f}", f"{p['tokens_per_s']['on']:.1f}",
                     f"{p['speedup']:.2f}x", f"{p['forced_share']:.0%}", "yes" if p["identical_tokens"] else "**no**"]
                    for p in section["jump_forward"]]), "",
            *table([quality_rows["model"], "outputs", "ended with stop", "parse and validate (of those)"],
                   [[mode, q["outputs"], q["stopped"], valid_cell(q)]
                    for mode, q in quality_rows["modes"].items()]), "",
            f"Method: {section['method']}.", ""]
