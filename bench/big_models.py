"""Big checkpoints (issue 40): the export's and the engine build's peak RSS and time against model
size, on random bf16 checkpoints with real models' exact configs, written a tensor at a time.

    python -m bench.big_models [--models qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b,llama-3.1-8b]
        [--weights int4[,int8,fp32]] [--max-seq-len 4096] [--drop-after] [--no-llama-cpp]
        [--out results/big_models.json]
    python -m bench.big_models --moe [--moe-layers 4] [--weights int4] [--threads N]

--moe: batch-1 decode of a random checkpoint with Qwen3-30B-A3B's layer shapes (--moe-layers of its
48 layers) beside the same checkpoint with its experts computed densely (its config's
num_experts_per_tok raised to num_experts: the MoE node runs every expert over every token) and a
dense Qwen3 of the same active parameters (the k experts' width as its MLP): step time, weight
bytes a step reads, and the time those bytes take at the measured read bandwidth (JSON, PNG, table).

Each stage runs as its own process; its peak RSS is the kernel's (os.wait4's ru_maxrss, from a
small spawner: PEAK_RSS_PROBE), beside the checkpoint's largest tensor in float32 (the design's
bound: the import and tracing baseline plus about twice the largest tensor or decoder layer). Then
the engine's time to first token for a 1,024-token prompt and its decode tokens/s at batch 1, in
process. Checkpoints go to build/checkpoints/big/, exports to build/exports/big-* (deleted once
built), engines to build/engines/big-*-<weights>. Saves JSON, a PNG and a table. Random weights:
memory and speed only, no quality.

Beside Llama-3.2-1B's checkpoint (LLAMA_CPP_MODELS; --no-llama-cpp leaves it out), llama.cpp on the
same weights: the checkpoint converted to GGUF Q8_0 by llama.cpp's own convert_hf_to_gguf.py (its peak
RSS and time in the build columns), llama-bench's pp1024 and tg16 at depth 1,024 with the same threads,
beside kvforge's int8 engine (Q8_0's peer, built whatever --weights says). The checkpoints carry the
presets' 4,096-token tokenizer under the real 128,256-token vocabulary: the converter's byte-level BPE
path (bench.cpu_peers.convert_to_gguf) writes the ids the tokenizer lacks as [PAD<id>] tokens of type
UNUSED, so the GGUF's vocabulary, embedding table and lm_head are the real size; llama-bench feeds
token ids, so the tokenizer never runs. llama-bench is built once from the peers section's sdist
(build/peers/llama.cpp); a host that cannot build it records why and the kvforge rows stand.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.common import ROOT, say, table, write_json
from bench.cpu_peers import GGUF_TYPES, LlamaCppPeer, PeerUnavailable, gguf_how, llama_cpp, llama_cpp_how

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
LLAMA3 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
              max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=1,
              eos_token_id=2, head_dim=64, hidden_act="silu", attention_bias=False, mlp_bias=False)
# The configs of the released checkpoints (config.json on the hub), random weights in their place.
CONFIGS = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, max_position_embeddings=32768,
                         rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                         use_sliding_window=False, sliding_window=32768, max_window_layers=21, bos_token_id=1,
                         eos_token_id=2, hidden_act="silu"),
    "llama-3.2-1b": dict(LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True,
                         rope_scaling=LLAMA3_ROPE),
    "llama-3.2-3b": dict(LLAMA3, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, intermediate_size=8192, tie_word_embeddings=True, head_dim=128,
                         rope_scaling=LLAMA3_ROPE),
    "llama-3.1-8b": dict(LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, tie_word_embeddings=False, head_dim=128,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}),
}
# Qwen3-30B-A3B's config.json, but MOE_LAYERS of its 48 layers: every shape of a layer is the real one.
QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu")
MOE_LAYERS = 4
MOE_PROMPT, MOE_STEPS = 64, 48
LLAMA_CPP_MODELS = ("llama-3.2-1b",)  # llama.cpp beside kvforge on the same checkpoint (issue 40)
LLAMA_CPP_OUTTYPE = GGUF_TYPES["int8"]  # Q8_0, kvforge int8's peer
PROMPT_TOKENS, DECODE_STEPS = 1024, 16  # the size sweep's time to first token and decode speed
SHARD_BYTES = 2 << 30


def random_checkpoint(config: dict, out: Path) -> Path:
    """config.json + bf16 safetensors shards with an index + the presets' tokenizer, a tensor at a
    time (torch: the export stage's dependency). Reused when present."""
    import torch
    from safetensors.torch import save_file

    from export.checkpoint import skeleton
    from export.presets import materialize
    from kvforge.manifest import KV_DTYPES, ModelSpec

    if (out / "model.safetensors.index.json").is_file():
        return out
    shapes = checkpoint_shapes(skeleton(ModelSpec.from_hf_config(config), "inplace", KV_DTYPES["fp32"]))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    weight_map, shard, size, count = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, count
        count += 1
        file = f"model-{count:05d}.safetensors"
        save_file(shard, str(tmp / file), metadata={"format": "pt"})
        weight_map.update((key, file) for key in shard)
        shard, size = {}, 0

    for key, shape in shapes:
        if key.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        shard[key] = tensor
        size += tensor.numel() * 2
        if size >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    preset = materialize("tiny-llama", ROOT / "build" / "checkpoints")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(preset / file, tmp / file)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def checkpoint_shapes(model) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint file's tensor names and shapes for the model's parameters: experts one
    tensor per expert and projection, as released MoE checkpoints keep them (CausalLM.stacked_weights)."""
    tied = model.spec.tie_word_embeddings
    stacked, shapes = model.stacked_weights(), []
    if model.fused_weights():
        raise SystemExit(f"{model.spec.architecture}: checkpoints with fused tensors are not generated here")
    for name, tensor in model.state_dict().items():
        parts = stacked.get(name)
        if tied and name == "lm_head.weight":
            continue
        if parts is None or isinstance(parts, str):
            shapes.append((parts or name, tuple(tensor.shape)))
        else:  # [E, rows, cols] from each expert's tensors stacked by rows
            for expert in parts:
                shapes += [(key, (tensor.shape[1] // len(expert), *tensor.shape[2:])) for key in expert]
    return shapes


# Spawns the stage and reports its peak RSS. A child's ru_maxrss starts from its parent's RSS at the
# fork (the kernel keeps the pre-exec high-water mark), so the stage is spawned by this small process,
# not by the caller (a test runner or this bench after writing checkpoints holds GiBs).
PEAK_RSS_PROBE = """import os, subprocess, sys
process = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(process.pid, 0)
open(sys.argv[1], "w").write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss * 1024}")
"""


def measured(command: list[str]) -> dict:
    """Run a stage as its own process: wall seconds and the kernel's peak RSS of it."""
    import tempfile

    started = time.perf_counter()
    with tempfile.NamedTemporaryFile("r") as report:
        subprocess.run([sys.executable, "-c", PEAK_RSS_PROBE, report.name, *command], cwd=ROOT, check=False)
        returncode, peak = (int(field) for field in Path(report.name).read_text().split())
    if returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({returncode})")
    return {"seconds": round(time.perf_counter() - started, 1), "peak_rss_bytes": peak}


