"""Mixture-of-experts decoders: Mixtral, Qwen3-MoE and Qwen2-MoE, Llama's decoder whose sparse layers
(ModelSpec.sparse_layers) replace the MLP with a router over SwiGLU experts.

A sparse block is exported as ONE ONNX Runtime contrib com.microsoft.MoE node (engines build
--weights int8/int4 makes it QMoE): its CPU kernel takes the router logits, routes each token to its
top k experts by softmax (normalize_routing_weights: renormalized over the k) and runs each expert
over only the tokens routed to it, so a decode step reads the routed experts' weights alone. The
alternatives with standard ops either compute every expert for every token (dense: E/k times the
reads) or gather each token's expert weights (a Gather copies k experts' matrices per token, per
step). Measured: docs/export-and-engines.md (mixture of experts).

The op goes in through torch.onnx.ops.symbolic with its domain, as the in-place attention's ONNX ops
do: the exporter writes the node as given, no graph rewrite after export. The kernel's CPU SwiGLU
takes gate and up interleaved by row (swiglu_fusion=1, the only layout it accepts): the module keeps
transformers' [gate; up] stacking and the Reshape/Transpose that interleaves it is folded into one
initializer at export (export/onnx_export.py), as packed q/k/v are."""
from __future__ import annotations

import torch
from torch import nn

from export.model.layers import MLP
from export.model.llama import CausalLM, DecoderLayer
from kvforge.manifest import ModelSpec

# The checkpoint files' names of a sparse block's parts (transformers 5.24 fuses the experts in
# memory only): block prefix, router, and the per-expert gate, up and down projections.
CHECKPOINT_EXPERTS = {
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "Qwen2MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
}


class Experts(nn.Module):
    """The experts' weights as transformers 5.24 holds them: gate_up_proj [E, 2I, H] (each expert's
    gate rows, then its up rows) and down_proj [E, H, I]."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        experts, width, hidden = spec.num_experts, spec.expert_intermediate_size, spec.hidden_size
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden) * 0.02)
        self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) * 0.02)


class SparseMoE(nn.Module):
    """router (gate, fp32 as transformers runs it) -> top-k experts per token; Qwen2-MoE adds its
    shared expert times sigmoid(shared_expert_gate(x))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.k, self.normalize = spec.experts_per_token, spec.norm_topk_prob
        self.gate = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = Experts(spec)
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(spec, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(spec.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.gate(tokens)
        if torch.onnx.is_in_onnx_export():
            experts, rows, hidden = self.experts.gate_up_proj.shape
            interleaved = self.experts.gate_up_proj.view(experts, 2, rows // 2, hidden).transpose(1, 2)
            out = torch.onnx.ops.symbolic(
                "com.microsoft::MoE", (tokens, logits, interleaved.reshape(experts, rows, hidden), None,
                                       self.experts.down_proj),
                {"k": self.k, "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
                 "activation_beta": 0.0, "normalize_routing_weights": int(self.normalize)},
                dtype=tokens.dtype, shape=tokens.shape, version=1)
        else:
            out = self.route(tokens, logits)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.reshape(x.shape)

    def route(self, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """What the MoE node computes, in torch (eager runs: calibration, parity checks)."""
        weights, chosen = torch.softmax(logits, dim=-1).topk(self.k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e in range(self.experts.gate_up_proj.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            gate, up = nn.functional.linear(tokens[rows], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            expert = nn.functional.linear(nn.functional.silu(gate) * up, self.experts.down_proj[e])
            out = out.index_add(0, rows, expert * weights[rows, slot, None])
        return out


class MoEDecoderLayer(DecoderLayer):
    def make_feed_forward(self, spec: ModelSpec, layer: int) -> nn.Module:
        return SparseMoE(spec) if layer in spec.sparse_layers else super().make_feed_forward(spec, layer)


class MoEForCausalLM(CausalLM):
    architectures = tuple(CHECKPOINT_EXPERTS)
    decoder_layer = MoEDecoderLayer

    def stacked_weights(self):
        """Each sparse layer's experts from the file's per-expert tensors (gate and up concatenated
        by rows, as transformers fuses them), and Mixtral's router from block_sparse_moe."""
        block, gate, up, down = CHECKPOINT_EXPERTS[self.spec.architecture]
        stacked = {}
        for i in self.spec.sparse_layers:
            source, target = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
            experts = range(self.spec.num_experts)
            stacked[target + "experts.gate_up_proj"] = [[f"{source}experts.{e}.{gate}.weight",
                                                         f"{source}experts.{e}.{up}.weight"] for e in experts]
            stacked[target + "experts.down_proj"] = [[f"{source}experts.{e}.{down}.weight"] for e in experts]
            if source != target:
                stacked[target + "gate.weight"] = source + "gate.weight"
        return stacked
