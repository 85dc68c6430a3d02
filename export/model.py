"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM3, Gemma 2/3, Phi-3/4) and DeepSeek-V2/V3's
Multi-head Latent Attention (MLAAttention, dense layers only), written for export with an explicit KV cache.

Module and parameter names match Hugging Face checkpoints, so a safetensors state dict loads
as is. The cache is passed in and returned as flat tensors in the order the manifest gives
(kvforge.manifest.io_tensors), in one of two layouts:

- concat: present = concat(past, new); the Optimum-compatible contract.
- inplace: fixed-capacity buffers; new K/V are scattered at write_positions (ONNX TensorScatter)
  and attention reads write_positions + seq entries (ONNX Attention with a causal mask built
  from write_positions). Bound to the same memory as input and output, the runtime updates the
  cache in place. The step's tokens come packed (InplaceStep): every projection and MLP sees
  the real tokens only, so decoding rows and a prompt chunk share one step without padding each
  other; only the cache write and attention work per row. Only the tokens in logit_index go
  through the final norm and lm_head: generation samples one per row, so a prefill chunk does
  not pay the lm_head once per token.

During torch.onnx.export the in-place ops are emitted as ONNX opset-24 symbolic ops; eagerly,
the same math runs in torch so parity with Hugging Face can be checked without exporting.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from export import kv_codec
from kvforge.manifest import KVDType, ModelSpec, kv_tensor_names


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one ONNX RMSNormalization op (opset 23) instead of six elementwise ones
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)


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


def rope_rows_to_halves(weight: torch.Tensor, heads: int, width: int, rope: int) -> torch.Tensor:
    """Reorder the rotary output rows of a projection from interleaved pairs (x0, x1, x2, x3, ...)
    to halves (x0, x2, ..., x1, x3, ...): each of `heads` groups of `width` rows ends with `rope`
    rotary rows. Half-split RoPE of the reordered rows equals DeepSeek-V3's interleaved RoPE
    (apply_rotary_pos_emb_interleave: pairs in, halves out) exactly."""
    order = torch.arange(weight.shape[0]).view(heads, width)
    rot = order[:, width - rope:]
    order = torch.cat([order[:, :width - rope], rot[:, 0::2], rot[:, 1::2]], dim=1).flatten()
    return weight[order]


