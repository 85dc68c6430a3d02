"""The Llama decoder, which every family here starts from: embeddings, pre-norm layers (attention,
then the gated MLP, each added to the residual), a final norm and the lm_head. The other Llama-shaped
families differ only in facts the shared blocks read from the ModelSpec: Mistral's windows on
every layer, Qwen2's q/k/v biases and windows from max_window_layers, Qwen3's q/k norms, SmolLM3's
NoPE layers (export.model.attention.Attention). Gemma, Phi-3 and DeepSeek override the hooks
below in their own files."""
from __future__ import annotations

import torch
from torch import nn

from export.model.attention import Attention
from export.model.layers import MLP, RMSNorm
from export.model.rope import rope_cos_sin
from export.model.steps import ConcatStep, InplaceStep
from kvforge.manifest import KVDType, ModelSpec, kv_tensor_names


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = self.make_attention(spec, layer)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = self.make_feed_forward(spec, layer)

    def make_attention(self, spec: ModelSpec, layer: int) -> nn.Module:
        return Attention(spec, layer)

    def make_feed_forward(self, spec: ModelSpec, layer: int) -> nn.Module:
        """The one place a layer's MLP is chosen (export.model.moe: sparse or dense by layer)."""
        return MLP(spec, spec.intermediate_size)

    def forward(self, x, cos, sin, cache, kv, step):
        attn, present = self.self_attn(self.input_layernorm(x), cos, sin, cache, kv, step)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), present


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec, layer: type[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(layer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    """forward(input_ids, <layout inputs>, *cache) -> (logits, *present), flat for ONNX export.

    Module and parameter names are Hugging Face's, so a checkpoint's state dict loads as is once
    adapt_weights has run. A family overrides what differs: its decoder_layer, rotary (cos/sin per
    layer, from any inputs of its own before the cache), embed, logits, and at load fused_weights
    and adapt_weights."""

    architectures = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                     "SmolLM3ForCausalLM")
    decoder_layer = DecoderLayer

    def __init__(self, spec: ModelSpec, layout: str, kv: KVDType):
        super().__init__()
        self.spec, self.layout, self.kv = spec, layout, kv
        self.model = Backbone(spec, self.decoder_layer)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.per_layer = len(kv_tensor_names(0, "past_key_values", kv.has_scale_tensors, spec.attention))

    def hold_rings(self, rings: dict[int, int]) -> None:
        """Sliding layers whose cache is a ring: layer -> its cells (kvforge.manifest.layer_rings)."""
        for i, cells in rings.items():
            self.model.layers[i].self_attn.ring = cells

    def fused_weights(self) -> dict[str, list[tuple[str, int]]]:
        """Checkpoint tensors holding several of the modules' weights stacked by rows: name ->
        [(module weight, rows), ...], split at load (Phi-3's)."""
        return {}

    def stacked_weights(self) -> dict[str, list[list[str]] | str]:
        """Module weights gathered from several checkpoint tensors: name -> per expert, the checkpoint
        tensors concatenated by rows, stacked into [experts, ...] at load; or -> the one checkpoint
        tensor it is under another name (export.model.moe's)."""
        return {}

    def adapt_weights(self, state: dict[str, torch.Tensor], config: dict) -> None:
        """Rewrite the checkpoint's tensors (read as float32) into what these modules compute with."""

    def extra_inputs(self) -> int:
        """How many inputs of the family's own come between the layout's and the cache (the manifest's io_tensors)."""
        return 0

    def rotary(self, position_ids: torch.Tensor, *extra: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin of each layer for the step's position_ids [B, S]: one table for all here."""
        return [rope_cos_sin(position_ids, self.spec)] * self.spec.num_layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(x))

    def forward(self, input_ids: torch.Tensor, *args: torch.Tensor):
        if self.layout == "concat":
            attention_mask, position_ids, *rest = args
            step = ConcatStep(attention_mask, position_ids)
        else:
            positions, write_positions, row_tokens, attention_extent, token_slots, logit_index, *rest = args
            step = InplaceStep(write_positions, row_tokens, attention_extent, token_slots)
            input_ids, position_ids = input_ids[None], positions[None]  # one row of packed tokens
        extra, cache = rest[:self.extra_inputs()], rest[self.extra_inputs():]
        rope = self.rotary(position_ids, *extra)

        x = self.embed(input_ids)
        presents: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            layer_cache = list(cache[i * self.per_layer:(i + 1) * self.per_layer])
            x, present = layer(x, *rope[i], layer_cache, self.kv, step)
            presents += present
        if self.layout == "inplace":
            # [K, hidden]: one Gather, so one graph serves generation (one token per row) and scoring
            # (every token). Measured (`bench.prefill.profile_step`, small-llama-32k, 1,024 tokens):
            # the lm_head generation skips took 17% of the step; a second graph for scoring would
            # hold a second copy of the weights on disk and in every session.
            x = x[0].index_select(0, logit_index)
        return (self.logits(x), *presents)