def largest_tensor_bytes(checkpoint: Path) -> tuple[int, int]:
    """(parameters, bytes of the largest tensor in float32) from the safetensors headers."""
    from safetensors import safe_open

    from export.checkpoint import weight_files

    parameters, largest = 0, 0
    for path in weight_files(checkpoint):
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                n = 1
                for d in shape:
                    n *= d
                parameters, largest = parameters + n, max(largest, 4 * n)
    return parameters, largest


def run(models: list[str], weights: list[str], max_seq_len: int, drop_after: bool, llama_cpp: bool,
        out: Path) -> dict:
    py = sys.executable
    rows = []
    result = {"weights": weights, "max_seq_len": max_seq_len, "threads": os.cpu_count(), "models": rows}
    for name in models:
        say(f"{name}: random bf16 checkpoint")
        checkpoint = ROOT / "build" / "checkpoints" / "big" / name
        generated = not checkpoint.exists()
        random_checkpoint(CONFIGS[name], checkpoint)
        parameters, largest = largest_tensor_bytes(checkpoint)
        export_dir = ROOT / "build" / "exports" / f"big-{name}"
        say(f"{name}: export ({parameters / 1e9:.2f}B parameters)")
        export = measured([py, "-m", "export", "--model", str(checkpoint), "--out", str(export_dir),
                           "--max-seq-len", str(max_seq_len)])
        say(f"{name}: exported in {export['seconds']} s, peak RSS {export['peak_rss_bytes'] / 2**30:.2f} GiB")
        row = {"model": name, "parameters": parameters, "largest_tensor_fp32_bytes": largest, "export": export,
               "export_bytes": sum(f.stat().st_size for f in export_dir.iterdir() if f.is_file()), "engines": []}
        peer = llama_cpp and name in LLAMA_CPP_MODELS  # its converter reads the checkpoint after the builds
        if drop_after and generated and not peer:
            shutil.rmtree(checkpoint)
        for mode in weights + (["int8"] if peer and "int8" not in weights else []):  # int8: Q8_0's peer
            row["engines"].append(kvforge_engine(name, export_dir, mode, drop_after))
        shutil.rmtree(export_dir)  # 4 bytes a parameter: the disk, not the RAM, is what runs out next
        if peer:
            try:
                row["engines"].append(llama_cpp_engine(name, checkpoint, drop_after))
            except PeerUnavailable as e:
                say(f"{name}: llama.cpp skipped: {e}")
                row["llama_cpp_skipped"] = str(e)
            if drop_after and generated:
                shutil.rmtree(checkpoint)
        rows.append(row)
        write_json(out, result)  # what is measured so far survives a later model's failure
    return result


