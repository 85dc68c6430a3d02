"""Rotary position embeddings: the frequencies of every scaling kvforge reads (default, linear,
llama3, yarn, longrope; a partial rotary width; Gemma 3's local RoPE), their cos/sin tables and the
rotation itself (one ONNX RotaryEmbedding). A layer without RoPE (SmolLM3's NoPE layers) just
skips apply_rotary (export.model.attention.Attention)."""
from __future__ import annotations

import math

import torch

from kvforge.manifest import ModelSpec


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate x [B, H, S, D] with Hugging Face's half-split convention (interleaved: consecutive
    pairs, DeepSeek-V2's complex form): one ONNX RotaryEmbedding op (opset 23) instead of a dozen
    slices and elementwise ops per call. The 4-D form is the one TensorRT's IRotaryEmbeddingLayer
    documents. Training (export.train) takes the same math in plain torch ops: torch registers no
    autograd formula for the ONNX op. cos/sin narrower than D/2 rotate only the first 2 x their
    width channels (Phi-3's partial_rotary_factor: rotary_embedding_dim)."""
    if x.requires_grad:
        return rotate(x, cos, sin, interleaved)
    rotary = 2 * cos.shape[-1]
    return torch.onnx.ops.rotary_embedding(x, cos, sin, interleaved=interleaved,
                                           rotary_embedding_dim=rotary if rotary < x.shape[-1] else 0)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """What ONNX RotaryEmbedding computes, differentiably: x [B, H, S, D], cos/sin [B, S, D/2]."""
    cos, sin = cos[:, None], sin[:, None]
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    rotated = (first * cos - second * sin, second * cos + first * sin)
    return torch.stack(rotated, dim=-1).flatten(-2) if interleaved else torch.cat(rotated, dim=-1)


def rope_frequencies(spec: ModelSpec, local: bool = False, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] of the rotary channels (head_dim; MLA: qk_rope_head_dim) and the
    factor cos/sin are multiplied by: plain RoPE, or the scaling spec.rope_scaling names, computed
    as transformers 5.24's modeling_rope_utils does (the same float32 ops, so the same bits):
    linear divides every frequency by the factor; llama3 divides the low frequencies (wavelength
    beyond original / low_freq_factor) by it, keeps the high ones (below original /
    high_freq_factor) and blends between; yarn blends interpolated and extrapolated frequencies
    over a ramp of channels and scales cos/sin by its attention factor (mscale); longrope divides
    each frequency by its entry of short_factor (long: long_factor) and scales cos/sin by
    sqrt(1 + ln(factor) / ln(original)). local: the sliding layers' own unscaled RoPE of base
    spec.local_rope_theta (Gemma 3)."""
    dim = spec.rotary_dim
    base, rope, kind = spec.rope_theta, spec.rope_scaling or {}, spec.rope_type
    if local:
        base, kind = spec.local_rope_theta, "default"
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim)
    inv_freq = 1.0 / pos_freqs
    if kind == "default":
        return inv_freq, 1.0
    factor = rope["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    original = rope["original_max_position_embeddings"]
    if kind == "longrope":
        divisors = torch.tensor(rope["long_factor" if long else "short_factor"], dtype=torch.float32)
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return 1.0 / (divisors * pos_freqs), float(attention_factor)
    if kind == "llama3":
        low, high = rope["low_freq_factor"], rope["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < original / high) * ~(wavelen > original / low)
        return torch.where(medium, smoothed, scaled), 1.0

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        if rope.get("mscale") and rope.get("mscale_all_dim"):
            attention_factor = float(get_mscale(factor, rope["mscale"]) / get_mscale(factor, rope["mscale_all_dim"]))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(positions: torch.Tensor, spec: ModelSpec, local: bool = False,
                 long: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, D/2] for integer positions [B, S] (yarn's and longrope's attention factor
    applied to both, as transformers applies it); local: rope_frequencies'. long [B, S] bool:
    longrope's long factors for those tokens, the short ones elsewhere (one Where between the two
    constant frequency sets, so rows of one batch may differ)."""
    inv_freq, factor = rope_frequencies(spec, local)
    if long is not None:
        inv_freq = torch.where(long[..., None], rope_frequencies(spec, long=True)[0], inv_freq)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    if factor == 1.0:
        return freqs.cos(), freqs.sin()
    return freqs.cos() * factor, freqs.sin() * factor
