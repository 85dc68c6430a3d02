"""Multi-head Latent Attention (DeepSeek-V2/V3, MiniCPM3: export.model.deepseek): the attention module over
a latent cache, and its absorbed and decompressed paths with the rule choosing between them."""
from __future__ import annotations

import torch
from torch import nn

from export import kv_codec
from export.model.layers import RMSNorm, packed_linear
from export.model.rope import apply_rotary
from kvforge.manifest import KVDType, ModelSpec


class MLAAttention(nn.Module):
    """DeepSeek-V2/V3 Multi-head Latent Attention over a latent cache, absorbed.

    The cache holds per token one latent [c_kv | k_pe] of width r + dr (r = kv_lora_rank,
    dr = qk_rope_head_dim): c_kv after kv_a_layernorm, k_pe roped, as Hugging Face's cache holds
    them (keys, values). Attention never decompresses the context: W_UK (kv_b_proj's key rows) is
    folded into the query, q_lat = q_nope @ W_UK, so the H query heads [q_lat | q_pe] (width r + dr)
    attend over K = V = the one latent head, and q_lat . c_kv + q_pe . k_pe equals Hugging Face's
    q_nope . (W_UK c_kv) + q_pe . k_pe. The output's first r channels are sum(p * c_kv); W_UV
    (kv_b_proj's value rows) maps them to the heads' values afterwards (its last dr channels,
    sum(p * k_pe), are dropped): exact up to float reassociation, with no per-step work that grows
    with the context beyond the attention itself.

    Chunks that decompresses(spec, width, key span) gives fewer multiply-adds decompressed run
    decompressed instead, as vLLM's and TensorRT-LLM's prefill do: per-head K/V = kv_b_proj(c_kv)
    over the chunk's span, then standard attention. A fresh prompt's span is its width, so every
    fresh chunk decompresses; over P cached tokens from 141 at P = 1,024 (158 over a long context)
    at DeepSeek-V3's dims. One ONNX If on the chunk's width and key span picks the branch
    (mla_attention), so one graph, one copy of the weights and the same cache buffers serve both,
    and the engine and runners do not choose anything. Measured (`python -m bench --sections mla`,
    two runs: one layer of V3's attention, hidden 2048, fp32, ONNX Runtime 1.32, 2 threads, idle
    machine; one step of W tokens onto P cached ones, median of 3, ms, run 1 / run 2):

        W     P=0: absorbed   decompressed   P=1024: absorbed   decompressed    shipped graph
        16         101 / 45      55 / 37             85 / 51      191 / 150        67 / 50
        64          97 / 71      80 / 67            172 / 133     238 / 205       162 / 117
        128        148 / 124    135 / 115           285 / 233     336 / 253       314 / 242
        160        224 / 164    165 / 137           380 / 311     329 / 318       348 / 303
        256        294 / 289    274 / 282           621 / 498     514 / 628       496 / 438
        512        760 / 642    548 / 466          1203 / 1059    889 / 731       911 / 848
        1024      2339 / 1993  1630 / 1146         4277 / 3762   3742 / 2733     4146 / 2794

    Decompressed wins every fresh chunk (1.02-1.84x) and, over 1,024 cached tokens, loses 2-3x
    below 64 and wins 1.35-1.45x from 512; between 128 and 256 the two are within each other's
    noise (0.79-1.15x across the runs), so the count's 141 stands. The shipped graph follows
    the faster path within that noise (its fastest of 5 steps equals the decompressed graph's
    at 512 and 1,024 fresh tokens). Decode stays absorbed: decompressed it ran 11.6 / 9.7 vs
    38.8 / 38.6 tokens/s at 512 context, 1.4 vs 16.3 / 19.7 at 4,096."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        h, hidden, bias = spec.num_heads, spec.hidden_size, spec.attention_bias
        self.heads, self.r, self.dr = h, spec.kv_lora_rank, spec.qk_rope_head_dim
        self.dn, self.dv = spec.qk_nope_head_dim, spec.v_head_dim
        qk = self.dn + self.dr
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, spec.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, 1e-6)  # Hugging Face's default eps, not the config's
            self.q_b_proj = nn.Linear(spec.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, h * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(h * self.dv, hidden, bias=bias)
        self.interleaved = spec.rope_interleave == "pairs"  # pairs-to-halves was permuted at load
        # "auto": as decompresses() says; "absorbed" / "decompressed": always (bench section mla times each alone)
        self.path = "auto"

    def forward(self, x, cos, sin, cache: list[torch.Tensor], kv: KVDType,
                step: "ConcatStep | InplaceStep") -> tuple[torch.Tensor, list[torch.Tensor]]:
        b, s, _ = x.shape
        if self.spec.q_lora_rank is None:
            q = self.q_proj(x)
            compressed = self.kv_a_proj_with_mqa(x)
        else:
            q_a, compressed = packed_linear(x, [self.q_a_proj, self.kv_a_proj_with_mqa])
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(b, s, self.heads, self.dn + self.dr).transpose(1, 2)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        c_kv, k_pe = compressed.split([self.r, self.dr], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)[:, None]  # [B, 1, S, r]
        q_pe = apply_rotary(q_pe, cos, sin, self.interleaved)
        k_pe = apply_rotary(k_pe[:, None], cos, sin, self.interleaved)  # [B, 1, S, dr]
        latent = torch.cat([c_kv, k_pe], dim=-1)

        # int8: per-token scales for c_kv and k_pe apart (latent_scale [B, 1, S, 2])
        present = step.update(cache, kv_codec.encode(step.rows(latent), kv, parts=(self.r, self.dr)))
        context = kv_codec.decode(present, kv, parts=(self.r, self.dr))  # [B, 1, T, r + dr]
        w = self.kv_b_proj.weight.view(self.heads, self.dn + self.dv, self.r)
        exporting = torch.onnx.is_in_onnx_export()

        def attention(queries, buffers, core, wide):
            (q_nope, q_pe), (latent,) = queries, buffers
            if self.path != "auto":
                decompress = self.path == "decompressed"
            else:  # a decode query stays absorbed; a wide step as the multiply-adds say
                decompress = decompresses(self.spec, q_nope.shape[2], latent.shape[2]) if wide else False
            return mla_attention(decompress, self.spec, q_nope, q_pe, latent, w, core, exporting)

        # An absorbed decode query attends H queries over each position's r + dr latent, the span's
        # copy moves r + dr elements: measured (bench.long_decode's MLA model, 8 heads, 32K keys,
        # ONNX Runtime's profiler) Attention 88 ms and the span's Slice 29 ms a step, so attending
        # costs ~3x copying a position and the span pays below 3/4 of the capacity. Always
        # copied, as before 2026-12-08, the Slice was 21-24% of the step's kernel time.
        out = step.attend((q_nope, q_pe), (context,), attention, span_pays_below=(3, 4))  # [B, H, S, dv]
        out = out.transpose(1, 2).reshape(b, s, self.heads * self.dv)
        return self.o_proj(out), present


def decompresses(spec: ModelSpec, width, context):
    """Whether a chunk of `width` queries over `context` positions (its key span: the chunk rows'
    longest end, which attention and decompression both run over) costs fewer multiply-adds per
    head decompressed: decompressing spends context x r (dn + dv), absorbing width x r (dn + dv)
    (W_UK into the query, W_UV after) plus width x context x (2 (r + dr) - (dn + dr) - dv) more in
    the attention. A fresh chunk (context = width) always decompresses. Ints or
    the export's symbolic sizes (then a symbolic bool, the If's condition). For a long context it
    decompresses from width r (dn + dv) / (2 (r + dr) - (dn + dr) - dv): 158 at DeepSeek-V3's dims."""
    folded = spec.kv_lora_rank * (spec.qk_nope_head_dim + spec.v_head_dim)
    extra = 2 * (spec.kv_lora_rank + spec.qk_rope_head_dim) - spec.qk_head_dim - spec.v_head_dim
    return (context - width) * folded < width * context * extra