def kvforge_engine(name: str, export_dir: Path, weights: str, drop_after: bool) -> dict:
    """Build the export with `weights` (its peak RSS and time), then its TTFT at 1K and decode speed."""
    engine_dir = ROOT / "build" / "engines" / f"big-{name}-{weights}"
    say(f"{name}: engine build, {weights} weights")
    build = measured([sys.executable, "-m", "engines", "build", str(export_dir), "--backend", "onnxruntime",
                      "--weights", weights, "--out", str(engine_dir)])
    say(f"{name}: built in {build['seconds']} s, peak RSS {build['peak_rss_bytes'] / 2**30:.2f} GiB")
    engine = json.loads((engine_dir / "manifest.json").read_text())["engine"]
    say(f"{name}: a {PROMPT_TOKENS}-token prefill and {DECODE_STEPS} decode steps at batch 1")
    prefill, steps = decode_steps(engine_dir, os.cpu_count(), PROMPT_TOKENS, DECODE_STEPS)
    if drop_after:
        shutil.rmtree(engine_dir)
    return {"engine": "kvforge", "weights": weights, "build": build, "engine_bytes": engine["size_bytes"],
            "ttft_1k_s": round(prefill, 2), "decode_tokens_per_s": round(1 / statistics.median(steps), 2),
            "parity_scope": engine["parity_scope"], "parity_max_abs_diff": engine["parity_max_abs_diff"]}


def llama_cpp_engine(name: str, checkpoint: Path, drop_after: bool) -> dict:
    """The checkpoint as GGUF Q8_0 by llama.cpp's own converter (bench.cpu_peers, as the peers section
    converts), its peak RSS and time measured as a build's; then llama-bench (built once, cached) at
    the sweep's threads: pp of a fresh PROMPT_TOKENS prompt, whose tokens/s give the TTFT
    (PROMPT_TOKENS / pp t/s: llama-bench reports no first token of its own), and tg of DECODE_STEPS
    tokens at depth PROMPT_TOKENS, as kvforge decodes after its prompt. PeerUnavailable when
    llama.cpp cannot be had."""
    build = llama_cpp(build_allowed=True)
    gguf = ROOT / "build" / "gguf" / f"big-{name}-{LLAMA_CPP_OUTTYPE}.gguf"
    gguf.parent.mkdir(parents=True, exist_ok=True)
    say(f"{name}: GGUF {LLAMA_CPP_OUTTYPE} (llama.cpp's convert_hf_to_gguf.py)")
    try:
        convert = measured([sys.executable, "-m", "bench.cpu_peers", str(build["source"]), str(checkpoint),
                            "--outtype", LLAMA_CPP_OUTTYPE, "--outfile", str(gguf)])
    except SystemExit as e:  # the kvforge rows measured before it are kept
        raise PeerUnavailable(f"convert_hf_to_gguf.py --outtype {LLAMA_CPP_OUTTYPE}: {e}") from e
    say(f"{name}: converted in {convert['seconds']} s, peak RSS {convert['peak_rss_bytes'] / 2**30:.2f} GiB")
    say(f"{name}: llama-bench, pp{PROMPT_TOKENS} and tg{DECODE_STEPS} at depth {PROMPT_TOKENS}")
    bench = LlamaCppPeer(build["binary"], gguf, os.cpu_count(), PROMPT_TOKENS, DECODE_STEPS,
                         {**llama_cpp_how(build), "weights": gguf_how(LLAMA_CPP_OUTTYPE)})
    rates = bench.round()
    size = gguf.stat().st_size
    if drop_after:
        gguf.unlink()
    return {"engine": "llama.cpp", "weights": LLAMA_CPP_OUTTYPE, "build": convert, "engine_bytes": size,
            "ttft_1k_s": round(PROMPT_TOKENS / rates["prompt_tokens_per_s"], 2),
            "prompt_tokens_per_s": round(rates["prompt_tokens_per_s"], 2),
            "decode_tokens_per_s": round(rates["generation_tokens_per_s"], 2), "how": bench.how}
