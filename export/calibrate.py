"""Static KV scales for the int8-static cache: the largest |K| and |V| of every layer, KV head
and channel over calibration text, divided by 127.

Per channel because keys carry a few large channels (rotary pairs) that a per-tensor scale
would let dominate. The text is the Python standard library's own source (on every machine,
offline), tokenized with the checkpoint's tokenizer; values beyond the calibrated range clip.
"""
from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from export.model import CausalLM, build_model
from export.presets import stdlib_corpus
from kvforge.manifest import KV_DTYPES

CALIBRATION_TOKENS = 2048
CALIBRATION_BYTES = 64 << 10  # enough source text for CALIBRATION_TOKENS with any tokenizer
QMAX = 127.0


def calibration_ids(checkpoint: Path, tokens: int = CALIBRATION_TOKENS) -> torch.Tensor:
    """[1, tokens] ids of the first standard library files (export/train.py trains on these too;
    its held-out files come later in the same order)."""
    tokenizer = Tokenizer.from_file(str(Path(checkpoint) / "tokenizer.json"))
    ids: list[int] = []
    for text in stdlib_corpus(CALIBRATION_BYTES):
        ids += tokenizer.encode(text).ids
        if len(ids) >= tokens:
            break
    return torch.tensor([ids[:tokens]])


@torch.no_grad()
def calibrate(model: CausalLM, ids: torch.Tensor) -> dict:
    """Set every layer's k_scale/v_scale from one fp32 pass over ids; returns the provenance
    recorded in the manifest."""
    reference = build_model(model.spec, "concat", KV_DTYPES["fp32"])
    reference.load_state_dict(model.state_dict())
    spec, length = model.spec, ids.shape[1]
    empty = [torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim)] * (2 * spec.num_layers)
    _, *presents = reference.eval()(ids, torch.ones_like(ids), torch.arange(length)[None], *empty)
    for i, layer in enumerate(model.model.layers):
        for name, present in (("k_scale", presents[2 * i]), ("v_scale", presents[2 * i + 1])):
            amax = present.abs().amax(dim=(0, 2), keepdim=True)
            getattr(layer.self_attn, name).copy_(amax.clamp_min(torch.finfo(torch.float32).tiny) / QMAX)
    return {"text": "Python standard library source (export/calibrate.py)", "tokens": length,
            "granularity": "layer x KV head x channel", "statistic": "max |value| / 127"}
