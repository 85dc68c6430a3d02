"""What every benchmark section shares: run parameters, progress lines, cached artifacts
(exports, engines), decode-step timing through the Runner interface, and quality metrics."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import numpy as np


ROOT = Path(__file__).resolve().parents[1]
TRAINED_MODEL = ROOT / "models" / "stdlib-llama"
STARTED = time.perf_counter()


@dataclass(frozen=True)
class Params:
    """Everything a run depends on besides the machine; saved with the results."""

    quick: bool
    model: str  # preset or checkpoint dir for the speed sections
    quality_model: str  # a trained checkpoint: quality on random weights means nothing
    threads: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    nocache_contexts: dict  # batch -> contexts; recomputing is slow, so it is sampled sparsely
    nocache_repeats: int
    timed_steps: int  # decode steps timed per (layout, batch, context) point and round
    layout_rounds: int  # rounds in which the layouts take turns
    prompt_tokens: int  # peers, weights and the generation totals
    new_tokens: int
    peer_rounds: int  # generations per ONNX Runtime system, taking turns
    hf_new_tokens: int  # transformers' generate() is slow: fewer tokens, same decode rate
    hf_nocache_new_tokens: int
    dtype_contexts: tuple[int, ...]
    eval_windows: int | None  # held-out windows of export.train's EVAL_WINDOW tokens for perplexity; None = all
    greedy_prompt_tokens: int
    greedy_tokens: int
    concurrency: tuple[int, ...]
    serving_prompt_tokens: int
    serving_new_tokens: int
    kv_budget_bytes: int = 1 << 30
    budget_sequence_tokens: int = 2048
    peer_models: tuple[str, ...] = ()  # the peers' TTFT table (empty: `model` alone)
    ttft_prompt_tokens: tuple[int, ...] = (128, 1024, 2048)
    ttft_rounds: int = 3
    ttft_new_tokens: int = 32
    prefill_profile_tokens: tuple[int, ...] = (1024, 2048)  # the prefill section's profiled prompts
    roofline_batches: tuple[int, ...] = (1, 2, 4)  # the roofline's decode batches for every weight mode

    def to_dict(self) -> dict:
        return asdict(self)


def params(quick: bool, threads: int) -> Params:
    trained = str(TRAINED_MODEL)
    if quick:
        return Params(quick=True, model=trained, quality_model=trained, threads=threads, batches=(1, 4),
                      contexts=(32, 128), nocache_contexts={1: (32, 128), 4: (128,)}, nocache_repeats=1,
                      timed_steps=4, layout_rounds=1, prompt_tokens=16, new_tokens=8, peer_rounds=1, hf_new_tokens=8,
                      hf_nocache_new_tokens=4, dtype_contexts=(128,), eval_windows=4, greedy_prompt_tokens=16,
                      greedy_tokens=32, concurrency=(1, 4), serving_prompt_tokens=16, serving_new_tokens=8,
                      ttft_prompt_tokens=(16, 64), ttft_rounds=1, ttft_new_tokens=4, prefill_profile_tokens=(64,))
    return Params(quick=False, model="small-llama", quality_model=trained, threads=threads, batches=(1, 8),
                  contexts=(128, 256, 512, 1024, 2048, 4096),
                  nocache_contexts={1: (128, 512, 2048, 4096), 8: (128, 512)}, nocache_repeats=2,
                  timed_steps=8, layout_rounds=4, prompt_tokens=128, new_tokens=64, peer_rounds=3, hf_new_tokens=32,
                  hf_nocache_new_tokens=4, dtype_contexts=(512, 2048), eval_windows=None, greedy_prompt_tokens=64,
                  greedy_tokens=256, concurrency=(1, 4, 16, 64), serving_prompt_tokens=64, serving_new_tokens=64,
                  peer_models=("small-llama", "small-llama-32k"))


def runnable_kv_dtypes() -> list[str]:
    """The in-place layout's KV dtypes that ONNX Runtime on this machine can run (fp8 cannot)."""
    from kvforge.manifest import KV_DTYPES, LAYOUT_DTYPES

    return [d for d in LAYOUT_DTYPES["inplace"] if "onnxruntime" in KV_DTYPES[d].runs_on]


class SectionError(RuntimeError):
    """A section that could only partly run: the message says why, `partial` keeps what it measured."""

    def __init__(self, message: str, partial: dict):
        super().__init__(message)
        self.partial = partial


def say(message: str) -> None:
    print(f"[bench {time.perf_counter() - STARTED:6.0f} s] {message}", file=sys.stderr, flush=True)