EVERY_EXPERT = "moe, experts computed densely"


def moe_configs(layers: int) -> dict[str, dict]:
    """The MoE model; the same with every expert routed to (EVERY_EXPERT: top 128 of 128, weighted
    by the softmax over all, so each expert runs over every token and a step reads them all); and a
    dense Qwen3 of the same active parameters: its MLP as wide as the k routed experts together
    (8 x 768 = 6,144, the config's own intermediate_size)."""
    moe = {**QWEN3_30B_A3B, "num_hidden_layers": layers}
    dense = {k: v for k, v in moe.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                                       "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}
    dense.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                 intermediate_size=moe["num_experts_per_tok"] * moe["moe_intermediate_size"])
    return {"moe": moe, EVERY_EXPERT: {**moe, "num_experts_per_tok": moe["num_experts"]},
            "dense, same active parameters": dense}


def reconfigured(checkpoint: Path, config: dict, out: Path) -> Path:
    """checkpoint's files (linked, not copied: GBs) under another config.json."""
    shutil.rmtree(out, ignore_errors=True)  # links to a checkpoint since regenerated
    out.mkdir(parents=True)
    for file in checkpoint.iterdir():
        if file.name != "config.json":
            (out / file.name).symlink_to(file.resolve())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}, indent=1))
    return out


def active_step_bytes(engine_dir: Path, config: dict) -> int:
    """Weight bytes a batch-1 decode step reads: bench.roofline's count, the QMoE/MoE experts'
    weights and scales at k of E."""
    import onnx

    from bench.roofline import initializer_bytes, step_weight_bytes
    from kvforge.manifest import MODEL_FILE

    total = step_weight_bytes(engine_dir / MODEL_FILE, 1)["weight_bytes_per_step"]
    graph = onnx.load(str(engine_dir / MODEL_FILE), load_external_data=False).graph
    sizes = {t.name: initializer_bytes(t) for t in graph.initializer}
    experts = sum(sizes.get(name, 0) for node in graph.node if node.op_type in ("MoE", "QMoE") for name in node.input[2:])
    share = config.get("num_experts_per_tok", 1) / config.get("num_experts", 1)
    return total - experts + int(experts * share)


def decode_steps(engine_dir: Path, threads: int, prompt_tokens: int, steps: int) -> tuple[float, list[float]]:
    """(seconds of a batch-1 prefill of prompt_tokens, the time to first token without a server;
    seconds of each decode step after it)."""
    import numpy as np

    from runtime.greedy import Greedy
    from runtime.runners import open_runner

    prompt = np.random.default_rng(0).integers(3, 4000, prompt_tokens).tolist()
    run = Greedy(open_runner(engine_dir, threads=threads), [prompt], steps + 1)
    began = time.perf_counter()
    run.prefill(every_position=False)
    prefill = time.perf_counter() - began
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        run.step()
        seconds.append(time.perf_counter() - began)
    return prefill, seconds


def read_bandwidth(threads: int) -> float:
    """The machine's read bandwidth, bytes/s: bench.roofline's read test, best of 5."""
    from bench.roofline import concurrent_seconds, stream_tests

    fn, args, nbytes = stream_tests(threads)["read"]
    return nbytes / min(concurrent_seconds(fn, args) for _ in range(5))