def packed_linear(x: torch.Tensor, layers: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """Several projections of the same input (q/k/v, gate/up) as one MatMul: fewer, larger
    kernels per decode step. The module keeps the weights separate under their Hugging Face
    names; the export folds their Concat into one initializer (export/onnx_export.py)."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    return nn.functional.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)


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


class ConcatStep:
    """The Optimum-compatible step: rows [B, S] right-padded, present = concat(past, new).
    attention_mask [B, T] marks each row's real keys (a shorter row's past has gaps), position_ids
    [B, S] its queries' positions."""

    def __init__(self, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        past = attention_mask.shape[1] - position_ids.shape[1]
        key_index = torch.arange(attention_mask.shape[1])
        query_index = past + torch.arange(position_ids.shape[1])
        causal = key_index[None, :] <= query_index[:, None]  # [S, T]
        self.mask = (causal[None] & (attention_mask[:, None, :] > 0))[:, None]  # [B, 1, S, T] bool
        # the keys' token positions, for windows: a gap in a row's past is not a position
        self.key_positions = attention_mask.cumsum(-1) - 1
        self.query_positions = position_ids

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def update(self, cache: list[torch.Tensor], new: list[torch.Tensor], ring: int | None = None) -> list[torch.Tensor]:
        """ring: the layer keeps only the last `ring` columns of past + new: its past is the last
        columns of attention_mask. What it drops lies at or before each row's first query - window
        while no row has more than max_chunk - 1 padding columns among its last `ring` (the concat
        runner refuses a step that would: OrtConcatRunner._step_all)."""
        joined = [torch.cat((old, fresh), dim=2) for old, fresh in zip(cache, new)]
        return joined if ring is None else [last_columns(x, ring) for x in joined]

    def attend(self, queries: tuple, buffers: tuple, attention, span_always_pays: bool = False,
               window: int | None = None, ring: int | None = None) -> torch.Tensor:
        """attention(queries, buffers, core, wide) with core(q, k, v, scale, softcap=) the masked softmax
        (over past + new: there is no decode span to choose, whatever span_always_pays says);
        window: a sliding layer's (key position > query position - window); ring: the buffers are
        the last columns only (update's ring), so are the mask's and the key positions'."""
        mask, key_positions = self.mask, self.key_positions
        if ring is not None:
            first = mask.shape[-1] - buffers[0].shape[2]
            mask, key_positions = mask[..., first:], key_positions[:, first:]
        if window is not None:
            recent = key_positions[:, None, :] > self.query_positions[:, :, None] - window  # [B, S, T]
            mask = mask & recent[:, None]
        return attention(queries, buffers, lambda q, k, v, scale, exporting=None, softcap=None:
                         attend(q, k, v, mask, scale, softcap), True)


def last_columns(x: torch.Tensor, keep: int) -> torch.Tensor:
    """x [B, H, T, D]'s last min(T, keep) positions: one ONNX Slice from -keep (the exporter would
    guard T against keep and fix it to the example's side)."""
    if not torch.onnx.is_in_onnx_export():
        return x[:, :, -keep:]
    ends = torch.tensor([-keep, torch.iinfo(torch.int64).max, 2])
    return torch.onnx.ops.symbolic("Slice", (x, ends[:1], ends[1:2], ends[2:]), {}, dtype=x.dtype,
                                   shape=(x.shape[0], x.shape[1], torch.sym_min(x.shape[2], keep), x.shape[3]),
                                   version=13)


def leading(buffer: torch.Tensor, ends: torch.Tensor, sizes: tuple, exporting: bool) -> torch.Tensor:
    """A cache buffer [B, KVH, CAP, D]'s first rows and positions (ends = (rows, positions)) or
    first positions (ends = (positions,)) as one ONNX Slice, so one copy of what is kept (chained
    slices, as the exporter writes buffer[:p, :, :span], first copy the p rows at full capacity).
    sizes: the same extents as ints (eager) or the export's symbolic sizes."""
    rows, keys = sizes if len(sizes) == 2 else (buffer.shape[0], sizes[0])
    if not exporting:
        return buffer[:rows, :, :keys]
    axes = torch.arange(0, 3, 2)[-len(sizes):]  # [0, 2] or [2]; a tensor constant here breaks torch.cond
    return torch.onnx.ops.symbolic("Slice", (buffer, ends * 0, ends, axes), {}, dtype=buffer.dtype,
                                   shape=(rows, buffer.shape[1], keys, buffer.shape[3]), version=13)


def take_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [H, T, D] at token indices of any shape -> [H, *index.shape, D]: one ONNX Gather."""
    return x.index_select(1, index.reshape(-1)).view(x.shape[0], *index.shape, x.shape[-1])


class InplaceStep:
    """One in-place step over packed tokens (kvforge.manifest.io_tensors, inplace).

    The model runs on one row of T tokens ([1, T, hidden]): the real tokens of every batch row,
    nothing padded, so the weight matmuls cost what the tokens cost. Only the cache write and
    attention are per row: row_tokens [B, S] names each row's new tokens (padding: any index;
    what it writes lies past the row's length). Rows 0..P-1 are the chunk rows (attention_extent =
    (P, L, D)): their S queries attend over their first L cached positions, a copy of P x L
    entries. Every row's first token also attends as one decode query over the first D positions
    (what the longest decoding row needs: a short stream beside a long prompt does not pay for the
    prompt's capacity). token_slots picks each token's output from
    [chunk outputs (P x S), decode outputs (B)]. Two Attention calls because ONNX Runtime's
    Attention refuses an empty batch and one padded call would cost B x S queries.

    A span is a Slice, a copy, as costly per position on ONNX Runtime CPU as attending over it
    with the mask: so the decode queries take their span only while it is at most half the
    capacity (one If), else the whole buffer. Measured (OrtInplaceRunner.step on these shapes,
    small-llama, 4K context, fp32, 2 threads, idle machine, median of 15 steps after 3, ms;
    before: format 3, decode over the whole buffer, the chunk span as two chained Slices):

        step                                               before   span  span, no If
        1 decode row at 200, capacity 4096 (256: 20.2)      34.2    20.7       -
        a 32-token chunk at 2000 + that row, capacity 4096   69.5    56.0       -
        8 decode rows at 2400, capacity 2560                53.5    52.4     78.7
        4 rows verifying 5 drafted tokens at 2000, 2560      77.1    63.8       -"""

    def __init__(self, write_positions, row_tokens, attention_extent, token_slots):
        self.write_positions, self.row_tokens, self.token_slots = write_positions, row_tokens, token_slots
        rows, span = attention_extent[0].item(), attention_extent[1].item()
        torch._check(rows >= 1)
        torch._check(rows <= row_tokens.shape[0])
        torch._check(span >= 1)
        self.chunk_rows, self.chunk_keys, self.extent = rows, span, attention_extent

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """Token-major [1, H, T, D] -> per row [B, H, S, D]."""
        return take_tokens(x[0], self.row_tokens).transpose(0, 1)

    def update(self, cache: list[torch.Tensor], new: list[torch.Tensor], ring: int | None = None) -> list[torch.Tensor]:
        """ring: the layer's ring cells (its buffers hold position p at p mod ring), else None."""
        return [scatter_into(old, fresh, self.write_positions, ring is not None) for old, fresh in zip(cache, new)]

    def attend(self, queries: tuple, buffers: tuple, attention, span_always_pays: bool = False,
               window: int | None = None, ring: int | None = None) -> torch.Tensor:
        """Token-major queries [1, H, T, D_i] over the updated buffers [B, KVH, CAP, D_j] -> [1, H, T, Dv]:
        attention(queries, buffers, core, wide) runs once for the chunk rows (wide: S queries over
        L positions) and once for every row's decode query, core(q, k, v, scale, exporting, softcap=)
        being the causal attention of those rows (window: a sliding layer's, attend_inplace).
        span_always_pays: the decode span's copy costs less than attending over any position it
        spares (MLA's latent), so no If decides. ring: the buffers are rings of that many cells,
        which every query attends over whole (a ring is a window and a chunk long: no span to cut)."""
        p, span, exporting = self.chunk_rows, self.chunk_keys, torch.onnx.is_in_onnx_export()

        def rows_core(write_positions):
            return lambda q, k, v, scale, exporting=exporting, softcap=None: attend_inplace(
                q, k, v, write_positions, scale, exporting, window, softcap, ring is not None)

        chunk_ends, chunk_sizes = self.extent[:2], (p, span)
        if ring is not None:
            chunk_ends, chunk_sizes = torch.cat([self.extent[:1], torch.tensor([ring])]), (p, ring)
        chunk = attention(tuple(take_tokens(q[0], self.row_tokens[:p]).transpose(0, 1) for q in queries),
                          tuple(leading(b, chunk_ends, chunk_sizes, exporting) for b in buffers),
                          rows_core(self.write_positions[:p]), True)
        newest = tuple(take_tokens(q[0], self.row_tokens[:, :1]).transpose(0, 1) for q in queries)

        def decode_over(extent, *over):
            return attention(newest, over, rows_core(self.write_positions), False)

        def decode_over_span(extent, *over):
            keys = extent[2].item()  # read in the branch: torch.cond takes no unbacked sizes in
            torch._check(keys >= 1)
            return decode_over(extent, *(leading(b, extent[2:], (keys,), exporting) for b in over))

        # The span is a Slice, a copy: past half the capacity it costs more than the masked
        # positions it spares (measured: the class docstring), so then the decode queries run over
        # the whole buffer. One ONNX If on the span and the capacity.
        sliced = 2 * self.extent[2] <= buffers[0].shape[2]
        if ring is not None:
            decode = decode_over(self.extent, *buffers)
        elif span_always_pays:
            decode = decode_over_span(self.extent, *buffers)
        elif not exporting:
            decode = (decode_over_span if sliced else decode_over)(self.extent, *buffers)
        else:  # torch.cond traces its branches with dynamo, which skips torch.onnx.ops unless told not to
            decode = torch.cond(sliced, torch._dynamo.dont_skip_tracing(decode_over_span),
                                torch._dynamo.dont_skip_tracing(decode_over), (self.extent, *buffers))
        heads, width = chunk.shape[1], chunk.shape[-1]
        outputs = torch.cat([chunk.transpose(0, 1).reshape(heads, -1, width),
                             decode.transpose(0, 1).reshape(heads, -1, width)], dim=1)
        return outputs.index_select(1, self.token_slots)[None]


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        bias = spec.attention_bias
        self.q_proj = nn.Linear(spec.hidden_size, spec.num_heads * spec.head_dim, bias=bias)
        self.k_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.v_proj = nn.Linear(spec.hidden_size, spec.num_kv_heads * spec.head_dim, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.output_bias)
        if spec.qk_norm:  # Qwen3: one RMSNormalization over head_dim per head (ORT's fused q/k norm is CUDA-only)
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

        # an absorbed decode query spends 4 H (r + dr) multiply-adds per position, the span's copy
        # (r + dr) elements: the copy always pays
        out = step.attend((q_nope, q_pe), (context,), attention, span_always_pays=True)  # [B, H, S, dv]
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


class MLP(nn.Module):
    """down(act(gate) * up): SiLU (Llama's family) or tanh-approximated GELU (Gemma's, one ONNX Gelu)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gelu = spec.mlp_activation == "gelu_tanh"
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x):
        gate, up = packed_linear(x, [self.gate_proj, self.up_proj])
        gate = nn.functional.gelu(gate, approximate="tanh") if self.gelu else nn.functional.silu(gate)
        return self.down_proj(gate * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP; with spec.sandwich_norms (Gemma 2/3) each branch's output is
    normed too before its residual add: post_attention_layernorm then norms the attention's output
    and pre_/post_feedforward_layernorm wrap the MLP."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = MLAAttention(spec) if spec.attention == "mla" else Attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)
        self.sandwich = spec.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache, kv, step):
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, cache, kv, step)
        if not self.sandwich:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x)), present
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), present


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids, <layout inputs>, *cache) -> (logits, *present), flat for ONNX export."""

    def __init__(self, spec: ModelSpec, layout: str, kv: KVDType):
        super().__init__()
        self.spec, self.layout, self.kv = spec, layout, kv
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.per_layer = len(kv_tensor_names(0, "past_key_values", kv.has_scale_tensors, spec.attention))

    def hold_rings(self, rings: dict[int, int]) -> None:
        """Sliding layers whose cache is a ring: layer -> its cells (kvforge.manifest.layer_rings)."""
        for i, cells in rings.items():
            self.model.layers[i].self_attn.ring = cells

    def forward(self, input_ids: torch.Tensor, *args: torch.Tensor):
        original = self.spec.longrope_original
        if self.layout == "concat":
            attention_mask, position_ids, *rest = args
            step = ConcatStep(attention_mask, position_ids)
        else:
            positions, write_positions, row_tokens, attention_extent, token_slots, logit_index, *rest = args
            step = InplaceStep(write_positions, row_tokens, attention_extent, token_slots)
            input_ids, position_ids = input_ids[None], positions[None]  # one row of packed tokens
        long = None
        if original is not None:  # prompt_lengths: [B] (concat) or [T] (inplace), read as ModelSpec.long_factors says
            prompt_lengths, *cache = rest
            long = (prompt_lengths[:, None] if self.layout == "concat" else prompt_lengths[None]) > original
            long = long.expand(position_ids.shape)
        else:
            cache = rest
        rope = rope_cos_sin(position_ids, self.spec, long=long)
        local_rope = rope_cos_sin(position_ids, self.spec, local=True) if self.spec.local_rope_theta else rope

        x = self.model.embed_tokens(input_ids)
        if self.spec.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden), rounded to float32 as transformers does
            x = x * torch.tensor(self.spec.embedding_multiplier, dtype=x.dtype)
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = list(cache[i * self.per_layer:(i + 1) * self.per_layer])
            cos, sin = local_rope if i in self.spec.sliding_layers else rope
            x, present = layer(x, cos, sin, layer_cache, self.kv, step)
            presents += present
        if self.layout == "inplace":
            # [K, hidden]: one Gather, so one graph serves generation (one token per row) and scoring
            # (every token). Measured (`bench.prefill.profile_step`, small-llama-32k, 1,024 tokens):
            # the lm_head generation skips took 17% of the step; a second graph for scoring would
            # hold a second copy of the weights on disk and in every session.
            x = x[0].index_select(0, logit_index)
        logits = self.lm_head(self.model.norm(x))
        if self.spec.logit_softcap:  # Gemma 2
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return (logits, *presents)