class Artifacts:
    """Exports and engines made through the project's own CLIs, cached under build/bench and
    reused while their inputs are unchanged: the checkpoint's bytes and the source code of the
    stage that made them (a changed exporter must not be benchmarked through a stale export)."""

    STAMP = "bench-inputs.json"

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fingerprints: dict[Path, str] = {}

    def checkpoint(self, model: str) -> Path:
        from export.__main__ import resolve_model

        return resolve_model(model)

    def fingerprint(self, checkpoint: Path) -> str:
        """sha256 of the checkpoint, once per run (hashing the benchmark model takes seconds)."""
        from export.checkpoint import fingerprint

        if checkpoint not in self._fingerprints:
            self._fingerprints[checkpoint] = fingerprint(checkpoint)
        return self._fingerprints[checkpoint]

    def _cached(self, out: Path, inputs: dict, make) -> Path:
        stamp = out / self.STAMP
        if stamp.is_file() and json.loads(stamp.read_text()) == inputs:
            return out
        make()
        stamp.write_text(json.dumps(inputs, indent=2) + "\n")
        return out

    def export(self, model: str, layout: str, dtype: str) -> Path:
        """An export whose capacity is the model's full position range (so sections share it)."""
        checkpoint = self.checkpoint(model)
        out = self.root / "exports" / f"{checkpoint.name}-{layout}-{dtype}"

        def make():
            say(f"exporting {checkpoint.name} ({layout} layout, {dtype} KV)")
            run_module("export", "--model", str(checkpoint), "--out", str(out), "--kv-layout", layout,
                       "--kv-dtype", dtype)

        return self._cached(out, {"checkpoint": self.fingerprint(checkpoint), "code": code_digest("export", "kvforge")},
                            make)

    def engine(self, export_dir: Path, weights: str, threads: int) -> Path:
        out = self.root / "engines" / f"{export_dir.name}-w{weights}"

        def make():
            say(f"building the ONNX Runtime engine {out.name} ({weights} weights)")
            run_module("engines", "build", str(export_dir), "--backend", "onnxruntime", "--weights", weights,
                       "--threads", str(threads), "--out", str(out))

        export_inputs = json.loads((export_dir / self.STAMP).read_text())
        return self._cached(out, {"export": export_inputs, "threads": threads, "code": code_digest("engines")}, make)

    def genai(self, model: str) -> Path:
        """ONNX Runtime GenAI's own export of the same checkpoint (its model builder)."""
        from importlib.metadata import version

        checkpoint = self.checkpoint(model)
        out = self.root / "genai" / checkpoint.name

        def make():
            say(f"building the ONNX Runtime GenAI model for {checkpoint.name} (its model builder)")
            run_module("onnxruntime_genai.models.builder", "-m", str(checkpoint), "-o", str(out),
                       "-p", "fp32", "-e", "cpu", "-c", str(self.root / "genai-cache"))

        return self._cached(out, {"checkpoint": self.fingerprint(checkpoint),
                                  "onnxruntime-genai": version("onnxruntime-genai")}, make)

    def gguf(self, model: str, outtype: str, llama_cpp_tree: Path) -> Path:
        """The checkpoint as a GGUF file of `outtype` (f32, q8_0, ...), by llama.cpp's own converter
        from the tree it was built from (bench.cpu_peers.convert_to_gguf)."""
        checkpoint = self.checkpoint(model)
        out = self.root / "gguf" / f"{checkpoint.name}-{outtype}"

        def make():
            say(f"converting {checkpoint.name} to GGUF {outtype} (llama.cpp's convert_hf_to_gguf.py)")
            out.mkdir(parents=True, exist_ok=True)
            run_module("bench.cpu_peers", str(llama_cpp_tree), str(checkpoint), "--outtype", outtype,
                       "--outfile", str(out / "model.gguf"))

        converter = hashlib.sha256((ROOT / "bench" / "cpu_peers.py").read_bytes()).hexdigest()
        return self._cached(out, {"checkpoint": self.fingerprint(checkpoint), "llama.cpp": str(llama_cpp_tree),
                                  "converter": converter}, make) / "model.gguf"

    def ctranslate2(self, model: str) -> Path:
        """The checkpoint as a CTranslate2 model with float32 weights; the 8-bit variant is
        quantized from it when loaded (compute_type), as CTranslate2 does."""
        from importlib.metadata import version

        from ctranslate2.converters import TransformersConverter

        checkpoint = self.checkpoint(model)
        out = self.root / "ctranslate2" / checkpoint.name

        def make():
            say(f"converting {checkpoint.name} to CTranslate2 (TransformersConverter, float32 weights)")
            TransformersConverter(str(checkpoint)).convert(str(out), quantization="float32", force=True)

        return self._cached(out, {"checkpoint": self.fingerprint(checkpoint), "ctranslate2": version("ctranslate2")},
                            make)