def moe_run(layers: int, weights: str, threads: int) -> dict:
    py, rows, checkpoints = sys.executable, [], ROOT / "build" / "checkpoints" / "big"
    for kind, config in moe_configs(layers).items():
        name = f"qwen3-30b-a3b-{layers}-layers-{'every-expert' if kind == EVERY_EXPERT else kind.split(',')[0]}"
        if kind == EVERY_EXPERT:  # the MoE's own weights (made first)
            checkpoint = reconfigured(checkpoints / rows[0]["config"], config, checkpoints / name)
        else:
            say(f"{name}: random bf16 checkpoint")
            checkpoint = random_checkpoint(config, checkpoints / name)
        export_dir, engine_dir = ROOT / "build" / "exports" / f"big-{name}", ROOT / "build" / "engines" / f"big-{name}-{weights}"
        export = measured([py, "-m", "export", "--model", str(checkpoint), "--out", str(export_dir), "--max-seq-len", "512"])
        build = measured([py, "-m", "engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", weights,
                          "--out", str(engine_dir)])
        shutil.rmtree(export_dir)
        say(f"{name}: {MOE_STEPS} decode steps at batch 1")
        _, steps = decode_steps(engine_dir, threads, MOE_PROMPT, MOE_STEPS)
        median, active = statistics.median(steps), active_step_bytes(engine_dir, config)
        rows.append({"model": kind, "config": name, "parameters": largest_tensor_bytes(checkpoint)[0],
                     "export": export, "build": build, "step_ms_median": round(median * 1e3, 2),
                     "tokens_per_s": round(1 / median, 2), "active_weight_bytes": active,
                     "effective_bytes_per_s": round(active / median)})
    bandwidth = read_bandwidth(threads)
    for row in rows:
        row["step_ms_at_read_bandwidth"] = round(row["active_weight_bytes"] / bandwidth * 1e3, 2)
    moe, every, dense = (row["step_ms_median"] for row in rows)
    return {"layers": layers, "of_layers": QWEN3_30B_A3B["num_hidden_layers"], "weights": weights, "threads": threads,
            "read_bandwidth_bytes_per_s": round(bandwidth), "moe_over_dense_step": round(moe / dense, 3),
            "moe_over_every_expert_step": round(moe / every, 3), "target_ratio": 1.3, "models": rows}


