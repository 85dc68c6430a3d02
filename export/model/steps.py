"""The two KV layouts as the step a forward call runs: ConcatStep (present = concat(past, new),
right-padded rows) and InplaceStep (packed tokens, fixed-capacity buffers written in place). An
attention module asks its step for the rows of its new K/V, the cache update and the attention
over it, so it reads the same in both layouts."""
from __future__ import annotations

import torch

from export.model.attention import attend, attend_inplace, scatter_into


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

    def attend(self, queries: tuple, buffers: tuple, attention, span_pays_below: tuple[int, int] = (1, 2),
               window: int | None = None, ring: int | None = None) -> torch.Tensor:
        """attention(queries, buffers, core, wide) with core(q, k, v, scale, softcap=) the masked softmax
        (over past + new: there is no decode span to choose, whatever span_pays_below says);
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

    def attend(self, queries: tuple, buffers: tuple, attention, span_pays_below: tuple[int, int] = (1, 2),
               window: int | None = None, ring: int | None = None) -> torch.Tensor:
        """Token-major queries [1, H, T, D_i] over the updated buffers [B, KVH, CAP, D_j] -> [1, H, T, Dv]:
        attention(queries, buffers, core, wide) runs once for the chunk rows (wide: S queries over
        L positions) and once for every row's decode query, core(q, k, v, scale, exporting, softcap=)
        being the causal attention of those rows (window: a sliding layer's, attend_inplace).
        span_pays_below: (n, d), the share of the capacity below which the decode queries take
        their span (a copy) rather than attend over the whole buffer: where copying the span
        costs what attending over the positions it spares costs (1/2 when a position costs the
        same to copy and to attend over; MLA's latent more). ring: the buffers are rings of that
        many cells, which every query attends over whole (a ring is a window and a chunk long: no
        span to cut)."""
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

        # The span is a Slice, a copy: past span_pays_below of the capacity it costs more than the
        # masked positions it spares (measured: the class docstring), so then the decode queries
        # run over the whole buffer. One ONNX If on the span and the capacity.
        share, whole = span_pays_below
        sliced = whole * self.extent[2] <= share * buffers[0].shape[2]
        if ring is not None:
            decode = decode_over(self.extent, *buffers)
        elif not exporting:
            decode = (decode_over_span if sliced else decode_over)(self.extent, *buffers)
        else:  # torch.cond traces its branches with dynamo, which skips torch.onnx.ops unless told not to
            decode = torch.cond(sliced, torch._dynamo.dont_skip_tracing(decode_over_span),
                                torch._dynamo.dont_skip_tracing(decode_over), (self.extent, *buffers))
        heads, width = chunk.shape[1], chunk.shape[-1]
        outputs = torch.cat([chunk.transpose(0, 1).reshape(heads, -1, width),
                             decode.transpose(0, 1).reshape(heads, -1, width)], dim=1)
        return outputs.index_select(1, self.token_slots)[None]
