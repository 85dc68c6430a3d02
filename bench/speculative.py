"""Section speculative (issue 23): prompt-lookup speculation on the trained default model.

Two workloads whose answers repeat their context: continuing held-out standard-library code
(files the model never trained on) and a summarise-this-document prompt. For each prompt, the
in-process engine generates greedily with speculation off and on, taking turns for `rounds`
rounds (decode tokens/s: the tokens after the first over the time after the first; acceptance:
accepted / drafted tokens from the engine's counters; the texts must be identical), then 2..16
different prompts at once (throughput: off, the default that stops speculating beyond max_rows
decoding rows, and speculating at any batch, which is what max_rows is chosen from), and
transformers' generate() with and without `prompt_lookup_num_tokens` on the same checkpoint, in
the same run. Time budget: ~4 min full, ~40 s --quick.
"""
from __future__ import annotations

import statistics
import threading
import time

from bench.common import TRAINED_MODEL, Params, finish_figure, rendered, say, section_ran, skipped, table, target
from runtime.speculation import LIMIT, MAX_DRAFT_TOKENS, MAX_ROWS, Speculation

MODES = ("off", "ngram")
SUMMARY_INSTRUCTION = "Summarize the following document in a few sentences.\n\n"


def shape(quick: bool) -> dict:
    if quick:
        return dict(prompt_tokens=96, new_tokens=24, code_prompts=1, documents=1, rounds=1, streams=(2, 8),
                    stream_rounds=1)
    return dict(prompt_tokens=512, new_tokens=128, code_prompts=4, documents=2, rounds=3, streams=(2, 4, 8, 16),
                stream_rounds=6)


def workloads(tokenizer, s: dict) -> dict[str, list[str]]:
    """Held-out code cut to prompt_tokens; documents wrapped in the summary instruction."""
    from export.train import split_corpus

    held_out = split_corpus()[1]
    texts = [t for t in held_out if len(tokenizer.encode(t)) > 2 * s["prompt_tokens"]]

    def cut(text: str, tokens: int) -> str:
        return tokenizer.decode(tokenizer.encode(text)[:tokens])

    code = [cut(t, s["prompt_tokens"]) for t in texts[:s["code_prompts"]]]
    documents = [SUMMARY_INSTRUCTION + cut(t, s["prompt_tokens"] - 16) + "\n\nSummary:\n"
                 for t in texts[s["code_prompts"]:s["code_prompts"] + s["documents"]]]
    return {"code continuation": code, "summarise a document": documents}


def timed_generation(engine, prompt: str, params) -> dict:
    """One request: its decode tokens/s after the first token, its tokens, and the drafts it made."""
    before = engine.stats()
    arrivals, done = [], threading.Event()
    tokens = []

    def on_output(out):
        tokens.extend(out.token_ids)
        arrivals.append((time.perf_counter(), len(out.token_ids)))
        if out.finished:
            done.set()

    engine.submit(prompt, params, on_output)
    done.wait()
    after = engine.stats()
    first = next(i for i, (_, n) in enumerate(arrivals) if n)
    decoded = sum(n for _, n in arrivals[first + 1:])
    seconds = arrivals[-1][0] - arrivals[first][0]
    return {"tokens": tokens, "decode_tokens_per_s": decoded / seconds if seconds > 0 else None,
            "drafted": after["spec_draft_tokens"] - before["spec_draft_tokens"],
            "accepted": after["spec_accepted_tokens"] - before["spec_accepted_tokens"],
            "steps": after["steps"] - before["steps"]}


def batch_one(engine, prompts: list[str], s: dict) -> dict:
    from runtime.llm_engine import SamplingParams

    runs = {mode: [] for mode in MODES}
    identical = True
    for r in range(s["rounds"]):
        for prompt in prompts:
            order = MODES if r % 2 == 0 else MODES[::-1]  # neither mode always goes first
            got = {mode: timed_generation(engine, prompt, SamplingParams(
                max_tokens=s["new_tokens"], ignore_eos=True, speculative=mode)) for mode in order}
            identical &= got["off"]["tokens"] == got["ngram"]["tokens"]
            for mode in MODES:
                runs[mode].append(got[mode])
    drafted = sum(x["drafted"] for x in runs["ngram"])
    rate = {mode: statistics.median(x["decode_tokens_per_s"] for x in runs[mode]) for mode in MODES}
    speedup = statistics.median(on["decode_tokens_per_s"] / off["decode_tokens_per_s"]
                                for on, off in zip(runs["ngram"], runs["off"]))  # each pair ran back to back
    return {"decode_tokens_per_s": rate, "speedup": speedup, "identical_greedy_text": identical,
            "acceptance": sum(x["accepted"] for x in runs["ngram"]) / drafted if drafted else 0.0,
            "drafted_tokens": drafted,
            "tokens_per_step": {mode: sum(len(x["tokens"]) for x in runs[mode]) / sum(x["steps"] for x in runs[mode])
                                for mode in MODES}}


