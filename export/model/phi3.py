"""Phi-3/3.5/4 (Phi-4-mini too): Llama's decoder read from fused checkpoint tensors, with LongRoPE's
per-row choice of factors. RoPE on part of each head (partial_rotary_factor) and the windows are
ModelSpec facts the shared blocks read (export.model.rope.apply_rotary)."""
from __future__ import annotations

from export.model.llama import CausalLM
from export.model.rope import rope_cos_sin


class Phi3ForCausalLM(CausalLM):
    architectures = ("Phi3ForCausalLM",)

    def fused_weights(self):
        """qkv_proj holds q, k, v and gate_up_proj gate, up, stacked by rows: split at load (the
        export folds them back into one MatMul each, as for every family)."""
        spec = self.spec
        q, kv, ff = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
        fused = {}
        for i in range(spec.num_layers):
            prefix = f"model.layers.{i}."
            fused[prefix + "self_attn.qkv_proj.weight"] = [(prefix + f"self_attn.{name}_proj.weight", rows)
                                                           for name, rows in (("q", q), ("k", kv), ("v", kv))]
            fused[prefix + "mlp.gate_up_proj.weight"] = [(prefix + "mlp.gate_proj.weight", ff),
                                                         (prefix + "mlp.up_proj.weight", ff)]
        return fused

    def extra_inputs(self):
        """longrope: prompt_lengths, [B] (concat) or [T] (inplace), read as ModelSpec.long_factors says."""
        return 1 if self.spec.longrope_original is not None else 0

    def rotary(self, position_ids, *extra):
        """longrope: each token on its row's long factors when the row's prompt_lengths passes
        original_max_position_embeddings, else on the short ones."""
        if not extra:
            return super().rotary(position_ids)
        (prompt_lengths,) = extra
        rows = prompt_lengths[:, None] if self.layout == "concat" else prompt_lengths[None]
        long = rows > self.spec.longrope_original
        rope = rope_cos_sin(position_ids, self.spec, long=long.expand(position_ids.shape))
        return [rope] * self.spec.num_layers
