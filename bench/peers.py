"""Section 4, peers on the same checkpoint and machine: kvforge's runners, Hugging Face
transformers generate() (cache on and off), ONNX Runtime GenAI (its own model builder's
export of the same checkpoint dir), and Optimum's ORTModelForCausalLM when importable.

Every system gets the same prompt tokens, the same number of new tokens (greedy, EOS ignored)
and the same thread count; decode tokens/s excludes the prefill.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from bench import cpu_peers
from bench.common import (Params, decode_rate, describe, fmt, kvforge_steps, random_prompts, rendered, say, section_ran,
                          skipped, table, target)

# Why Optimum is absent when it is (checked with `pip install --dry-run` beside the pins).
OPTIMUM_NOTE = ("optimum 2.x + optimum-onnx need transformers<5 (pip would downgrade transformers to 4.57); "
                "with transformers 5.24 pinned pip resolves optimum 1.17.1, which fails to import "
                "(transformers.utils.is_tf_available is gone)")


MEDIAN_RANGE = ("median", "min", "max")


def genai_steps(model, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
    """The first generate_next_token() only picks from the prefill's logits; each later call
    runs one decode step: n tokens = prefill + n - 1 steps, as for the other systems."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=ids.shape[1] + new_tokens, min_length=ids.shape[1] + new_tokens,
                              batch_size=len(ids), do_sample=False)
    generator = og.Generator(model, params)
    began = time.perf_counter()
    generator.append_tokens(ids.astype(np.int32))
    prefill = time.perf_counter() - began
    steps = []
    while not generator.is_done():
        began = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - began)
    return prefill, steps[1:]


def genai_model(model_dir, threads: int):
    import json

    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og.Model(config)