def concurrent(engine, always, prompts: list[str], s: dict) -> list[dict]:
    """n different prompts at once: generated tokens/s over the wall time (median of
    `stream_rounds`), speculation off, with the default max_rows, and on at any batch (`always`:
    what max_rows is chosen from); each vs off as the median of the rounds' own ratios."""
    from runtime.llm_engine import SamplingParams

    configurations = (("off", engine, "off"), ("default", engine, "ngram"), ("always", always, "ngram"))
    points = []
    for n in s["streams"]:
        batch = [prompts[i % len(prompts)] + f"\n# stream {i}\n" for i in range(n)]
        samples = {name: [] for name, _, _ in configurations}
        for r in range(s["stream_rounds"]):  # taking turns, each round in another order
            for name, runner, mode in configurations[r % 3:] + configurations[:r % 3]:
                params = SamplingParams(max_tokens=s["new_tokens"], ignore_eos=True, speculative=mode)
                began = time.perf_counter()
                outputs = runner.generate(batch, params)
                samples[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - began))
        rates = {name: statistics.median(v) for name, v in samples.items()}
        # each round's ratio pairs runs seconds apart: the host's drift between rounds (10-20%
        # here) cancels out, which a ratio of medians over all rounds does not do
        paired = {name: statistics.median(x / off for x, off in zip(samples[name], samples["off"]))
                  for name in ("default", "always")}
        points.append({"streams": n, "tokens_per_s": rates, "default_vs_off": paired["default"],
                       "always_vs_off": paired["always"], "rounds": s["stream_rounds"]})
    return points