def code_digest(*packages: str) -> str:
    """sha256 over the Python sources of the given top-level packages of this checkout."""
    digest = hashlib.sha256()
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run_module(*args: str) -> None:
    """python -m ARGS from the repository root; its output is shown only when it fails."""
    result = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"python -m {' '.join(args)} failed ({result.returncode}):\n{result.stderr[-3000:]}")


# ---------------------------------------------------------------- decode timing

def fitting_capacity(runner, tokens: int) -> int:
    """The smallest capacity holding `tokens`: the in-place layout's bucket, or the concat bound."""
    return runner.bucket_for(tokens) if runner.manifest.kv_layout == "inplace" else tokens


def allocate_for(runner, rows: int, tokens: int) -> None:
    runner.allocate(rows, fitting_capacity(runner, tokens))


def decode_steps(runner, rows: int, context: int, steps: int, capacity: int | None = None,
                 observe=None) -> list[float]:
    """Seconds of each of `steps` one-token decode steps, the last one ending with `context`
    cached tokens per row (after one untimed warm-up step). `capacity` defaults to the
    smallest that fits; observe(runner, step_index) runs before each step, outside the timing."""
    start = context - steps - 1
    # a 4096-token prefill of the benchmark model takes minutes; cache values do not change step time
    runner.allocate_cached(rows, start, capacity or fitting_capacity(runner, context))
    tokens = np.full((rows, 1), 3, np.int64)
    one = np.ones(rows, np.int64)
    times = []
    for i in range(steps + 1):
        if observe is not None:
            observe(runner, i)
        began = time.perf_counter()
        runner.step(tokens, np.full(rows, start + i, np.int64), one)
        if i:
            times.append(time.perf_counter() - began)
    return times


def interleaved_steps(variants: dict, rows: int, context: int, steps: int, rounds: int) -> dict:
    """key -> decode step seconds for variants {key: (runner, capacity or None)} at one context.
    The variants take turns for `rounds` rounds, so load from other processes on a shared
    machine hits them alike."""
    times: dict = {key: [] for key in variants}
    for _ in range(rounds):
        for key, (runner, capacity) in variants.items():
            times[key] += decode_steps(runner, rows, context, steps, capacity=capacity)
    return times


def generate(runner, prompts: np.ndarray, new_tokens: int) -> dict:
    """Greedy generation through the Runner (runtime.greedy): prefill all rows, then one token
    per row per step. Returns the tokens and the prefill / per-step decode times."""
    from runtime.greedy import Greedy

    run = Greedy(runner, prompts.tolist(), new_tokens)
    began = time.perf_counter()
    run.prefill(every_position=False)  # the generation path: logits of the sampled position only
    prefill = time.perf_counter() - began
    out, steps = [run.next_tokens], []
    for _ in range(new_tokens - 1):
        began = time.perf_counter()
        run.step()
        steps.append(time.perf_counter() - began)
        out.append(run.next_tokens)
    return {"tokens": np.stack(out, axis=1), "prefill_s": prefill, "step_s": steps}


def random_prompts(vocab: int, rows: int, length: int) -> np.ndarray:
    """The peers' prompts: the same seeded random token ids for every system."""
    return np.random.default_rng(0).integers(3, vocab, (rows, length)).astype(np.int64)


def kvforge_steps(runner, ids: np.ndarray, new_tokens: int) -> tuple[float, list[float]]:
    """(prefill s, decode step s) of one greedy generation through the Runner."""
    result = generate(runner, ids, new_tokens)
    return result["prefill_s"], result["step_s"]


def decode_rate(rows: int, step_seconds: list[float]) -> float:
    """Generated tokens per second over the decode steps (all rows)."""
    return rows * len(step_seconds) / sum(step_seconds)


# ---------------------------------------------------------------- quality (trained model)

