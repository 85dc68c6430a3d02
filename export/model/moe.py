"""Mixture-of-experts decoders: Mixtral, Qwen3-MoE and Qwen2-MoE, Llama's decoder whose sparse layers
(ModelSpec.sparse_layers) replace the MLP with a router over SwiGLU experts; DeepSeek-V2/V3's sparse
block (DeepseekMoE, used by export.model.deepseek) routes in front of the same node.

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
        out = routed_experts(self.experts, tokens, self.gate(tokens), self.k, self.normalize)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.reshape(x.shape)


def routed_experts(experts: Experts, tokens: torch.Tensor, logits: torch.Tensor, k: int,
                   normalize: bool) -> torch.Tensor:
    """Each token's top k experts by softmax(logits), weighted (renormalized over the k when
    normalize): one MoE node in the export, route() eagerly."""
    if not torch.onnx.is_in_onnx_export():
        return route(experts, tokens, logits, k, normalize)
    count, rows, hidden = experts.gate_up_proj.shape
    interleaved = experts.gate_up_proj.view(count, 2, rows // 2, hidden).transpose(1, 2)
    return torch.onnx.ops.symbolic(
        "com.microsoft::MoE", (tokens, logits, interleaved.reshape(count, rows, hidden), None, experts.down_proj),
        {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": 1.0,
         "activation_beta": 0.0, "normalize_routing_weights": int(normalize)},
        dtype=tokens.dtype, shape=tokens.shape, version=1)


def route(experts: Experts, tokens: torch.Tensor, logits: torch.Tensor, k: int, normalize: bool) -> torch.Tensor:
    """What the MoE node computes, in torch (eager runs: calibration, parity checks)."""
    weights, chosen = torch.softmax(logits, dim=-1).topk(k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    out = torch.zeros_like(tokens)
    for e in range(experts.gate_up_proj.shape[0]):
        rows, slot = (chosen == e).nonzero(as_tuple=True)
        gate, up = nn.functional.linear(tokens[rows], experts.gate_up_proj[e]).chunk(2, dim=-1)
        expert = nn.functional.linear(nn.functional.silu(gate) * up, experts.down_proj[e])
        out = out.index_add(0, rows, expert * weights[rows, slot, None])
    return out


class Router(nn.Module):
    """DeepSeek's gate under its checkpoint names: the projection to one logit per expert and
    V3's e_score_correction_bias (a checkpoint tensor that only chooses experts)."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(spec.num_experts, spec.hidden_size) * 0.02)
        if spec.routing == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(spec.num_experts))


class DeepseekMoE(nn.Module):
    """DeepSeek-V2/V3's sparse block: their routing (transformers' DeepseekV2TopkRouter /
    DeepseekV3TopkRouter) in standard ONNX ops, then the same MoE node as SparseMoE's, then the
    shared experts (a plain MLP) added.

    The node softmaxes the logits it is given, keeps the top k and renormalizes them. Given
    log(w_i) for the chosen experts and -inf for the others it keeps exactly the chosen and weights
    expert i by w_i / sum(w); its output is linear in the weights, so multiplying it per token by
    sum(w) (V3 with norm_topk_prob: sum(w) / (sum(w) + 1e-20), transformers' denominator) and
    routed_scaling_factor gives transformers' weighted sum. Decode still reads the k experts alone."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.gate = Router(spec)
        self.experts = Experts(spec)
        if spec.shared_expert_intermediate_size:
            self.shared_experts = MLP(spec, spec.shared_expert_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits, scale = self.choose(nn.functional.linear(tokens, self.gate.weight))
        out = routed_experts(self.experts, tokens, logits, self.spec.experts_per_token, True) * scale
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(tokens)
        return out.reshape(x.shape)

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits the MoE node routes by: log of each chosen expert's weight, -inf elsewhere;
        the factor per token [T, 1] that restores transformers' weights)."""
        spec = self.spec
        sigmoid = spec.routing == "noaux_tc"
        if sigmoid:
            scores = torch.sigmoid(logits)
            choice = scores + self.gate.e_score_correction_bias  # chooses; the weights stay unbiased
        else:
            scores = choice = torch.softmax(logits, dim=-1)
        if spec.routing != "greedy":
            groups, per_group = spec.expert_groups, spec.num_experts // spec.expert_groups
            grouped = choice.view(-1, groups, per_group)
            # V3 scores a group by the sum of its top two, V2 by its max
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1) if sigmoid else grouped.amax(dim=-1)
            kept = group_scores.topk(spec.expert_groups_per_token, dim=-1).indices
            mask = torch.zeros_like(group_scores).scatter(1, kept, 1.0)
            mask = mask.unsqueeze(-1).expand(-1, groups, per_group).reshape(-1, spec.num_experts)
            # transformers' fill: V3's -inf, V2's 0 (below every softmax score)
            choice = choice.masked_fill(mask == 0, float("-inf") if sigmoid else 0.0)
        chosen = choice.topk(spec.experts_per_token, dim=-1).indices
        weights = scores.gather(1, chosen)
        total = weights.sum(dim=-1, keepdim=True)
        scale = total / (total + 1e-20) if spec.norm_topk_prob else total
        node_logits = torch.full_like(logits, float("-inf")).scatter(1, chosen, torch.log(weights))
        return node_logits, scale * spec.routed_scaling_factor


class MoEDecoderLayer(DecoderLayer):
    def make_feed_forward(self, spec: ModelSpec, layer: int) -> nn.Module:
        return SparseMoE(spec) if layer in spec.sparse_layers else super().make_feed_forward(spec, layer)


class MoEForCausalLM(CausalLM):
    architectures = tuple(CHECKPOINT_EXPERTS)
    decoder_layer = MoEDecoderLayer

    def stacked_weights(self):
        return stacked_experts(self.spec, *CHECKPOINT_EXPERTS[self.spec.architecture])


def stacked_experts(spec: ModelSpec, block: str, gate: str, up: str, down: str) -> dict[str, list[list[str]] | str]:
    """Each sparse layer's experts from the file's per-expert tensors (gate and up concatenated by
    rows, as transformers fuses them), and the router from `block` when it is not mlp (Mixtral's
    block_sparse_moe): CausalLM.stacked_weights."""
    stacked = {}
    for i in spec.sparse_layers:
        source, target = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
        experts = range(spec.num_experts)
        stacked[target + "experts.gate_up_proj"] = [[f"{source}experts.{e}.{gate}.weight",
                                                     f"{source}experts.{e}.{up}.weight"] for e in experts]
        stacked[target + "experts.down_proj"] = [[f"{source}experts.{e}.{down}.weight"] for e in experts]
        if source != target:
            stacked[target + "gate.weight"] = source + "gate.weight"
    return stacked
