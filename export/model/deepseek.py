"""DeepSeek-V2/V3 and MiniCPM3: Llama's decoder with Multi-head Latent Attention (export.model.mla)
and DeepSeek's sparse layers (export.model.moe.DeepseekMoE, from first_k_dense_replace on), read
from checkpoints whose rotary rows DeepSeek-V3 interleaves and whose scales MiniCPM3 applies
outside the weights."""
from __future__ import annotations

import math

import torch

from export.model.llama import CausalLM, DecoderLayer
from export.model.mla import MLAAttention
from export.model.moe import DeepseekMoE, stacked_experts
from kvforge.manifest import ModelSpec

# MiniCPM3Config's defaults (transformers), for a config.json that leaves them out
MINICPM3_DEFAULTS = {"scale_emb": 12.0, "scale_depth": 1.4, "dim_model_base": 256}


class MLADecoderLayer(DecoderLayer):
    def make_attention(self, spec: ModelSpec, layer: int) -> MLAAttention:
        return MLAAttention(spec)

    def make_feed_forward(self, spec: ModelSpec, layer: int) -> torch.nn.Module:
        return DeepseekMoE(spec) if layer in spec.sparse_layers else super().make_feed_forward(spec, layer)


class DeepseekForCausalLM(CausalLM):
    architectures = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MiniCPM3ForCausalLM")
    decoder_layer = MLADecoderLayer

    def stacked_weights(self):
        return stacked_experts(self.spec, "mlp", "gate_proj", "up_proj", "down_proj")

    def adapt_weights(self, state: dict[str, torch.Tensor], config: dict) -> None:
        if self.spec.rope_interleave == "pairs-to-halves":
            permute_rope_rows(self.spec, state)
        if self.spec.architecture == "MiniCPM3ForCausalLM":
            fold_minicpm3_scales(config, self.spec, state)


def rope_rows_to_halves(weight: torch.Tensor, heads: int, width: int, rope: int) -> torch.Tensor:
    """Reorder the rotary output rows of a projection from interleaved pairs (x0, x1, x2, x3, ...)
    to halves (x0, x2, ..., x1, x3, ...): each of `heads` groups of `width` rows ends with `rope`
    rotary rows. Half-split RoPE of the reordered rows equals DeepSeek-V3's interleaved RoPE
    (apply_rotary_pos_emb_interleave: pairs in, halves out) exactly."""
    order = torch.arange(weight.shape[0]).view(heads, width)
    rot = order[:, width - rope:]
    order = torch.cat([order[:, :width - rope], rot[:, 0::2], rot[:, 1::2]], dim=1).flatten()
    return weight[order]


def permute_rope_rows(spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
    """DeepSeek-V3 rope_interleave: reorder the rows producing q_pe and k_pe so a half-split
    RotaryEmbedding computes what apply_rotary_pos_emb_interleave computes."""
    dr, qk = spec.qk_rope_head_dim, spec.qk_head_dim
    for i in range(spec.num_layers):
        prefix = f"model.layers.{i}.self_attn."
        for name, heads, width in (("q_proj.weight", spec.num_heads, qk), ("q_b_proj.weight", spec.num_heads, qk),
                                   ("kv_a_proj_with_mqa.weight", 1, spec.kv_lora_rank + dr),
                                   ("kv_a_proj_with_mqa.bias", 1, spec.kv_lora_rank + dr)):
            if prefix + name in state:
                state[prefix + name] = rope_rows_to_halves(state[prefix + name], heads, width, dr)


def fold_minicpm3_scales(cfg: dict, spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
    """MiniCPM3 multiplies the embeddings by scale_emb, each residual branch (attention, MLP) by
    scale_depth / sqrt(layers) and divides the final hidden state by hidden_size / dim_model_base
    before lm_head; folded into weights here (o_proj, down_proj, the final norm; the embedding,
    and for tied embeddings the final norm once more, since lm_head then reads the scaled
    embedding), the graph is DeepSeek's. A null scale_depth / dim_model_base means no scaling."""
    value = {k: cfg.get(k, default) for k, default in MINICPM3_DEFAULTS.items()}
    layers = spec.num_layers
    residual = (value["scale_depth"] if value["scale_depth"] is not None else math.sqrt(layers)) / math.sqrt(layers)
    logits_scaling = spec.hidden_size / (value["dim_model_base"] or spec.hidden_size)
    norm_scale = 1.0 / logits_scaling / (value["scale_emb"] if spec.tie_word_embeddings else 1.0)
    for key, scale in (("model.embed_tokens.weight", value["scale_emb"]), ("model.norm.weight", norm_scale)):
        if key in state:
            state[key] = state[key] * scale
    for i in range(layers):
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            key = f"model.layers.{i}.{name}"
            if key in state:
                state[key] = state[key] * residual
