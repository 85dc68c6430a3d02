"""python -m export.train --out DIR [--architecture llama|mla]: train the small model the quality benchmarks need.

Random weights give nearly flat logits, so KV-dtype and weight-quantization quality can only be
judged on a model that has learned something. This trains one, reproducibly and offline, on the
Python standard library's own top-level source files (every machine has them), with the
tiny-llama tokenizer, holding out every HOLDOUT_EVERY-th file for perplexity. Fixed seeds, one
thread, a fixed number of steps: the same Python version gives the same weights.

`--architecture mla` trains a DeepSeek-V3-style model of the same width instead (Multi-head
Latent Attention, dense layers), so the latent cache's KV dtypes are judged on a model that has
learned something too; it is made on demand (bench section mla), not committed.

The result is an ordinary Hugging Face checkpoint directory (config.json, model.safetensors in
fp16, tokenizer files) plus training.json with the held-out perplexity of the saved weights.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from export.model import CausalLM, build_model
from export.presets import PRESETS, hf_config, random_weights, stdlib_corpus, train_tokenizer, write_tokenizer
from kvforge.cli import atomic_directory
from kvforge.manifest import KV_DTYPES, ModelSpec

TOKENIZER_PRESET = "tiny-llama"
# Ten minutes of one core is ~2M tokens: a narrow model (1.8M parameters) learns more from them
# than the 3.8M-parameter width-256 one did (measured: lower loss at equal time).
ARCHITECTURE = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=344, vocab_size=PRESETS[TOKENIZER_PRESET]["vocab_size"],
                    max_position_embeddings=2048)
# DeepSeek-V3's proportions scaled to that width: kv_lora_rank = hidden / 2 (512 of 7168 is 1/14,
# but a rank of 9 would say little), q_lora_rank 3/4 of hidden, nope = v = 2 x rope head dims.
# rope_interleave off: the trained weights are in the half-split order the graph runs.
MLA_ARCHITECTURE = dict(ARCHITECTURE, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
                        qk_rope_head_dim=16, v_head_dim=32, head_dim=16, rope_interleave=False,
                        first_k_dense_replace=4, n_routed_experts=None)
ARCHITECTURES = {"llama": (ARCHITECTURE, 1100), "mla": (MLA_ARCHITECTURE, 400)}  # (config, default steps)
SEED = 0
HOLDOUT_EVERY = 10  # files 9, 19, 29, ... of the sorted stdlib listing are never trained on
CORPUS_BYTES = 64 << 20  # more than the stdlib's top level holds: take every file
SEQ_LEN = 512
BATCH = 4
LR, MIN_LR_FRACTION, WARMUP = 4e-3, 0.1, 50
EVAL_WINDOW = 512  # tokens per held-out perplexity window (the benchmarks' too)


def split_corpus() -> tuple[list[str], list[str]]:
    texts = stdlib_corpus(CORPUS_BYTES)
    train = [t for i, t in enumerate(texts) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    held = [t for i, t in enumerate(texts) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return train, held


def token_stream(tokenizer, texts: list[str], eos: int) -> np.ndarray:
    """All files' tokens end to end, each file closed by eos."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids += enc.ids + [eos]
    return np.asarray(ids, dtype=np.int64)


def held_out_tokens(checkpoint: Path) -> np.ndarray:
    """The held-out token stream for a checkpoint's own tokenizer (used by the benchmarks too)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    eos = json.loads((Path(checkpoint) / "config.json").read_text())["eos_token_id"]
    return token_stream(tokenizer, split_corpus()[1], eos)


def eval_windows(stream: np.ndarray, count: int | None, window: int = EVAL_WINDOW) -> np.ndarray:
    """The first `count` (None: all) consecutive non-overlapping windows of window + 1 tokens
    from the held-out stream, for the benchmarks: perplexity()'s windows, less its last partial one."""
    available = (len(stream) - 1) // window
    n = available if count is None else min(count, available)
    return np.stack([stream[i * window:i * window + window + 1] for i in range(n)])


def forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a plain causal forward: the concat layout over an empty past."""
    b, s = ids.shape
    spec = model.spec
    empty = torch.zeros(b, spec.num_kv_heads, 0, spec.head_dim)
    cache = [empty] * (model.per_layer * spec.num_layers)
    positions = torch.arange(s).expand(b, s)
    return model(ids, torch.ones(b, s, dtype=torch.int64), positions, *cache)[0]


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def perplexity(model: CausalLM, stream: np.ndarray, window: int = EVAL_WINDOW) -> float:
    """exp(mean next-token NLL) over consecutive non-overlapping windows of the stream."""
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, window):
        chunk = torch.from_numpy(stream[start:start + window + 1])[None]
        if chunk.shape[1] < 2:
            break
        logits = forward(model, chunk[:, :-1])
        nll = torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum")
        total, count = total + float(nll), count + chunk.shape[1] - 1
    return math.exp(total / count)


def train(out: Path, steps: int | None = None, architecture: str = "llama") -> dict:
    torch.manual_seed(SEED)
    torch.set_num_threads(1)
    shape, default_steps = ARCHITECTURES[architecture]
    steps = default_steps if steps is None else steps
    config = {**hf_config(TOKENIZER_PRESET), **shape, "torch_dtype": "float16"}
    spec = ModelSpec.from_hf_config(config)
    tokenizer = train_tokenizer(spec.vocab_size)
    train_texts, held_texts = split_corpus()
    train_ids = token_stream(tokenizer, train_texts, config["eos_token_id"])
    held_ids = token_stream(tokenizer, held_texts, config["eos_token_id"])
    print(f"[train] {len(train_texts)} files / {len(train_ids)} tokens to train on, "
          f"{len(held_texts)} files / {len(held_ids)} tokens held out", file=sys.stderr, flush=True)

    model = build_model(spec, "concat", KV_DTYPES["fp32"])
    model.load_state_dict(random_weights(spec, config["initializer_range"]))
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in model.named_parameters() if p.dim() <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    rng = np.random.default_rng(SEED)
    started, losses = time.perf_counter(), []
    for step in range(steps):
        starts = rng.integers(0, len(train_ids) - SEQ_LEN - 1, size=BATCH)
        batch = torch.from_numpy(np.stack([train_ids[s:s + SEQ_LEN + 1] for s in starts]))
        logits = forward(model, batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, spec.vocab_size), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps)
        optimizer.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"[train] step {step + 1}/{steps} loss {np.mean(losses[-100:]):.3f} "
                  f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    train_seconds = time.perf_counter() - started

    # Report the quality of what is saved: the fp16-rounded weights.
    model.eval()
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    model.load_state_dict({k: v.float() for k, v in state.items()})
    ppl = perplexity(model, held_ids)
    report = {"held_out_perplexity": round(ppl, 3), "eval_window_tokens": EVAL_WINDOW,
              "held_out_files": len(held_texts), "held_out_tokens": int(len(held_ids)),
              "train_files": len(train_texts), "train_tokens": int(len(train_ids)),
              "tokens_seen": steps * BATCH * SEQ_LEN, "steps": steps, "batch": BATCH, "seq_len": SEQ_LEN,
              "lr": LR, "seed": SEED, "final_loss": round(float(np.mean(losses[-100:])), 4),
              "train_seconds": round(train_seconds, 1), "threads": 1,
              "parameters": sum(v.numel() for v in state.values()),
              "python": sys.version.split()[0], "torch": torch.__version__}

    with atomic_directory(out) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_tokenizer(tokenizer, tmp)
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[train] held-out perplexity {ppl:.2f} after {train_seconds:.0f} s; wrote {out}", file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export.train", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/stdlib-llama"))
    parser.add_argument("--architecture", default="llama", choices=list(ARCHITECTURES),
                        help="llama: the committed default model; mla: a DeepSeek-V3-style one")
    parser.add_argument("--steps", type=int, default=None,
                        help=f"optimizer steps (default {', '.join(f'{k} {v[1]}' for k, v in ARCHITECTURES.items())}: "
                             "the llama one is what is committed)")
    args = parser.parse_args(argv)
    train(args.out, args.steps, args.architecture)
    return 0


if __name__ == "__main__":
    sys.exit(main())
