"""python -m export.verify DIR: does the export compute what the PyTorch checkpoint computes?

1. Prefill a batch of rows of different lengths (right-padded, as continuous batching does)
   through the export's runner and compare every valid position with Hugging Face transformers.
2. Greedy-decode `--steps` tokens per row with the KV cache, and at every step recompute the
   whole sequence without a cache in PyTorch: the logits must agree within the dtype's tolerance
   and, for unquantized KV, the greedy token must be the same at every step (by induction the
   cached and uncached greedy generations are then identical).
Exit 0 only within tolerance. Quantized KV reports its own error and greedy agreement.
A longrope model (Phi-3/4) adds a row whose prompt is longer than original_max_position_embeddings
(long factors from the prompt on) and one that decodes past it (recomputed on the long factors,
as transformers' generate() does): on Phi-3.5 / Phi-4-mini two prompts of about 4K tokens.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvforge.cli import fail_cleanly, progress
from kvforge.manifest import Manifest, ManifestError

# Max abs logit difference allowed against PyTorch fp32, per KV dtype (measured on the presets
# and the trained stdlib model; quantization error scales with the logit range).
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-2, "int8": 0.25, "int8-static": 0.25, "int4": 1.5}
PROMPT_LENGTHS = (13, 8, 3)


@dataclass
class Report:
    kv_dtype: str
    prefill_max_abs_diff: float
    decode_max_abs_diff: float
    greedy_agreement: float
    steps: int
    tolerance: float
    rows: int

    @property
    def max_abs_diff(self) -> float:
        return max(self.prefill_max_abs_diff, self.decode_max_abs_diff)

    @property
    def passed(self) -> bool:
        exact_greedy = self.kv_dtype in ("fp32", "fp16")
        return self.max_abs_diff <= self.tolerance and (self.greedy_agreement == 1.0 or not exact_greedy)


def reference_model(manifest: Manifest):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    source = Path(manifest.source.get("path", ""))
    if not (source / "config.json").is_file():
        raise ManifestError(f"the source checkpoint {source} recorded in the manifest is gone; cannot compare")
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # the reference only checks correctness; one thread never oversubscribes
    config = AutoConfig.from_pretrained(source)
    if config.num_hidden_layers != manifest.model.num_layers:  # a parity slice: the first layers only
        config.num_hidden_layers = manifest.model.num_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:manifest.model.num_layers]
    return AutoModelForCausalLM.from_pretrained(source, config=config, dtype=torch.float32).eval()


def hf_logits(model, tokens: list[int]) -> np.ndarray:
    import torch

    return model(torch.tensor([tokens]), use_cache=False).logits[0].numpy()


def prompt_lengths(manifest: Manifest, steps: int) -> tuple[int, ...]:
    """PROMPT_LENGTHS, and for longrope one prompt past original_max_position_embeddings and one
    that decodes past it within `steps` (kvforge.manifest.ModelSpec.long_factors) when the engine's
    max_seq_len holds them."""
    from runtime.greedy import capacity_needed

    original = manifest.model.longrope_original
    if original is None:
        return PROMPT_LENGTHS
    lengths = PROMPT_LENGTHS + (original + 1, max(1, original + 1 - steps // 2))
    return lengths if capacity_needed(original, lengths, steps) <= manifest.max_seq_len else PROMPT_LENGTHS


def verify(directory: Path, steps: int = 32, seed: int = 0) -> Report:
    from runtime.greedy import Greedy
    from runtime.runners import open_runner

    manifest = Manifest.load(directory)
    piece = manifest.source.get("parity_slice")
    if piece:  # a 7-8B export: its float32 weights and transformers' do not fit in RAM together
        print(f"verifying the export's parity slice: the first {piece['layers']} of {manifest.model.num_layers} "
              f"layers, exported from the same checkpoint by the same code", file=sys.stderr)
        directory = Path(directory) / piece["directory"]
        manifest = Manifest.load(directory)
    reference = reference_model(manifest)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, manifest.model.vocab_size, n).tolist() for n in prompt_lengths(manifest, steps)]
    rows = len(prompts)
    run = Greedy(open_runner(directory), prompts, steps)

    with progress(f"prefill of {rows} rows, lengths {[len(p) for p in prompts]}"):
        logits = run.prefill()
        prefill_diff = max(float(np.abs(logits[r, :len(p)] - hf_logits(reference, p)).max())
                           for r, p in enumerate(prompts))

    decode_diff, agree = 0.0, 0
    sequences = [list(p) for p in prompts]
    with progress(f"{steps} greedy decode steps, each checked against a full recompute without cache"):
        for _ in range(steps):
            tokens = run.next_tokens
            for r in range(rows):
                expected = hf_logits(reference, sequences[r])[-1]
                decode_diff = max(decode_diff, float(np.abs(run.last[r] - expected).max()))
                agree += int(tokens[r] == expected.argmax())
                sequences[r].append(int(tokens[r]))
            run.step()
    return Report(manifest.kv_dtype, prefill_diff, decode_diff, agree / (steps * rows), steps,
                  TOLERANCE[manifest.kv_dtype], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.verify", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps (at least 32 for the gate)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        raise ManifestError("--steps must be positive")
    report = verify(args.directory, args.steps)
    print(f"kv dtype {report.kv_dtype}: max abs logit diff {report.max_abs_diff:.3g} "
          f"(prefill {report.prefill_max_abs_diff:.3g}, decode {report.decode_max_abs_diff:.3g}; "
          f"tolerance {report.tolerance:g}); greedy agreement {report.greedy_agreement:.1%} "
          f"over {report.steps} steps x {report.rows} rows")
    print("PASS" if report.passed else "FAIL")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(fail_cleanly(main))