class GenAIGraphInOurSession:
    """GenAI's exported graph stepped through kvforge's ONNX Runtime session settings and
    IOBinding (past and present bound to one buffer, as GenAI shares them): separates what
    GenAI's graph buys from what its runtime does around the same ONNX Runtime."""

    def __init__(self, model_dir, threads: int):
        import json

        import onnxruntime as ort

        from runtime.runners.ort import session_options

        decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
        self.layers, self.kv_heads, self.head_dim = (decoder["num_hidden_layers"], decoder["num_key_value_heads"],
                                                     decoder["head_size"])
        self.session = ort.InferenceSession(str(model_dir / decoder["filename"]), session_options(threads),
                                            providers=["CPUExecutionProvider"])

    def steps(self, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
        from onnxruntime import OrtValue

        rows, length = ids.shape
        cache = [np.zeros((rows, self.kv_heads, length + new_tokens, self.head_dim), np.float32)
                 for _ in range(2 * self.layers)]
        values = [OrtValue.ortvalue_from_numpy(buffer) for buffer in cache]

        def run(tokens: np.ndarray, total: int) -> np.ndarray:
            binding = self.session.io_binding()
            binding.bind_cpu_input("input_ids", np.ascontiguousarray(tokens, dtype=np.int64))
            binding.bind_cpu_input("attention_mask", np.ones((rows, total), np.int64))
            binding.bind_output("logits")
            for i, value in enumerate(values):
                name = f"{i // 2}.{('key', 'value')[i % 2]}"
                binding.bind_ortvalue_input(f"past_key_values.{name}", value)
                binding.bind_ortvalue_output(f"present.{name}", value)
            self.session.run_with_iobinding(binding)
            return binding.get_outputs()[0].numpy()[:, -1].argmax(-1)[:, None]

        began = time.perf_counter()
        token = run(ids, length)
        prefill, steps = time.perf_counter() - began, []
        for i in range(new_tokens - 1):
            began = time.perf_counter()
            token = run(token, length + i + 1)
            steps.append(time.perf_counter() - began)
        return prefill, steps


def interleaved(systems: dict, ids: np.ndarray, new_tokens: int, rounds: int) -> dict:
    """Each system generates `rounds` times, taking turns, so load from elsewhere on a shared
    machine hits them alike. systems: name -> fn(ids, new_tokens) -> (prefill s, step s)."""
    prefill: dict[str, list[float]] = {name: [] for name in systems}
    steps: dict[str, list[float]] = {name: [] for name in systems}
    for fn in systems.values():
        fn(ids, 2)  # warm-up: first-run allocations and kernel selection
    for _ in range(rounds):
        for name, fn in systems.items():
            p, s = fn(ids, new_tokens)
            prefill[name].append(p)
            steps[name] += s
    return {name: rate_summary(len(ids), prefill[name], steps[name]) for name in systems}


def rate_summary(rows: int, prefill: list[float], steps: list[float]) -> dict:
    return {"decode_tokens_per_s": round(rows / statistics.median(steps), 2),
            "decode_tokens_per_s_mean": round(decode_rate(rows, steps), 2),
            "median_step_ms": round(1e3 * statistics.median(steps), 3), "fastest_step_ms": round(1e3 * min(steps), 3),
            "prefill_s": round(statistics.median(prefill), 4), "decode_steps": len(steps)}


def hf_rate(model, ids: np.ndarray, new_tokens: int, use_cache: bool) -> dict:
    hf_steps(model, ids, 2, use_cache)  # warm-up
    prefill, steps = hf_steps(model, ids, new_tokens, use_cache)
    return rate_summary(len(ids), [prefill], steps)


def hf_steps(model, ids: np.ndarray, new_tokens: int, use_cache: bool = True) -> tuple[float, list[float]]:
    """generate() timed per token: a streamer is handed the prompt, then each new token as soon
    as it exists, so the first gap is the prefill (and its token) and the others decode steps."""
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    model.generate(torch.from_numpy(ids), attention_mask=torch.ones(ids.shape, dtype=torch.int64),
                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=use_cache,
                   pad_token_id=0, streamer=clock)
    gaps = list(np.diff(clock.times))
    return gaps[0], gaps[1:]


def kvforge_ttft_steps(runner, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
    """What LLMEngine does for a prompt that runs alone (bench.prefill.solo_prefill); the buffer
    grows (untimed, once) before decoding past the prompt's bucket."""
    from bench.prefill import solo_prefill

    rows, length = ids.shape
    began = time.perf_counter()
    solo_prefill(runner, ids)
    prefill = time.perf_counter() - began
    runner.resize(runner.bucket_for(length + new_tokens), rows)
    lengths, one, steps = np.full(rows, length, np.int64), np.ones(rows, np.int64), []
    token = np.full(rows, 3, np.int64)  # decode speed does not depend on which token
    for i in range(new_tokens - 1):
        began = time.perf_counter()
        token = runner.step(token[:, None], lengths + i, one)[:, 0].argmax(-1)
        steps.append(time.perf_counter() - began)
    return prefill, steps


def decode_matmul_bound(export_dir, threads: int) -> dict:
    """A batch-1 decode step's weight matmuls alone on ONNX Runtime's CPU kernels: the shapes of a
    profiled one-token step, every weight distinct (read from memory, as in the step): what an fp32
    decode step on these kernels costs even if the rest of its graph cost nothing."""
    from bench.prefill import matmuls_seconds, profile_step

    shapes = profile_step(export_dir, 1, threads)["weight_matmuls"]
    seconds = matmuls_seconds(shapes, threads)
    weight_bytes = sum(4 * b[0] * b[1] for _, b in shapes)
    return {"matmuls": len(shapes), "weight_bytes": weight_bytes, "bound_ms": round(seconds * 1e3, 3),
            "bound_tokens_per_s": round(1 / seconds, 2), "read_gb_per_s": round(weight_bytes / seconds / 1e9, 2)}


def ttft_rounds(systems: dict, vocab: int, lengths: tuple[int, ...], new_tokens: int, rounds: int) -> list[dict]:
    """TTFT and batch-1 decode tokens/s at each prompt length: a fresh random prompt every round
    (nothing can be reused), the systems taking turns inside each round."""
    for fn in systems.values():
        fn(random_prompts(vocab, 1, max(lengths)), 2)  # warm-up at the longest shape: arenas and kernels
    out = []
    for length in lengths:
        ttft: dict[str, list[float]] = {name: [] for name in systems}
        rate: dict[str, list[float]] = {name: [] for name in systems}
        for r in range(rounds):
            ids = np.random.default_rng(1000 * length + r).integers(3, vocab, (1, length)).astype(np.int64)
            for name, fn in systems.items():
                prefill, steps = fn(ids, new_tokens)
                ttft[name].append(prefill)
                rate[name].append(1 / statistics.median(steps))
        say(f"peers TTFT: {length} prompt tokens: " + ", ".join(
            f"{name} {statistics.median(t):.2f} s" for name, t in ttft.items()))
        out.append({"prompt_tokens": length, "systems": {
            name: {"ttft_s": describe(ttft[name], stats=MEDIAN_RANGE),
                   "decode_tokens_per_s": describe(rate[name], digits=2, stats=MEDIAN_RANGE)} for name in systems}})
    return out


def ttft_section(params: Params, artifacts) -> list[dict]:
    """kvforge (in place), transformers generate() and ONNX Runtime GenAI on each peer model."""
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.runners import open_runner

    results = []
    for model in params.peer_models or (params.model,):
        checkpoint = artifacts.checkpoint(model)
        runner = open_runner(artifacts.export(model, "inplace", "fp32"), params.threads)
        hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
        genai = genai_model(artifacts.genai(model), params.threads)
        systems = {"kvforge": lambda ids, n: kvforge_ttft_steps(runner, ids, n),
                   "transformers": lambda ids, n: hf_steps(hf, ids, n),
                   "onnxruntime_genai": lambda ids, n: genai_steps(genai, ids, n)}
        say(f"peers TTFT: {checkpoint.name}, prompts {list(params.ttft_prompt_tokens)}, {params.ttft_rounds} rounds")
        results.append({"model": checkpoint.name, "vocab_size": hf.config.vocab_size,
                        "lengths": ttft_rounds(systems, hf.config.vocab_size, params.ttft_prompt_tokens,
                                               params.ttft_new_tokens, params.ttft_rounds),
                        "decode_matmul_bound": decode_matmul_bound(artifacts.export(model, "inplace", "fp32"),
                                                                   params.threads)})
        del runner, hf, genai
    return results


def torch_linear_ms(hidden: int, out: int, rows: tuple[int, ...], repeats: int = 20) -> dict:
    """One decoder-sized torch Linear at each row count: explains transformers' batch scaling,
    which on some CPUs is set by PyTorch's small-M GEMM rather than by generate()."""
    import torch

    weight = torch.randn(out, hidden) * 0.02
    result = {}
    for n in rows:
        x = torch.randn(n, hidden)
        torch.nn.functional.linear(x, weight)
        began = time.perf_counter()
        for _ in range(repeats):
            torch.nn.functional.linear(x, weight)
        result[str(n)] = round((time.perf_counter() - began) / repeats * 1e3, 4)
    return result


def graph_ops(path) -> dict:
    """Node count, most frequent operators and ONNX Runtime's fused (com.microsoft) operators of
    an ONNX graph (weights not loaded)."""
    import collections

    import onnx

    nodes = onnx.load(str(path), load_external_data=False).graph.node
    ops = collections.Counter(n.op_type for n in nodes)
    return {"nodes": len(nodes), "top_ops": dict(ops.most_common(8)),
            "fused_contrib_ops": sorted({n.op_type for n in nodes if n.domain == "com.microsoft"})}


def optimum_status() -> dict:
    try:
        from optimum.onnxruntime import ORTModelForCausalLM  # noqa: F401
    except ImportError as e:
        return {"status": "not installed", "import_error": str(e)[:200], "why": OPTIMUM_NOTE}
    return {"status": "importable but not benchmarked", "why": "add it here if it ever installs beside the pins"}


def run(params: Params, artifacts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from runtime.runners import open_runner

    checkpoint = artifacts.checkpoint(params.model)
    exports = {layout: artifacts.export(params.model, layout, "fp32") for layout in ("inplace", "concat")}
    genai_dir = artifacts.genai(params.model)
    torch.set_num_threads(params.threads)
    torch.set_grad_enabled(False)
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    runners = {layout: open_runner(directory, params.threads) for layout, directory in exports.items()}
    genai = genai_model(genai_dir, params.threads)
    genai_graph = GenAIGraphInOurSession(genai_dir, params.threads)
    fast = {**{f"kvforge_{layout}": (lambda ids, n, r=r: kvforge_steps(r, ids, n)) for layout, r in runners.items()},
            "onnxruntime_genai": lambda ids, n: genai_steps(genai, ids, n),
            "genai_graph_in_kvforge_session": genai_graph.steps}
    rows_out = []
    for rows in params.batches:
        ids = random_prompts(vocab, rows, params.prompt_tokens)
        say(f"peers: kvforge (in-place, concat), onnxruntime-genai and its graph in our session taking turns, "
            f"batch {rows}, {params.peer_rounds} rounds")
        systems = interleaved(fast, ids, params.new_tokens, params.peer_rounds)
        say(f"peers: transformers generate() with cache, batch {rows}")
        systems["hf_generate_cache"] = hf_rate(hf, ids, params.hf_new_tokens, use_cache=True)
        say(f"peers: transformers generate() without cache, batch {rows}")
        systems["hf_generate_no_cache"] = hf_rate(hf, ids, params.hf_nocache_new_tokens, use_cache=False)
        rows_out.append({"batch": rows, "new_tokens": params.new_tokens, "systems": systems})
    return {
        "model": params.model, "checkpoint": str(checkpoint), "prompt_tokens": params.prompt_tokens,
        "threads": params.threads, "greedy": True,
        "torch_linear_ms_by_rows": torch_linear_ms(hf.config.hidden_size, hf.config.intermediate_size,
                                                   tuple(sorted({1, 2, *params.batches}))),
        "optimum_ort_model_for_causal_lm": optimum_status(),
        "graphs": {"kvforge_inplace": graph_ops(exports["inplace"] / "model.onnx"),
                   "onnxruntime_genai": graph_ops(genai_dir / "model.onnx")},
        "method": "decode tokens/s = batch / median decode step, prefill excluded; kvforge, onnxruntime-genai "
                  "and genai_graph_in_kvforge_session (GenAI's model.onnx stepped through kvforge's session "
                  "options and IOBinding) time every step and take turns for peer_rounds rounds; transformers "
                  "generate() is timed per token through a streamer (one generation)",
        "peer_rounds": params.peer_rounds,
        "units": {"decode_tokens_per_s": "tokens/s (all rows)", "decode_tokens_per_s_mean": "tokens/s (all rows)",
                  "median_step_ms": "ms", "fastest_step_ms": "ms", "prefill_s": "s",
                  "torch_linear_ms_by_rows": "ms per hidden x intermediate Linear, by input rows",
                  "ttft_s": "s", "ttft decode_tokens_per_s": "tokens/s (batch 1)",
                  "generation_tokens_per_s": "tokens/s (batch 1)", "prompt_tokens_per_s": "tokens/s (batch 1)"},
        "results": rows_out,
        "cpu_peers": cpu_peers.run(params, artifacts, vocab),
        "ttft": ttft_section(params, artifacts),
        "ttft_method": "batch 1, fp32, greedy, prefix caching off (a fresh random prompt every round), "
                       f"{params.threads} threads for every system, systems taking turns in each of ttft_rounds "
                       "rounds; TTFT = the prefill and its first token (kvforge: as LLMEngine runs a prompt "
                       "alone, in SOLO_PREFILL_TOKENS chunks asking for the last position's logits; transformers: "
                       "generate()'s first "
                       "streamer gap; GenAI: append_tokens); decode tokens/s = 1 / median decode step of a round; "
                       "median, min and max over rounds",
        "ttft_rounds": params.ttft_rounds,
    }


# ---------------------------------------------------------------- report (targets, bench.md, plot)

def peer_targets(peers: dict, roofline: dict | None) -> list[dict]:
    names = ("Batch-1 decode >= ONNX Runtime GenAI", "Batch-1 decode >= 3x Hugging Face transformers (cache on)")
    if not section_ran(peers):
        return [skipped(n, "", "peers section did not run") for n in names]
    systems = next(r["systems"] for r in peers["results"] if r["batch"] == 1)
    ours = systems["kvforge_inplace"]["decode_tokens_per_s"]
    genai = systems["onnxruntime_genai"]["decode_tokens_per_s"]
    hf = systems["hf_generate_cache"]["decode_tokens_per_s"]
    graphs = peers["graphs"]
    fused = [op for op in graphs["onnxruntime_genai"]["fused_contrib_ops"]
             if op not in graphs["kvforge_inplace"]["fused_contrib_ops"]]
    ours_s, genai_s = systems["kvforge_inplace"], systems["onnxruntime_genai"]
    steps = (f"median step {ours_s['median_step_ms']:.2f} vs {genai_s['median_step_ms']:.2f} ms, fastest "
             f"{ours_s['fastest_step_ms']:.2f} vs {genai_s['fastest_step_ms']:.2f} ms")
    graph_in_ours = systems["genai_graph_in_kvforge_session"]["decode_tokens_per_s"]
    graph_gain, runtime_gain = 100 * (graph_in_ours / ours - 1), 100 * (genai / graph_in_ours - 1)
    why = (f"; our graph has {graphs['kvforge_inplace']['nodes']} nodes, GenAI's "
           f"{graphs['onnxruntime_genai']['nodes']} (its fused ONNX Runtime operators: {', '.join(fused) or 'none'}). "
           f"GenAI's own graph stepped through kvforge's session runs at {graph_in_ours:.1f} tokens/s: its graph "
           f"is worth {graph_gain:+.1f}% over ours, its runtime {runtime_gain:+.1f}% over the same graph in our session")
    return [
        target(names[0], ">= 1.00x", f"{ours:.1f} vs {genai:.1f} tokens/s ({ours / genai:.2f}x)", ours >= genai,
               f"{100 * (ours / genai - 1):+.1f}% ({steps})" + ("" if ours >= genai else why)),
        target(names[1], ">= 3.00x", f"{ours:.1f} vs {hf:.1f} tokens/s ({ours / hf:.2f}x)", ours >= 3 * hf,
               f"{ours / hf / 3:.2f}x the target" + ("" if ours >= 3 * hf else bound_note(systems, roofline))),
    ]


CPU_PEER_MARGIN = 1.1  # issue 23: kvforge decodes >= 1.1x the CPU engines users pick
CPU_PEER_WEIGHTS = {"fp32": "fp32", "int8": "8-bit"}


def cpu_peer_targets(peers: dict | None) -> list[dict]:
    rows = []
    for weights, label in CPU_PEER_WEIGHTS.items():
        name = f"Decode tokens/s >= {CPU_PEER_MARGIN}x the CPU peers' generation tokens/s ({label} weights, batch 1)"
        required = f">= {CPU_PEER_MARGIN:.2f}x each"
        if not section_ran(peers):
            rows.append(skipped(name, required, "peers section did not run"))
            continue
        section = peers["cpu_peers"]
        rates = {s["engine"]: s["generation_tokens_per_s"]["median"] for s in section["systems"]
                 if s["weights"] == weights}
        ours = rates.pop("kvforge")
        if not rates:
            rows.append(skipped(name, required, "no CPU peer ran: " + "; ".join(
                f"{engine}: {why.splitlines()[0]}" for engine, why in section["skipped"].items())))
            continue
        worst = min(ours / rate for rate in rates.values())
        detail = f"{worst / CPU_PEER_MARGIN:.2f}x the target against the fastest peer" + "".join(
            f"; {engine} skipped ({why.splitlines()[0]})" for engine, why in section["skipped"].items())
        rows.append(target(name, required, f"kvforge {ours:.1f} tokens/s vs " + ", ".join(
            f"{engine} {rate:.1f} ({ours / rate:.2f}x)" for engine, rate in rates.items()),
            worst >= CPU_PEER_MARGIN, detail))
    return rows


def bound_note(systems: dict, roofline: dict | None) -> str:
    """How far any batch-1 decode could outrun transformers: at best it reads the weights at the
    machine's bandwidth."""
    if not section_ran(roofline):
        return ""
    bound = roofline["points"][0]["bound_ms"]
    hf = systems["hf_generate_cache"]["median_step_ms"]
    return (f"; a step at the memory-bandwidth bound ({bound:.2f} ms, roofline section) would be "
            f"{hf / bound:.2f}x transformers' {hf:.2f} ms median step")


def section_markdown(peers: dict) -> list[str]:
    names = list(peers["results"][0]["systems"])
    rows = [[r["batch"], *(fmt(r["systems"][n]["decode_tokens_per_s"], 1) for n in names)] for r in peers["results"]]
    o = peers["optimum_ort_model_for_causal_lm"]
    return [f"## 4. Peers (decode tokens/s, same checkpoint, prompt {peers['prompt_tokens']} tokens)", "",
            *table(["batch", *names], rows), "", f"Optimum ORTModelForCausalLM: {o['status']} ({o['why']}).", "",
            *cpu_peers_markdown(peers["cpu_peers"])]


def cpu_peers_markdown(section: dict) -> list[str]:
    """kvforge beside the CPU engines, one row per engine and weights, and how each was built."""
    def rate(s: dict, key: str) -> str:
        r = s[key]
        return f"{r['median']:.1f} ({r['min']:.1f}-{r['max']:.1f})"

    rows = [[s["engine"], s["weights"], rate(s, "generation_tokens_per_s"), rate(s, "prompt_tokens_per_s")]
            for s in section["systems"]]
    how = [f"- {s['engine']} {s['weights']}: " + "; ".join(
        f"{k} {' '.join(v) if isinstance(v, list) else v}" for k, v in s["how"].items()) for s in section["systems"]]
    return [f"### CPU engines, batch 1 (prompt {section['prompt_tokens']} tokens, {section['new_tokens']} new, "
            f"{section['threads']} threads, {section['rounds']} rounds taking turns)", "",
            *table(["engine", "weights", "generation tokens/s: median (min-max)", "prompt tokens/s"], rows), "",
            "How each ran:", "", *how,
            *(f"- {engine}: skipped: {why.splitlines()[0]}" for engine, why in section["skipped"].items())]


def targets(results: dict) -> list[dict]:
    return peer_targets(results.get("peers"), results.get("roofline")) + cpu_peer_targets(results.get("peers"))


def markdown(results: dict) -> list[str]:
    return section_markdown(results["peers"]) if rendered(results.get("peers")) else []
