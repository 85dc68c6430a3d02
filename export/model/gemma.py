"""Gemma 2 and Gemma 3 (text): Llama's decoder with four norms per layer, (1 + weight) norms,
embeddings x sqrt(hidden), a final logit softcap and, for Gemma 3, the sliding layers' own local
RoPE. The tanh-GELU MLP, query_pre_attn_scalar, the attention softcap, Gemma 3's q/k norms and the
alternating windows are ModelSpec facts the shared blocks read (export.model.layers.MLP,
export.model.attention.Attention)."""
from __future__ import annotations

import torch

from export.model.layers import RMSNorm
from export.model.llama import CausalLM, DecoderLayer
from export.model.rope import rope_cos_sin
from kvforge.manifest import ModelSpec


class GemmaDecoderLayer(DecoderLayer):
    """Each branch's output is normed too before its residual add: post_attention_layernorm norms
    the attention's output and pre_/post_feedforward_layernorm wrap the MLP."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__(spec, layer)
        self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, cache, kv, step):
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, cache, kv, step)
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), present


class GemmaForCausalLM(CausalLM):
    architectures = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    decoder_layer = GemmaDecoderLayer

    def adapt_weights(self, state: dict[str, torch.Tensor], config: dict) -> None:
        """Gemma's norms scale by (1 + weight): folded here, each stays one RMSNormalization."""
        for key in [k for k in state if k.endswith("norm.weight")]:
            state[key] = 1.0 + state[key]

    def rotary(self, position_ids, *extra):
        """Gemma 3: the sliding layers rotate with the local RoPE (unscaled, local_rope_theta)."""
        rope = super().rotary(position_ids)
        if not self.spec.local_rope_theta:
            return rope
        local = rope_cos_sin(position_ids, self.spec, local=True)
        return [local if i in self.spec.sliding_layers else both for i, both in enumerate(rope)]

    def embed(self, input_ids):
        x = super().embed(input_ids)  # x sqrt(hidden), rounded to float32 as transformers does
        return x * torch.tensor(self.spec.embedding_multiplier, dtype=x.dtype)

    def logits(self, x):
        logits = super().logits(x)
        if self.spec.logit_softcap:  # Gemma 2's; Gemma 3's only where its config sets one
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return logits
