"""The decoders kvforge exports, written for export with an explicit KV cache: shared blocks and
one short file per family saying what differs from Llama's.

    layers.py     RMSNorm, packed projections (q/k/v, gate/up as one MatMul), the gated MLP
    rope.py       RoPE: default, linear, llama3, yarn, longrope, partial; cos/sin; the rotation
    attention.py  attention cores (masked softmax, in place over a buffer, ring or window; softcap),
                  the cache write, and the attention module of the Llama-shaped families
    steps.py      the two KV layouts as a step: ConcatStep, InplaceStep
    mla.py        DeepSeek's Multi-head Latent Attention over a latent cache
    llama.py      the decoder every family starts from (Llama, Mistral, Qwen2, Qwen3, SmolLM3)
    gemma.py      Gemma 2/3     phi3.py  Phi-3/3.5/4     deepseek.py  DeepSeek-V2/V3, MiniCPM3
    moe.py        Mixtral, Qwen3-MoE, Qwen2-MoE: sparse layers as one ONNX Runtime MoE node each;
                  DeepSeek-V2/V3's sparse block, its routing in standard ops before the node

Module and parameter names match Hugging Face checkpoints, so a safetensors state dict loads as
is (after the family's adapt_weights). The cache is passed in and returned as flat tensors in the
order the manifest gives (kvforge.manifest.io_tensors), in one of two layouts:

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

from export.model.deepseek import DeepseekForCausalLM
from export.model.gemma import GemmaForCausalLM
from export.model.llama import CausalLM
from export.model.mla import decompresses
from export.model.moe import MoEForCausalLM
from export.model.phi3 import Phi3ForCausalLM
from export.model.rope import rope_frequencies
from kvforge.manifest import KVDType, ModelSpec

__all__ = ["CausalLM", "FAMILIES", "build_model", "decompresses", "rope_frequencies"]

# architecture -> the model class that exports it (kvforge.manifest.SUPPORTED_ARCHITECTURES)
FAMILIES = {arch: family for family in (CausalLM, GemmaForCausalLM, Phi3ForCausalLM, DeepseekForCausalLM,
                                                       MoEForCausalLM)
            for arch in family.architectures}


def build_model(spec: ModelSpec, layout: str, kv: KVDType) -> CausalLM:
    """The model class of spec.architecture's family, with freshly initialized weights (export.checkpoint.load_model
    reads a checkpoint's into it)."""
    return FAMILIES[spec.architecture](spec, layout, kv)
