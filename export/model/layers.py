"""The blocks every family's decoder layer is made of besides attention: the RMSNorm, several
projections of one input as one MatMul, and the gated MLP (export.model.moe: the sparse one)."""
from __future__ import annotations

import torch
from torch import nn

from kvforge.manifest import ModelSpec


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one ONNX RMSNormalization op (opset 23) instead of six elementwise ones
        return nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)


def packed_linear(x: torch.Tensor, layers: list[nn.Linear]) -> tuple[torch.Tensor, ...]:
    """Several projections of the same input (q/k/v, gate/up) as one MatMul: fewer, larger
    kernels per decode step. The module keeps the weights separate under their Hugging Face
    names; the export folds their Concat into one initializer (export/onnx_export.py)."""
    weight = torch.cat([layer.weight for layer in layers])
    bias = torch.cat([layer.bias for layer in layers]) if layers[0].bias is not None else None
    return nn.functional.linear(x, weight, bias).split([layer.out_features for layer in layers], dim=-1)


class MLP(nn.Module):
    """down(act(gate) * up): SiLU (Llama's family) or tanh-approximated GELU (Gemma's, one ONNX Gelu);
    width: the intermediate size (a dense layer's, or Qwen2-MoE's shared expert's)."""

    def __init__(self, spec: ModelSpec, width: int):
        super().__init__()
        self.gelu = spec.mlp_activation == "gelu_tanh"
        self.gate_proj = nn.Linear(spec.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, spec.hidden_size, bias=False)

    def forward(self, x):
        gate, up = packed_linear(x, [self.gate_proj, self.up_proj])
        gate = nn.functional.gelu(gate, approximate="tanh") if self.gelu else nn.functional.silu(gate)
        return self.down_proj(gate * up)
