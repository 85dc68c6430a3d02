"""How K/V values are stored in the cache for each KV dtype: encode on write, decode on read.

Written in plain torch ops so the same code runs eagerly (parity) and exports to ONNX ops that
ONNX Runtime CPU runs (ReduceMax, Div, Round, Clip, Cast). fp8 is the exception: it exports
as QuantizeLinear/DequantizeLinear (what TensorRT's strongly typed networks need) and its eager
path emulates them.
"""
from __future__ import annotations

import torch

from kvforge.manifest import FP8_SCALE, KVDType

_SMALLEST_SCALE = 2.0 ** -24  # the smallest positive fp16: a zero vector must not divide by zero


def encode(x: torch.Tensor, kv: KVDType, static_scale: torch.Tensor | None = None,
           parts: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """[B, H, S, D] float -> the tensors stored in the cache (values, and a scale if any).
    static_scale [1, H, 1, D]: the calibrated scales of int8-static (export/calibrate.py).
    parts: channel widths summing to D that get a per-token scale each, [B, H, S, len(parts)]
    (MLA's latent: c_kv and k_pe differ in range, so one scale would crush the smaller); None: one."""
    if kv.name == "fp32":
        return [x]
    if kv.name == "fp16":
        return [x.to(torch.float16)]
    if kv.name == "fp8":
        return [_fp8_quantize(x)]
    if kv.name == "int8-static":
        return [torch.round(x / static_scale).clamp(-127.0, 127.0).to(torch.int8)]
    qmax = 127.0 if kv.name == "int8" else 7.0
    pieces = _split(x, parts)
    # quantize with the scale as stored (fp16), so decode multiplies by exactly what encode divided by
    scales = [(p.abs().amax(dim=-1, keepdim=True) / qmax).clamp_min(_SMALLEST_SCALE).to(torch.float16) for p in pieces]
    q = _join([torch.round(p / s.to(torch.float32)).clamp(-qmax, qmax) for p, s in zip(pieces, scales)])
    scale = _join(scales)
    if kv.name == "int8":
        return [q.to(torch.int8), scale]
    # int4: shift to 0..15 and pack neighbours along head_dim into one byte (low, high nibble).
    u = q + 8.0
    return [(u[..., 0::2] + 16.0 * u[..., 1::2]).to(torch.uint8), scale]


def decode(stored: list[torch.Tensor], kv: KVDType, static_scale: torch.Tensor | None = None,
           parts: tuple[int, ...] | None = None) -> torch.Tensor:
    """The inverse of encode (the same parts), back to float32 [B, H, T, D]."""
    values = stored[0]
    if kv.name in ("fp32", "fp16"):
        return values.to(torch.float32)
    if kv.name == "fp8":
        return _fp8_dequantize(values)
    if kv.name == "int8-static":
        return values.to(torch.float32) * static_scale
    scale = stored[1].to(torch.float32)
    if kv.name == "int8":
        return _rescale(values.to(torch.float32), scale, parts)
    packed = values.to(torch.float32)
    high = torch.floor(packed / 16.0)
    low = packed - 16.0 * high
    unpacked = torch.stack((low, high), dim=-1).flatten(-2) - 8.0
    return _rescale(unpacked, scale, parts)


def _split(x: torch.Tensor, parts: tuple[int, ...] | None) -> list[torch.Tensor]:
    return [x] if parts is None else list(x.split(list(parts), dim=-1))


def _join(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def _rescale(values: torch.Tensor, scale: torch.Tensor, parts: tuple[int, ...] | None) -> torch.Tensor:
    """values [B, H, T, D] times their per-token scale [B, H, T, len(parts)], part by part."""
    if parts is None:
        return values * scale
    return _join([v * scale[..., i:i + 1] for i, v in enumerate(_split(values, parts))])


def _fp8_quantize(x: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(FP8_SCALE, dtype=torch.float32)
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "QuantizeLinear", (x, scale), {"output_dtype": 17, "saturate": 1},
            dtype=torch.float8_e4m3fn, shape=x.shape, version=24)
    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def _fp8_dequantize(q: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor(FP8_SCALE, dtype=torch.float32)
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic(
            "DequantizeLinear", (q, scale), {}, dtype=torch.float32, shape=q.shape, version=24)
    return q.to(torch.float32) * scale
