"""Attention: the masked-softmax cores (concat: over past + new; in place: over a fixed-capacity
buffer, its ring or its window, as one ONNX Attention, softcap included), the cache write (one ONNX
TensorScatter) and the attention module of the Llama-shaped families (MHA, GQA, MQA with q/k/v
biases, Qwen3's and Gemma 3's q/k norms, NoPE layers, windows, softcaps, int8 KV scales)."""
from __future__ import annotations

import torch
from torch import nn

from export import kv_codec
from export.model.layers import RMSNorm, packed_linear
from export.model.rope import apply_rotary
from kvforge.manifest import KVDType, ModelSpec


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor,
           scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of q [B, H, S, D] over k/v [B, KVH, T, D]; allowed [B, 1, S, T] bool.
    scale: the softmax scale (default 1/sqrt(D)); softcap: scores -> softcap * tanh(scores / softcap)
    before the mask (Gemma 2), as ONNX Attention's softcap does."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # A finite fill keeps fully masked (padding) rows NaN-free.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def scatter_into(buffer: torch.Tensor, update: torch.Tensor, write_positions: torch.Tensor,
                 ring: bool = False) -> torch.Tensor:
    """Write update [B, H, S, X] into buffer [B, H, CAP, X] at write_positions[b] along dim 2;
    ring: at (write_positions[b] + i) mod CAP (TensorScatter's circular mode). Measured on ONNX
    Runtime 1.32 with the same OrtValue bound as input and output: circular writes in place as
    linear does (same data pointer, the caller's buffer holds the update, 0.03-0.1 ms per write
    at 1,024 positions as at 262,144 on a busy machine: no copy of the buffer)."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "TensorScatter", (buffer, update, write_positions), {"axis": -2, "mode": "circular" if ring else "linear"},
            dtype=buffer.dtype, shape=buffer.shape, version=24)
    b, h, s, x = update.shape
    cells = write_positions[:, None] + torch.arange(s)
    index = (cells % buffer.shape[2] if ring else cells)[:, None, :, None].expand(b, h, s, x)
    return buffer.clone().scatter_(2, index, update)


def attend_inplace(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, write_positions: torch.Tensor,
                   scale: float | None = None, exporting: bool | None = None, window: int | None = None,
                   softcap: float | None = None, ring: bool = False) -> torch.Tensor:
    """Causal attention over a fixed-capacity cache whose row b holds write_positions[b] + S entries.
    exporting: emit ONNX Attention (default: whether torch.onnx is exporting; inside torch.cond's
    branches dynamo answers that with False, so MLA reads it outside and passes it in).
    window: a sliding-window layer's W: query i keeps key j only when i - W < j <= i, as
    transformers masks it (buffer position = token position in this layout). Stays in the
    boolean mask, not opset 25's left_window_size, which would move the whole graph to opset 25
    (TensorRT's parser takes 9-24) and counts keys by buffer position, which a ring or compacted
    window buffer breaks. softcap: as attend's (ONNX Attention's softcap, applied before the mask).
    ring: k/v are a sliding layer's ring of R cells (scatter_into's ring): for query i, cell c holds
    position i - ((i - c) mod R), the newest one at or before i that lands there, so the mask keeps
    it when that lies in the window and at or after 0 (a cell holding a later position of the same
    step reads as one R older, outside the window: kvforge.manifest.ring_tokens' R guarantees it).

    The limit goes in as an explicit boolean mask rather than Attention's nonpad_kv_seqlen input:
    the TensorRT ONNX parser rejects nonpad_kv_seqlen, and on ONNX Runtime CPU both cost the same
    (measured: small-llama decode at capacity 256..4096, batch 1 and 8, within noise).

    One query per row (decode) with fewer KV heads than query heads goes in grouped: the G query
    heads that share a KV head become G queries of that head (same position, same mask), because
    ONNX Runtime CPU's Attention reads the cached keys and values once per query head. Measured
    (one Attention alone, Q 16 heads, K/V 4 heads of 64, batch 1, 2 threads, median of 300 runs):
    35 -> 27 us over 128 keys, 272 -> 159 us over 2,048."""
    key_index = torch.arange(k.shape[2])
    query_pos = write_positions[:, None] + torch.arange(q.shape[2])  # [B, S]
    if ring:  # how far back the key is: (i - c) mod R, computed on i - c + R >= 0
        back = (query_pos[:, :, None] - key_index[None, None, :] + k.shape[2]) % k.shape[2]
        allowed = (back < window) & (back <= query_pos[:, :, None])
    else:
        allowed = key_index[None, None, :] <= query_pos[:, :, None]
        if window is not None:
            allowed = allowed & (key_index[None, None, :] > query_pos[:, :, None] - window)
    allowed = allowed[:, None]  # [B, 1, S, CAP]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if not (torch.onnx.is_in_onnx_export() if exporting is None else exporting):
        return attend(q, k, v, allowed, scale, softcap)
    attributes = {"scale": scale, **({"softcap": float(softcap)} if softcap else {})}
    rows, heads, queries, width = q.shape
    groups = heads // k.shape[1]
    if not (isinstance(queries, int) and queries == 1 and groups > 1):
        return torch.onnx.ops.symbolic("Attention", (q, k, v, allowed), attributes,
                                       dtype=q.dtype, shape=(*q.shape[:3], v.shape[-1]), version=24)
    grouped = torch.onnx.ops.symbolic(
        "Attention", (q.reshape(rows, k.shape[1], groups, width), k, v, allowed.expand(-1, -1, groups, -1)),
        attributes, dtype=q.dtype, shape=(rows, k.shape[1], groups, v.shape[-1]), version=24)
    return grouped.reshape(rows, heads, 1, v.shape[-1])


class Attention(nn.Module):
    """The Llama-shaped families' attention: q/k/v projections (attention_bias; Qwen2's o_proj
    without), q/k RMSNorm per head before RoPE (Qwen3, Gemma 3), RoPE (none on SmolLM3's NoPE
    layers), then the step's attention (export.model.steps) over the updated cache with the
    layer's window or ring, the softmax scale (Gemma's query_pre_attn_scalar) and softcap."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.output_bias)
        if spec.qk_norm:  # one RMSNormalization over head_dim per head (ORT's fused q/k norm is CUDA-only)
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.rope = layer not in spec.nope_layers
        self.window = spec.sliding_window if layer in spec.sliding_layers else None
        self.ring: int | None = None  # CausalLM.hold_rings: this layer's ring cells
        self.scale, self.softcap = spec.attention_scale, spec.attention_softcap
        # int8-static KV: calibrated per-channel scales (export/calibrate.py); not checkpoint weights
        scale_shape = (1, spec.num_kv_heads, 1, spec.head_dim)
        self.register_buffer("k_scale", torch.ones(scale_shape), persistent=False)
        self.register_buffer("v_scale", torch.ones(scale_shape), persistent=False)

    def forward(self, x, cos, sin, cache: list[torch.Tensor], kv: KVDType,
                step: "ConcatStep | InplaceStep") -> tuple[torch.Tensor, list[torch.Tensor]]:
        b, s, _ = x.shape
        q, k, v = packed_linear(x, [self.q_proj, self.k_proj, self.v_proj])
        q, k = q.view(b, s, self.heads, self.head_dim), k.view(b, s, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:  # SmolLM3's NoPE layers attend without positions
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

        new_k = kv_codec.encode(step.rows(k), kv, self.k_scale)
        new_v = kv_codec.encode(step.rows(v), kv, self.v_scale)
        # cache order per layer: key, value[, key_scale, value_scale] (kvforge.manifest)
        present = step.update(cache, [new_k[0], new_v[0]] + ([new_k[1], new_v[1]] if len(new_k) > 1 else []),
                              self.ring)
        scales = len(present) > 2
        k_all = kv_codec.decode([present[0]] + ([present[2]] if scales else []), kv, self.k_scale)
        v_all = kv_codec.decode([present[1]] + ([present[3]] if scales else []), kv, self.v_scale)
        out = step.attend((q,), (k_all, v_all),
                          lambda qs, kvs, core, wide: core(qs[0], *kvs, self.scale, softcap=self.softcap),
                          window=self.window, ring=self.ring)
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.o_proj(out), present