def moe_report(result: dict, out: Path) -> None:
    print(f"Qwen3-30B-A3B's shapes, {result['layers']} of {result['of_layers']} layers, {result['weights']} weights, "
          f"batch 1, {result['threads']} threads; read bandwidth {result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    print("\n".join(table(["model", "parameters", "decode step ms", "tokens/s", "weight MB read a step",
                            "ms at read bandwidth", "effective GB/s"],
                           [[r["model"], f"{r['parameters'] / 1e9:.2f}B", r["step_ms_median"], r["tokens_per_s"],
                             f"{r['active_weight_bytes'] / 1e6:.0f}", r["step_ms_at_read_bandwidth"],
                             f"{r['effective_bytes_per_s'] / 1e9:.1f}"] for r in result["models"]])))
    print(f"MoE step / dense step: {result['moe_over_dense_step']:.2f}x (target <= {result['target_ratio']}x); "
          f"/ experts computed densely: {result['moe_over_every_expert_step']:.2f}x")
    write_json(out, result)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    rows, at = result["models"], range(len(result["models"]))
    axis.bar([i - 0.2 for i in at], [r["step_ms_median"] for r in rows], 0.4, label="decode step, measured")
    axis.bar([i + 0.2 for i in at], [r["step_ms_at_read_bandwidth"] for r in rows], 0.4,
             label=f"its weight bytes at {result['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    axis.set_xticks(list(at), [r["model"].replace(", ", ",\n") for r in rows])
    axis.set_ylabel("ms")
    axis.set_title(f"Batch-1 decode, Qwen3-30B-A3B's shapes ({result['layers']} of {result['of_layers']} layers), "
                   f"{result['weights']}", fontsize=9)
    axis.legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    say(f"saved {out} and {out.with_suffix('.png')}")


def report(result: dict, out: Path) -> None:
    gib = 2 ** 30
    lines = []
    for r in result["models"]:
        export = [r["export"]["seconds"], f"{r['export']['peak_rss_bytes'] / gib:.2f}"]
        for e in r["engines"]:
            peer = e["engine"] != "kvforge"  # the converter is its export and build in one
            lines.append([r["model"], f"{r['parameters'] / 1e9:.2f}B", f"{r['largest_tensor_fp32_bytes'] / gib:.2f}",
                          *(["-", "-"] if peer else export), f"{e['engine']} {e['weights']}", e["build"]["seconds"],
                          f"{e['build']['peak_rss_bytes'] / gib:.2f}", f"{e['engine_bytes'] / gib:.2f}", e["ttft_1k_s"],
                          e["decode_tokens_per_s"], e.get("parity_scope", "-")])
    header = ["model", "parameters", "largest fp32 tensor GiB", "export s", "export peak GiB", "engine", "build s",
              "build peak GiB", "engine GiB", "TTFT 1K s", "decode tok/s", "parity on"]
    print("\n".join(table(header, lines)))
    for r in result["models"]:
        if "llama_cpp_skipped" in r:
            print(f"{r['model']}: llama.cpp skipped: {r['llama_cpp_skipped']}")
    write_json(out, result)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    rows = result["models"]
    sizes = [r["parameters"] / 1e9 for r in rows]
    axis.plot(sizes, [r["export"]["peak_rss_bytes"] / gib for r in rows], "o-", label="export peak RSS")
    for engine, weights in dict.fromkeys((e["engine"], e["weights"]) for r in rows for e in r["engines"]):
        points = [(r["parameters"] / 1e9, e["build"]["peak_rss_bytes"] / gib) for r in rows for e in r["engines"]
                  if (e["engine"], e["weights"]) == (engine, weights)]
        stage = f"{weights} build" if engine == "kvforge" else f"{engine} {weights} conversion"
        axis.plot(*zip(*points), "o-" if engine == "kvforge" else "s", label=f"{stage} peak RSS")
    axis.plot(sizes, [4 * s * 1e9 / gib for s in sizes], "k:", label="the model in float32")
    axis.axhline(16, color="r", linestyle="--", label="16 GiB target")
    axis.set_xlabel("parameters (billions)")
    axis.set_ylabel("GiB")
    axis.set_title(f"Export and {', '.join(result['weights'])} build memory vs model size")
    axis.legend()
    figure.tight_layout()
    figure.savefig(out.with_suffix(".png"), dpi=120)
    say(f"saved {out} and {out.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(CONFIGS))
    parser.add_argument("--weights", default="int4", help="kvforge's engines, comma-separated (--moe: one): fp32, int8, int4")
    parser.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True,
                        help=f"llama.cpp {LLAMA_CPP_OUTTYPE} beside {', '.join(LLAMA_CPP_MODELS)} (and kvforge int8, "
                             "its peer); llama-bench is built once, cached in build/peers/llama.cpp")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--moe", action="store_true",
                        help="instead: decode of Qwen3-30B-A3B's shapes (--moe-layers layers) vs its experts computed "
                             "densely and a dense model of its active parameters (results/big_models_moe.json)")
    parser.add_argument("--moe-layers", type=int, default=MOE_LAYERS, help="of Qwen3-30B-A3B's 48")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--drop-after", action="store_true",
                        help="delete each checkpoint this run generated once exported (converted, for llama.cpp), and "
                             "each engine and GGUF file once measured "
                             "(disk: an 8B checkpoint is 16 GB, its export 36 GB, its build 13 GB more)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    weights, modes = args.weights.split(","), ("fp32", "int8", "int4")
    if not set(weights) <= set(modes):
        raise SystemExit(f"--weights {args.weights}: choose from {', '.join(modes)}")
    if args.moe:
        if not 1 <= args.moe_layers <= QWEN3_30B_A3B["num_hidden_layers"]:
            raise SystemExit(f"--moe-layers {args.moe_layers}: Qwen3-30B-A3B has 1..48")
        if len(weights) != 1:
            raise SystemExit(f"--moe --weights {args.weights}: one of {', '.join(modes)}")
        moe_report(moe_run(args.moe_layers, weights[0], args.threads),
                   args.out or ROOT / "results" / "big_models_moe.json")
        return
    models = args.models.split(",")
    unknown = [m for m in models if m not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; choose from {', '.join(CONFIGS)}")
    out = args.out or ROOT / "results" / "big_models.json"
    report(run(models, weights, args.max_seq_len, args.drop_after, args.llama_cpp, out), out)


if __name__ == "__main__":
    main()