def perplexity(runner, windows: np.ndarray, rows: int = 8) -> float:
    """exp(mean next-token NLL), each window prefilled in one step: attention inside the prefill
    already reads the K/V back from the cache in its dtype, so KV quantization shows."""
    total, count = 0.0, 0
    length = windows.shape[1] - 1
    allocate_for(runner, rows, length)
    for i in range(0, len(windows), rows):
        chunk = windows[i:i + rows]
        n = len(chunk)
        logits = runner.step(chunk[:, :-1], np.zeros(n, np.int64), np.full(n, length, np.int64))
        logits = logits.astype(np.float64)
        top = logits.max(-1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        picked = np.take_along_axis(logits, chunk[:, 1:, None], -1)[..., 0]
        total += float((logz - picked).sum())
        count += picked.size
    return float(np.exp(total / count))


def greedy_agreement(reference: np.ndarray, candidate_runner, prompts: np.ndarray, candidate: np.ndarray) -> dict:
    """Agreement of a candidate with the fp32 reference over the generated tokens:
    free-running (both generate on their own; after a first difference they drift apart) and
    teacher-forced (the candidate predicts each next token of the reference's text)."""
    rows, prompt_len = prompts.shape
    n = reference.shape[1]
    same = reference == candidate
    first = [int(np.argmin(r)) if not r.all() else n for r in same]
    text = np.concatenate([prompts, reference], axis=1)
    allocate_for(candidate_runner, rows, text.shape[1])
    logits = candidate_runner.step(text[:, :-1], np.zeros(rows, np.int64), np.full(rows, text.shape[1] - 1, np.int64))
    predicted = logits[:, prompt_len - 1:].argmax(-1)
    return {"free_running_agreement": round(float(same.mean()), 4),
            "tokens_before_first_difference_mean": round(float(np.mean(first)), 1),
            "teacher_forced_agreement": round(float((predicted == reference).mean()), 4),
            "tokens_compared": int(same.size)}


def held_out_prompts(stream: np.ndarray, rows: int, length: int) -> np.ndarray:
    """`rows` prompts of `length` tokens spread evenly over the held-out stream."""
    starts = np.linspace(0, len(stream) - length - 1, rows).astype(int)
    return np.stack([stream[s:s + length] for s in starts])


def machine_facts() -> dict:
    import platform

    facts = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
             "python": sys.version.split()[0], "load_average_at_start": list(os.getloadavg())}
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        facts["cpu_model"] = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                                  if line.startswith("model name"))
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        facts["memory_bytes"] = int(meminfo[0].split()[1]) * 1024
    except (OSError, StopIteration):
        pass
    return facts


def library_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "onnx", "onnxruntime", "onnxruntime-genai", "numpy",
                 "tritonclient", "nvidia-pytriton", "matplotlib"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def section_ran(section: dict | None) -> bool:
    return bool(section) and section.get("status") == "ok"


def finish_figure(plt, fig, path: Path, section: dict | None, name: str, axes: list) -> None:
    """Save a section's figure; a section that did not run gets a figure saying why, not empty axes."""
    if not section_ran(section):
        axes[0].text(0.5, 0.5, f"{name} section did not run: {(section or {}).get('error', '')[:200]}",
                     ha="center", va="center", wrap=True, transform=axes[0].transAxes)
        for ax in axes:
            ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=2, default=float) + "\n")


# ---------------------------------------------------------------- report helpers (every section's targets, tables, plots)

NOT_EVALUATED = None


def target(name: str, required: str, measured: str, met: bool | None, detail: str) -> dict:
    # met may come from a numpy comparison: JSON must say true / false, not 1.0
    return {"target": name, "required": required, "measured": measured, "met": None if met is None else bool(met),
            "detail": detail}


def skipped(name: str, required: str, why: str) -> dict:
    return target(name, required, "-", NOT_EVALUATED, why)


def figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def panels(plt, path: Path, section: dict | None, what: str, draw, count: int = 2) -> None:
    """A figure of `count` panels drawn by draw(*axes), or the reason the section has no data."""
    fig, axes = plt.subplots(1, count, figsize=(5.5 * count, 4.5), squeeze=False)
    axes = list(axes[0])
    if section_ran(section):
        draw(*axes)
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    finish_figure(plt, fig, path, section, what, axes)


def fmt(x, digits: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if math.isfinite(x) else str(x)
    return f"{x:,}" if isinstance(x, int) else str(x)


def table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def quality_cells(r: dict) -> list[str]:
    """perplexity, change vs fp32, greedy agreement of one variant (fp32 is the reference)."""
    agree = (f"{r['teacher_forced_agreement']:.3f} / {r['free_running_agreement']:.3f}"
             if "teacher_forced_agreement" in r else "reference")
    change = r.get("perplexity_vs_fp32_percent")
    return [f"{r['perplexity']:.3f}", "-" if change is None else f"{change:+.2f}%", agree]


def rendered(section: dict | None) -> bool:
    """Whether bench.md shows the section: it ran, or it failed after measuring part of it."""
    return section_ran(section) or bool((section or {}).get("partial"))


def describe(values: list[float], *, scale: float = 1.0, digits: int = 4, unit: str = "",
             stats: tuple[str, ...] = ("median", "min", "max", "samples")) -> dict:
    """Summary statistics of a sample (seconds x scale=1e3 with unit "_ms" for milliseconds)."""
    a = np.asarray(values, dtype=float) * scale
    compute = {"median": np.median, "min": np.min, "max": np.max, "mean": np.mean,
               "p50": lambda x: np.percentile(x, 50), "p99": lambda x: np.percentile(x, 99)}
    return {stat if stat == "samples" else f"{stat}{unit}": int(a.size) if stat == "samples"
            else round(float(compute[stat](a)), digits) for stat in stats}


summary_ms = partial(describe, scale=1e3, unit="_ms")  # seconds -> median/min/max ms