def mla_attention(decompress, spec: ModelSpec, q_nope, q_pe, context, w, core, exporting: bool):
    """MLA attention of q_nope [B, H, S, dn] and q_pe [B, H, S, dr] over the latent context
    [B, 1, T, r + dr], w = kv_b_proj's weight [H, dn + dv, r] -> [B, H, S, dv], absorbed or
    decompressed as `decompress` says: a Python bool eagerly, a symbolic one when exporting, which
    becomes one ONNX If on the step's width and key span (one graph and one copy of the weights
    serve both). core(q, k, v, scale, exporting): the step's attention over those rows.
    exporting: read by the caller outside every torch.cond (in their branches dynamo answers
    is_in_onnx_export() with False; the decode span's is one)."""
    r, dn = spec.kv_lora_rank, spec.qk_nope_head_dim

    def absorbed(q_nope, q_pe, context, w):
        # w's sizes are symbolic inside a torch.cond branch (the decode span's If): said here, its
        # output's are exact, as torch.cond requires of both branches
        torch._check(w.shape[1] == dn + spec.v_head_dim)
        w_uk, w_uv_t = w[:, :dn], w[:, dn:].transpose(1, 2)  # [H, dn, r], [H, r, dv]
        out = core(torch.cat([q_nope @ w_uk, q_pe], dim=-1), context, context, spec.attention_scale, exporting)
        return out[..., :r] @ w_uv_t

    def decompressed(q_nope, q_pe, context, w):
        c_kv, k_pe = context.split([r, spec.qk_rope_head_dim], dim=-1)
        k_nope, v = (c_kv @ w.transpose(1, 2)).split([dn, spec.v_head_dim], dim=-1)  # [B, H, T, dn | dv]
        key = torch.cat([k_nope, k_pe.expand(-1, w.shape[0], -1, -1)], dim=-1)
        return core(torch.cat([q_nope, q_pe], dim=-1), key, v, spec.attention_scale, exporting)

    if isinstance(decompress, bool) or not exporting:
        return (decompressed if decompress else absorbed)(q_nope, q_pe, context, w)
    # torch.cond traces its branches with dynamo, which skips torch.onnx.ops (the symbolic
    # Attention op) unless told not to
    branches = [torch._dynamo.dont_skip_tracing(f) for f in (decompressed, absorbed)]
    return torch.cond(decompress, *branches, (q_nope, q_pe, context, w))