def transformers_prompt_lookup(checkpoint, tokenizer, prompts: list[str], s: dict) -> dict:
    """transformers' own prompt lookup (`prompt_lookup_num_tokens`) vs its plain greedy generate()."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(s["threads"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    rates, identical = {"off": [], "ngram": []}, True
    warm = torch.tensor([tokenizer.encode(prompts[0])])
    for extra in ({}, {"prompt_lookup_num_tokens": MAX_DRAFT_TOKENS}):  # first calls pay one-time setup
        model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, **extra)
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        got = {}
        for mode, extra in (("off", {}), ("ngram", {"prompt_lookup_num_tokens": MAX_DRAFT_TOKENS})):
            with torch.inference_mode():
                began = time.perf_counter()
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s["new_tokens"],
                                     min_new_tokens=s["new_tokens"], do_sample=False, **extra)
                seconds = time.perf_counter() - began
            got[mode] = out[0, ids.shape[1]:].tolist()
            rates[mode].append(len(got[mode]) / seconds)  # includes its prefill: reported as such
        identical &= got["off"] == got["ngram"]
    rate = {mode: statistics.median(v) for mode, v in rates.items()}
    speedup = statistics.median(on / off for on, off in zip(rates["ngram"], rates["off"]))
    return {"tokens_per_s_with_prefill": rate, "speedup": speedup, "identical_greedy_text": identical,
            "prompt_lookup_num_tokens": MAX_DRAFT_TOKENS}


def run(params: Params, artifacts) -> dict:
    from runtime.llm_engine import LLMEngine, SamplingParams

    s = dict(shape(params.quick), threads=params.threads)
    checkpoint = artifacts.checkpoint(str(TRAINED_MODEL))
    engine_dir = artifacts.engine(artifacts.export(str(TRAINED_MODEL), "inplace", "fp32"), "fp32", params.threads)
    results = {}
    # no prefix cache: every turn prefills its prompt, as the first turn of a conversation does
    with LLMEngine(engine_dir, prefix_cache=False, threads=params.threads) as engine, \
            LLMEngine(engine_dir, prefix_cache=False, threads=params.threads,
                      speculation=Speculation(max_rows=LIMIT)) as always:
        loads = workloads(engine.tokenizer, s)
        engine.generate([loads["code continuation"][0]], SamplingParams(max_tokens=4))  # warm-up
        for name, prompts in loads.items():
            say(f"speculative: {name}, batch 1, off and ngram taking turns ({s['rounds']} rounds)")
            results[name] = batch_one(engine, prompts, s)
        say(f"speculative: {', '.join(map(str, s['streams']))} concurrent streams")
        streams = concurrent(engine, always, loads["code continuation"], s)
        tokenizer = engine.tokenizer
    say("speculative: transformers generate() with and without prompt_lookup_num_tokens")
    hf = transformers_prompt_lookup(checkpoint, tokenizer, loads["code continuation"], s)
    return {"model": str(TRAINED_MODEL.name), "shape": s, "batch_1": results, "concurrent": streams,
            "transformers": hf, "draft": {"max_draft_tokens": MAX_DRAFT_TOKENS, "max_rows": MAX_ROWS},
            "units": {"decode_tokens_per_s": "tokens/s after the first token (batch 1)", "acceptance": "accepted / drafted",
                      "tokens_per_step": "generated tokens per engine step", "tokens_per_s": "tokens/s (all streams)",
                      "tokens_per_s_with_prefill": "generated tokens / generate() seconds"},
            "method": "in-process LLMEngine (fp32, no prefix cache), greedy, ignore_eos; off and ngram take turns per "
                      "prompt, each speedup the median of the pairs' ratios; decode tokens/s from per-output "
                      "timestamps after the first token; transformers' rate includes its prefill (its generate() "
                      "has no streaming timestamps); concurrent streams: the three configurations take turns, each "
                      "ratio the median of the rounds' own ratios"}


def targets(results: dict) -> list[dict]:
    section = results.get("speculative")
    names = ("Speculation: code continuation decode >= 1.5x off at batch 1, identical greedy text",
             "Speculation: no slower than off at the most concurrent streams")
    if not section_ran(section):
        return [skipped(n, "", "the speculative section did not run") for n in names]
    code, widest = section["batch_1"]["code continuation"], section["concurrent"][-1]
    return [target(names[0], ">= 1.5x, identical", f"{code['speedup']:.2f}x, "
                   + ("identical" if code["identical_greedy_text"] else "**different text**"),
                   code["speedup"] >= 1.5 and code["identical_greedy_text"],
                   f"acceptance {code['acceptance']:.0%}; transformers' prompt lookup "
                   f"{section['transformers']['speedup']:.2f}x"),
            target(names[1], ">= 0.95x (run-to-run spread)", f"{widest['default_vs_off']:.2f}x at {widest['streams']} streams",
                   widest["default_vs_off"] >= 0.95, f"speculation stops beyond {section['draft']['max_rows']} decoding "
                   f"rows; speculating anyway: {widest['always_vs_off']:.2f}x")]


def plot(plt, results: dict, out) -> None:
    section = results.get("speculative")
    fig, (ax, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    if section_ran(section):
        groups = {f"{name}\n(decode)": r["decode_tokens_per_s"] for name, r in section["batch_1"].items()}
        groups["transformers\n(batch 1, incl. prefill)"] = section["transformers"]["tokens_per_s_with_prefill"]
        for i, mode in enumerate(MODES):
            ax.bar([g + 0.4 * i for g in range(len(groups))], [v[mode] for v in groups.values()], 0.4, label=mode)
        ax.set_xticks([g + 0.2 for g in range(len(groups))], list(groups), fontsize=8)
        ax.set(ylabel="tokens/s", title=f"Prompt lookup, batch 1, {section['model']}")
        ax.legend()
        points = section["concurrent"]
        for name, style in (("off", "s--"), ("default", "o-"), ("always", "^:")):
            right.plot([p["streams"] for p in points], [p["tokens_per_s"][name] for p in points], style, label=name)
        right.set(xlabel="concurrent streams", ylabel="tokens/s (all streams)",
                  title="Throughput: off, default (max_rows), always")
        right.set_xscale("log", base=2)
        right.legend()
    finish_figure(plt, fig, out / "speculative.png", section, "speculative", [ax, right])


def markdown(results: dict) -> list[str]:
    section = results.get("speculative")
    if not rendered(section):
        return []
    rows = [[name, f"{r['decode_tokens_per_s']['off']:.1f}", f"{r['decode_tokens_per_s']['ngram']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['acceptance']:.0%}", f"{r['tokens_per_step']['ngram']:.2f}",
             "yes" if r["identical_greedy_text"] else "**no**"] for name, r in section["batch_1"].items()]
    hf, streams = section["transformers"], section["concurrent"]
    return ["## Prompt-lookup speculation (issue 23)", "",
            f"{section['model']}, greedy, {section['shape']['prompt_tokens']}-token prompts, "
            f"{section['shape']['new_tokens']} new tokens, drafts of up to {section['draft']['max_draft_tokens']}.", "",
            *table(["workload (batch 1)", "off tok/s", "ngram tok/s", "speedup", "acceptance", "tokens/step",
                    "identical text"], rows), "",
            *table(["transformers generate(), batch 1", "off tok/s (incl. prefill)", "prompt lookup tok/s", "speedup",
                    "identical text"],
                   [["same checkpoint, same prompts", f"{hf['tokens_per_s_with_prefill']['off']:.1f}",
                     f"{hf['tokens_per_s_with_prefill']['ngram']:.1f}", f"{hf['speedup']:.2f}x",
                     "yes" if hf["identical_greedy_text"] else "**no**"]]), "",
            *table(["concurrent streams", "off tok/s", f"default (max_rows {section['draft']['max_rows']}) tok/s",
                    "always tok/s", "default / off (per round)", "always / off (per round)"],
                   [[p["streams"], f"{p['tokens_per_s']['off']:.1f}", f"{p['tokens_per_s']['default']:.1f}",
                     f"{p['tokens_per_s']['always']:.1f}", f"{p['default_vs_off']:.2f}x", f"{p['always_vs_off']:.2f}x"]
                    for p in streams]), "",
            f"Method: {section['method']}.", ""]
