"""The contract between stages: model spec, KV-cache layout arithmetic and the manifest.

export writes a manifest.json beside model.onnx; engines add an "engine" section; the runtime
and the Triton models read it. Everything that depends on how the KV cache is laid out
(tensor names, shapes, dtypes, bytes per token, capacity buckets) is computed here and
nowhere else. Pure Python: every stage, including a torch-free serving image, imports it.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

# 2: the inplace graph takes logit_positions and returns logits only there (format 1 had every position)
# 3: the inplace graph takes packed tokens (positions, row_tokens, chunk_extent, token_slots, logit_index)
# 4: attention_extent (P, L, D) replaces chunk_extent (P, L): decode queries attend over D positions, not the capacity
# 5: max_chunk; sliding-window layers hold a ring of ring_tokens(window, max_chunk) positions (CacheTensor.window)
# 6: mixture-of-experts facts (num_experts, experts_per_token, sparse_layers, ...); sandwich_norms removed
# 7: DeepSeek's MoE routing (routing, expert_groups, expert_groups_per_token, routed_scaling_factor)
FORMAT_VERSION = 7
MANIFEST_FILE = "manifest.json"
MODEL_FILE = "model.onnx"
OPSET = 24  # TensorScatter (the in-place KV write) needs opset 24

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "SmolLM3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM",
                           "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MiniCPM3ForCausalLM",
                           "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# Families whose sliding_window applies to every layer when set (Phi-3-mini-4k's 2,047).
WINDOW_EVERYWHERE = ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM")
# Mixture-of-experts families (export.model.moe): softmax top-k routing over SwiGLU experts, Qwen2-MoE
# with a shared expert behind a sigmoid gate. Their config keys for the experts' width and whether the
# top-k weights are renormalized (Mixtral always does); the expert count is num_local_experts
# (Mixtral; Qwen3-MoE as transformers 5.24 saves it) or num_experts (Qwen2-MoE, Qwen3-MoE's hub configs).
MOE_ARCHITECTURES = {
    "MixtralForCausalLM": ("intermediate_size", None),
    "Qwen3MoeForCausalLM": ("moe_intermediate_size", "norm_topk_prob"),
    "Qwen2MoeForCausalLM": ("moe_intermediate_size", "norm_topk_prob"),
}
# Why routings other than the families' own are not exported: ONNX Runtime's MoE/QMoE CPU kernels
# route by a softmax over the router logits and its top k only; DeepSeek's routings are computed in
# front of them (export.model.moe.DeepseekMoE), for DeepSeek-V2/V3 checkpoints alone.
MOE_ROUTING_REFUSED = ("ONNX Runtime's MoE kernels route by softmax top-k only; DeepSeek's routings (topk_method "
                       "greedy / group_limited_greedy, V3's sigmoid noaux_tc) are computed in front of them for "
                       "DeepseekV2/V3ForCausalLM checkpoints alone")
# DeepSeek's MoE config keys and transformers 5.24's defaults for them (DeepseekV2Config, DeepseekV3Config),
# for a config.json that leaves one out. V2 reads topk_method, V3 always routes as noaux_tc (its
# scoring_func and topk_method are not read); V2 does not read norm_topk_prob; neither reads moe_layer_freq.
DEEPSEEK_MOE_DEFAULTS = {
    "DeepseekV2ForCausalLM": {"n_routed_experts": 64, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
                              "n_shared_experts": 2, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0,
                              "topk_method": "greedy", "n_group": None, "topk_group": None},
    "DeepseekV3ForCausalLM": {"n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
                              "n_shared_experts": 1, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
                              "n_group": 8, "topk_group": 4, "norm_topk_prob": True},
}
# What the MoE node is fed per routing (ModelSpec.routing): "softmax" (Mixtral, Qwen: the router's
# logits as they are) or DeepSeek's, each computed before the node (export.model.moe.DeepseekMoE.choose).
ROUTINGS = ("softmax", "greedy", "group_limited_greedy", "noaux_tc")
# Gemma 2/3: embeddings x sqrt(hidden), (1 + weight) RMSNorms (folded into the weights at load),
# four norms per layer, a tanh-GELU GLU, query_pre_attn_scalar's softmax scale, and layers that
# slide as layer_types says (by default Gemma 2's every other one, Gemma 3's five of six).
GEMMA_LAYER_TYPES = {
    "Gemma2ForCausalLM": lambda cfg, i: (i + 1) % 2 != 0,
    "Gemma3ForCausalLM": lambda cfg, i: (i + 1) % int(cfg.get("sliding_window_pattern", 6)) != 0,
}
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma3ForConditionalGeneration (Gemma 3 4B-27B: a vision tower beside the "
    "text decoder) is not exported: its text part (text_config, the language_model.* weights) is not read yet; "
    "Gemma3ForCausalLM checkpoints (Gemma 3 270M/1B, text only) export",
    "GptOssForCausalLM": "GptOssForCausalLM (gpt-oss) is not supported yet: its attention sinks, clamped SwiGLU "
    "experts with biases and MXFP4 expert weights are not exported",
}
# RoPE scalings the exporter computes (export.model.rope.rope_frequencies, transformers 5.24's
# modeling_rope_utils), and the config keys each reads besides rope_theta.
ROPE_SCALINGS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"),
    # Phi-3/3.5/4-mini: per-channel divisors of the frequencies, short_factor while a sequence fits
    # original_max_position_embeddings, long_factor beyond (ModelSpec.long_factors), cos/sin x one attention factor
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
}
# The longrope rule (ModelSpec.long_factors): which of the two factor lists a row's RoPE uses.
# transformers picks one per forward call from max(position_ids) + 1, and its generate()
# recomputes a sequence's whole cache in one call when the sequence first passes
# original_max_position_embeddings (Phi3ForCausalLM.prepare_inputs_for_generation), so every key
# it attends over always has the factors of its query: short while the sequence fits the original
# length, long beyond. kvforge does the same per row: a row runs on the long factors when its
# prompt is longer than the original length (every chunk of it, from the first), and a row that
# decodes past it is recomputed once from its tokens with the long factors (the scheduler;
# runtime.greedy alone too). The graph reads the length the choice is made from per row
# (prompt_lengths); the prefix cache's hash chain starts from the choice (kvforge/block_hash.py),
# so short- and long-factor K/V never serve each other.
LONGROPE_ARCHITECTURES = ("Phi3ForCausalLM",)
MLA_ROPE_SCALINGS = ("yarn",)  # DeepSeek's softmax scale follows yarn's mscale: the others are not checked there
# Families whose layers slide only with use_sliding_window (and only those layer_types names),
# and how transformers 5.24 lays the layer types out when config.json has none.
WINDOW_FLAGGED = {
    "Qwen2ForCausalLM": lambda cfg, i: i >= int(cfg.get("max_window_layers", 28)),
    "Qwen3ForCausalLM": lambda cfg, i: i >= int(cfg.get("max_window_layers", 28)),
    "SmolLM3ForCausalLM": lambda cfg, i: not smollm3_rope_flags(cfg)[i],
}
# Multi-head Latent Attention (DeepSeek-V2/V3; MiniCPM3: the same attention with half-split RoPE,
# its embedding/residual/logit scalings folded into the weights at load): the cache holds one
# latent per token and layer.
MLA_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "MiniCPM3ForCausalLM")
# "mha": multi-head attention with num_kv_heads K/V heads (MHA, GQA, MQA), two cache tensors
# (key, value) per layer. "mla": one cache tensor (latent) per layer, [batch, 1, T, r + dr].
ATTENTION_KINDS = ("mha", "mla")
# The KV dtypes an MLA export emits, and why the others are refused. int8 stores one fp16 scale
# per token for c_kv and one for k_pe (latent_scale [B, 1, T, 2]): their ranges differ (c_kv is
# RMS-normalized, k_pe is not), so one shared scale would leave k_pe with a few int8 levels.
MLA_KV_DTYPES = ("fp32", "fp16", "int8")
MLA_REFUSED_DTYPE = ("the latent [c_kv | k_pe] is both the key and the value of every head and reaches them "
                     "through W_UK and W_UV: int8-static's per-channel scales are calibrated for separate K and V "
                     "and int4's 16 levels have not been measured for accuracy on it, and fp8 runs nowhere yet")
# The latent's parts that get a per-token scale each (int8): c_kv and k_pe.
MLA_SCALE_PARTS = 2
RINGS_NO_TENSORRT = ("TensorRT is not built for exports whose sliding-window layers hold a ring (max_chunk): "
                     "TensorRT's KVCacheUpdate writes at linear positions only and no GPU host has validated "
                     "TensorScatter's circular mode; export with a --max-chunk whose ring reaches max_seq_len "
                     "(every layer then holds every position) to build one")
MLA_NO_TENSORRT = ("TensorRT is not built for MLA exports: its in-place KVCacheUpdate/attention path was "
                   "written for key/value pairs and no GPU host has validated the latent cache")
MOE_NO_TENSORRT = ("TensorRT is not built for mixture-of-experts exports: their sparse layers are ONNX Runtime "
                   "contrib MoE nodes (com.microsoft), which TensorRT's ONNX parser does not take")
KV_LAYOUTS = ("concat", "inplace")
# Tokens per KV block: the unit the prefix cache hashes, stores and copies. Measured with
# `python -m bench --sections prefix_cache` (copy, small-llama fp32, 2 shared cores): copying a
# 2,048-token prefix into a slot took 13.2 ms in blocks of 16 and 15.1 ms in blocks of 64
# (0.25% / 0.28% of its prefill): the copies are one gather per cache tensor, so larger blocks
# buy nothing, while 16 reuses up to 48 more tokens of every partial hit (two prompts' shared
# part is cut at a block boundary). Below 16 the hash chain's per-block work grows.
KV_BLOCK_TOKENS = 16
# The prefill chunk bound a windowed export gets unless told (--max-chunk): each ring holds it on top
# of its window, so it trades a ring's size against the largest chunk one step may write per row.
DEFAULT_MAX_CHUNK = 512
MIN_CAPACITY = 64
BUCKETS_PER_OCTAVE = 4  # capacities 64, 80, 96, 112, 128, 160, ... (at most 25% unused)


class ManifestError(ValueError):
    """A manifest, model config or KV option that cannot be used; the message names the problem."""


@dataclass(frozen=True)
class KVDType:
    name: str
    storage: str  # numpy/ONNX element type of the cache tensor
    bits: int  # bits per cached element (int4 packs two per uint8)
    # "none" | "per-token" (one SCALE_STORAGE scale per token and head, stored beside the cache)
    # | "per-channel" (static, calibrated at export, constants in the graph) | "per-tensor" (static)
    scale: str
    runs_on: tuple[str, ...]
    note: str = ""

    @property
    def has_scale_tensors(self) -> bool:
        return self.scale == "per-token"

    def stored_head_dim(self, head_dim: int) -> int:
        return head_dim * self.bits // 8 if self.bits < 8 else head_dim


# Per-token scales are stored in fp16: 2 bytes beside every head_dim-byte int8 vector (fp32
# scales made int8 KV 0.531x of fp16; fp16 scales 0.516x, with perplexity unchanged).
SCALE_STORAGE = "float16"
SCALE_BYTES = 2
# Why TensorRT runs no quantized cache in place (TensorRT docs, KVCacheUpdate operator): the
# in-place update takes float32/float16/bfloat16 caches only, and Q/DQ scales are build-time
# constants, so neither per-token scales nor an int8/fp8 cache have an in-place TensorRT form.
_TRT_QUANTIZED = "TensorRT's in-place KVCacheUpdate takes float32/float16/bfloat16 caches only"
KV_DTYPES: dict[str, KVDType] = {
    d.name: d
    for d in (
        KVDType("fp32", "float32", 32, "none", ("onnxruntime", "tensorrt")),
        KVDType("fp16", "float16", 16, "none", ("onnxruntime", "tensorrt")),
        KVDType("int8", "int8", 8, "per-token", ("onnxruntime",),
                "symmetric, one fp16 scale per (token, head) computed when the token is written; "
                f"ONNX Runtime only ({_TRT_QUANTIZED} and fixed Q/DQ scales)"),
        KVDType("int8-static", "int8", 8, "per-channel", ("onnxruntime",),
                "symmetric, one fp32 scale per layer, KV head and channel, calibrated at export on Python "
                "standard library text and kept in the graph: the cache holds int8 alone (half of fp16); "
                f"ONNX Runtime only ({_TRT_QUANTIZED})"),
        KVDType("int4", "uint8", 4, "per-token", ("onnxruntime",),
                "symmetric 4-bit, two values packed per byte along head_dim, fp16 scale per (token, head); "
                f"ONNX Runtime only ({_TRT_QUANTIZED})"),
        KVDType("fp8", "float8e4m3fn", 8, "per-tensor", (),
                "e4m3 via QuantizeLinear/DequantizeLinear with a static per-tensor scale, the form TensorRT's "
                "strongly typed networks need; runs nowhere yet: ONNX Runtime CPU cannot scatter into an fp8 "
                f"cache and {_TRT_QUANTIZED}"),
    )
}
FP8_SCALE = 1.0  # static per-tensor fp8 scale (uncalibrated): |K|,|V| of Llama-style models sit far below 448

# Which KV dtypes each layout can emit; anything else is refused at the command line.
LAYOUT_DTYPES = {
    "concat": ("fp32", "fp16", "int8", "int8-static", "int4"),
    "inplace": ("fp32", "fp16", "int8", "int8-static", "int4", "fp8"),
}


def kv_dtype(name: str) -> KVDType:
    if name not in KV_DTYPES:
        raise ManifestError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[name]


def check_layout_dtype(layout: str, dtype: str) -> None:
    if layout not in KV_LAYOUTS:
        raise ManifestError(f"unknown KV layout {layout!r}; choose one of {', '.join(KV_LAYOUTS)}")
    kv_dtype(dtype)
    if dtype not in LAYOUT_DTYPES[layout]:
        raise ManifestError(
            f"KV dtype {dtype} is not available with the {layout} layout "
            f"(it supports {', '.join(LAYOUT_DTYPES[layout])}); fp8 is emitted only for the "
            "inplace layout, in the Q/DQ form TensorRT would need")


@dataclass(frozen=True)
class ModelSpec:
    """The architecture facts every stage needs, read from a Hugging Face config.json."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    attention_bias: bool
    tie_word_embeddings: bool
    # Added without a format bump: older manifests lack them and mean exactly these defaults.
    # For "mla", num_kv_heads = 1 and head_dim = kv_lora_rank + qk_rope_head_dim: the cache's one
    # latent "head" [c_kv (after kv_a_layernorm) | k_pe (roped)]; the attention heads' own widths
    # are qk_nope_head_dim + qk_rope_head_dim (query/key) and v_head_dim (value).
    attention: str = "mha"
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: q_proj straight from the hidden state
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # How the checkpoint's rotary channels are laid out: "halves" (Hugging Face rotate_half),
    # "pairs" (DeepSeek-V2: interleaved pairs in and out), "pairs-to-halves" (DeepSeek-V3 with
    # rope_interleave: interleaved pairs in, half-split out; the exporter permutes those weight rows
    # so the graph runs a half-split RotaryEmbedding and the cache holds what Hugging Face's holds).
    rope_interleave: str = "halves"
    # RoPE scaling: {"rope_type": one of ROPE_SCALINGS, and the keys it reads} as transformers
    # standardizes the config; None: plain RoPE. (MLA manifests of before carry yarn's keys without
    # rope_type: rope_type says "yarn" for them.)
    rope_scaling: dict | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of every query and key head, before RoPE
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers that apply no RoPE
    # Layers that attend over only the last sliding_window positions (i - W < j <= i), as
    # transformers applies Mistral's and Qwen2/Qwen3's windows; None / (): no layer slides. The
    # window is in the attention mask; the cache still holds max_seq_len positions for every layer.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Gemma 2/3 (GEMMA_LAYER_TYPES): the MLP's activation ("silu" | "gelu_tanh"); what the embeddings
    # are multiplied by; the softmax scale's query_pre_attn_scalar ** -0.5 (None: head_dim's);
    # tanh caps of the attention scores and of the final logits (None: none); the sliding
    # layers' own RoPE base (Gemma 3's local RoPE, unscaled; None: the global one).
    mlp_activation: str = "silu"
    embedding_multiplier: float = 1.0
    query_pre_attn_scalar: float | None = None
    attention_softcap: float | None = None
    logit_softcap: float | None = None
    local_rope_theta: float | None = None
    # Phi-3/4: RoPE rotates the first head_dim x partial_rotary_factor channels of each head
    # (ONNX RotaryEmbedding's rotary_embedding_dim); q/k/v and gate/up come fused in the
    # checkpoint (qkv_proj, gate_up_proj) and are split at load.
    partial_rotary_factor: float = 1.0
    # Mixture of experts (MOE_ARCHITECTURES): the layers whose MLP is a sparse block (Qwen's
    # decoder_sparse_step and mlp_only_layers applied; the others keep the dense intermediate_size
    # MLP), each of num_experts SwiGLU experts of expert_intermediate_size, experts_per_token of
    # them per token by softmax top-k, the k weights renormalized to sum 1 when norm_topk_prob;
    # the shared experts (an MLP of shared_expert_intermediate_size, 0: none; Qwen2-MoE's behind a
    # sigmoid gate, DeepSeek's n_shared_experts x moe_intermediate_size ungated). routing (ROUTINGS):
    # how the k experts and their weights are chosen: "softmax" top-k, or DeepSeek-V2's "greedy" /
    # "group_limited_greedy" (softmax scores; the latter keeps the experts of the
    # expert_groups_per_token groups of expert_groups with the highest max score) and V3's
    # "noaux_tc" (sigmoid scores plus e_score_correction_bias choose, groups by the sum of their top
    # two; the weights are the unbiased scores); DeepSeek's weights times routed_scaling_factor.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0
    routing: str = "softmax"
    expert_groups: int = 1
    expert_groups_per_token: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ManifestError(f"unknown attention kind {self.attention!r}; choose one of {', '.join(ATTENTION_KINDS)}")
        if self.routing not in ROUTINGS:
            raise ManifestError(f"unknown MoE routing {self.routing!r}; choose one of {', '.join(ROUTINGS)}")
        for name in ("nope_layers", "sliding_layers", "sparse_layers"):  # a manifest's JSON gives lists
            object.__setattr__(self, name, tuple(getattr(self, name)))

    __hash__ = None  # rope_scaling is a dict: a spec is compared, never hashed

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "yarn") if self.rope_scaling else "default"

    @property
    def longrope_original(self) -> int | None:
        """longrope's original_max_position_embeddings, where its factors switch (long_factors); None: no longrope."""
        return self.rope_scaling["original_max_position_embeddings"] if self.rope_type == "longrope" else None

    def long_factors(self, length: int) -> bool:
        """The longrope rule (the comment at LONGROPE_ARCHITECTURES): whether a row runs on the long
        factors, from its prompt's length, or its sequence's when it was recomputed past the original
        length (Sequence.rope_length). The graph applies it to prompt_lengths; it is part of the
        prefix cache's hash chain, as K/V of the short factors differ from the long ones'."""
        return self.longrope_original is not None and length > self.longrope_original

    @property
    def output_bias(self) -> bool:
        """o_proj's bias: Qwen2's (and Qwen2-MoE's) attention biases are q/k/v only; elsewhere attention_bias
        means all four."""
        return self.attention_bias and self.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")

    @property
    def rotary_dim(self) -> int:
        """The channels RoPE rotates per head: MLA's qk_rope_head_dim, else head_dim x partial_rotary_factor."""
        if self.attention == "mla":
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def attention_scale(self) -> float:
        """Softmax scale: 1/sqrt(query width), for yarn MLA times mscale(factor, mscale_all_dim)^2."""
        if self.attention != "mla":
            return (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        scale = self.qk_head_dim ** -0.5
        yarn = self.rope_scaling or {}
        if yarn.get("mscale_all_dim") and yarn.get("factor", 1.0) > 1:
            m = 0.1 * yarn["mscale_all_dim"] * math.log(yarn["factor"]) + 1.0
            scale *= m * m
        return scale

    @classmethod
    def from_hf_config(cls, cfg: dict, cache_only: bool = False) -> "ModelSpec":
        """cache_only: only the facts sizing the cache are needed (export.kv_size), so what the
        exporter refuses without changing the cache (MoE layers, quantized weights) is let through."""
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else None
        if arch in REFUSED_ARCHITECTURES:
            raise ManifestError(REFUSED_ARCHITECTURES[arch])
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ManifestError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if arch in MLA_ARCHITECTURES:
            return cls._from_mla_config(cfg, arch, cache_only)
        gemma = arch in GEMMA_LAYER_TYPES
        activation = read_mlp_activation(cfg, arch, strict=not cache_only)
        if cfg.get("mlp_bias") and not cache_only:
            raise ManifestError(f"{arch}: an MLP with biases (mlp_bias) is not supported")
        if cfg.get("use_bidirectional_attention") and not cache_only:
            raise ManifestError(f"{arch}: use_bidirectional_attention (an encoder's attention) is not supported")
        refuse_quantized(cfg, arch, cache_only)
        moe = read_moe(cfg, arch, strict=not cache_only) if arch in MOE_ARCHITECTURES else {}
        rope_cfg, local_theta = gemma3_rope(cfg) if arch == "Gemma3ForCausalLM" else (cfg, None)
        theta, scaling = read_rope(rope_cfg, arch)
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        window, sliding = sliding_layers(cfg, arch, layers)
        return cls(
            architecture=arch,
            num_layers=layers,
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_positions=max_positions(cfg, scaling),
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            # Qwen2 has q/k/v biases without saying so in its config; Qwen2-MoE's qkv_bias defaults to true.
            attention_bias=bool(cfg.get("attention_bias") or arch == "Qwen2ForCausalLM"
                                or (arch == "Qwen2MoeForCausalLM" and cfg.get("qkv_bias", True))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            nope_layers=tuple(i for i, rope in enumerate(smollm3_rope_flags(cfg)) if not rope)
            if arch == "SmolLM3ForCausalLM" else (),
            sliding_window=window,
            sliding_layers=sliding,
            mlp_activation=activation,
            embedding_multiplier=hidden ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
            attention_softcap=optional_float(cfg.get("attn_logit_softcapping", 50.0 if arch == "Gemma2ForCausalLM"
                                                     else None)),
            logit_softcap=optional_float(cfg.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM"
                                                 else None)),
            local_rope_theta=local_theta,
            partial_rotary_factor=partial_rotary_factor(cfg),
            **moe,
        )

    @classmethod
    def _from_mla_config(cls, cfg: dict, arch: str, cache_only: bool) -> "ModelSpec":
        """DeepSeek-V2/V3. config.json's head_dim (= qk_rope_head_dim) and num_key_value_heads
        (128 by default) say nothing about the cache and are not read."""
        layers = int(cfg["num_hidden_layers"])
        moe = read_deepseek_moe(cfg, arch, layers) if arch in DEEPSEEK_MOE_DEFAULTS and not cache_only else {}
        refuse_quantized(cfg, arch, cache_only)
        if (cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias")) and not cache_only:
            raise ManifestError(f"{arch}: only a SiLU MLP without biases is supported "
                                f"(hidden_act={cfg.get('hidden_act')!r}, mlp_bias={cfg.get('mlp_bias')})")
        theta, yarn = read_rope(cfg, arch)
        if yarn is not None and yarn["rope_type"] not in MLA_ROPE_SCALINGS:
            raise ManifestError(f"unsupported rope scaling {yarn['rope_type']!r} for {arch}; default RoPE and yarn "
                                "are supported")
        if arch == "DeepseekV2ForCausalLM":
            interleave = "pairs"  # complex multiplication of consecutive pairs
        elif arch == "MiniCPM3ForCausalLM":
            interleave = "halves"  # Llama's rotate_half
        else:
            interleave = "pairs-to-halves" if cfg.get("rope_interleave", True) else "halves"
        r, dr = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        heads = int(cfg["num_attention_heads"])
        return cls(
            architecture=arch, num_layers=layers, hidden_size=int(cfg["hidden_size"]), num_heads=heads,
            num_kv_heads=1, head_dim=r + dr, intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]), max_positions=max_positions(cfg, yarn),
            rope_theta=theta, rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            attention_bias=bool(cfg.get("attention_bias")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention="mla", kv_lora_rank=r,
            q_lora_rank=int(cfg["q_lora_rank"]) if cfg.get("q_lora_rank") else None,
            qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=dr,
            v_head_dim=int(cfg["v_head_dim"]), rope_interleave=interleave, rope_scaling=yarn, **moe)


def refuse_quantized(cfg: dict, arch: str, cache_only: bool) -> None:
    """Only unquantized weights are read: a quantization_config (DeepSeek's and Qwen3's fp8, gpt-oss's
    MXFP4, GPTQ/AWQ) is refused, naming its method."""
    quant = cfg.get("quantization_config")
    if quant and not cache_only:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise ManifestError(
            f"{arch} checkpoint has quantization_config (quant_method {method!r}, e.g. DeepSeek's fp8 "
            "block-scaled weights): only unquantized weights are read; dequantize to bf16/fp32 first")


def read_moe(cfg: dict, arch: str, strict: bool = True) -> dict:
    """The ModelSpec's mixture-of-experts fields (MOE_ARCHITECTURES' keys), the sparse layers as
    transformers 5.24 chooses them: Qwen's layer i is sparse unless it is in mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step; Mixtral's every layer. strict: refuse what
    the export does not compute (a routing other than softmax top-k, Qwen's sliding windows)."""
    width_key, norm_key = MOE_ARCHITECTURES[arch]
    layers, k = int(cfg["num_hidden_layers"]), int(cfg.get("num_experts_per_tok") or 0)
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    if not 0 < k <= experts:
        raise ManifestError(f"{arch}: num_experts_per_tok={k} must be in 1..{experts}, the experts "
                            "(num_local_experts or num_experts)")
    if strict and cfg.get("use_sliding_window") and arch != "MixtralForCausalLM":
        raise ManifestError(f"{arch}: use_sliding_window is not supported for mixture-of-experts checkpoints yet")
    if strict and (cfg.get("scoring_func", "softmax") != "softmax" or cfg.get("topk_method") or cfg.get("n_group")):
        raise ManifestError(f"{arch}: routing other than softmax top-k is not exported: {MOE_ROUTING_REFUSED}")
    step, dense = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or ())
    return {"num_experts": experts, "experts_per_token": k, "expert_intermediate_size": int(cfg[width_key]),
            "norm_topk_prob": True if norm_key is None else bool(cfg.get(norm_key, False)),
            "sparse_layers": tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0),
            "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch == "Qwen2MoeForCausalLM" else 0}


def read_deepseek_moe(cfg: dict, arch: str, layers: int) -> dict:
    """DeepSeek-V2/V3's mixture-of-experts fields as transformers 5.24 reads the config
    (DEEPSEEK_MOE_DEFAULTS for a key left out): layers from first_k_dense_replace on are sparse, none
    without n_routed_experts. Refuses what transformers cannot run or the export does not compute."""
    defaults = DEEPSEEK_MOE_DEFAULTS[arch]
    get = {key: cfg.get(key, default) for key, default in defaults.items()}
    experts, dense = int(get["n_routed_experts"] or 0), int(get["first_k_dense_replace"] or 0)
    if not experts or dense >= layers:
        return {}
    k = int(get["num_experts_per_tok"] or 0)
    if not 0 < k <= experts:
        raise ManifestError(f"{arch}: num_experts_per_tok={k} must be in 1..{experts}, the experts (n_routed_experts)")
    routing = get.get("topk_method", "noaux_tc")  # V3: always
    if arch == "DeepseekV2ForCausalLM" and routing not in ("greedy", "group_limited_greedy"):
        raise ManifestError(f"{arch}: topk_method {routing!r} is not exported (transformers 5.24 routes DeepSeek-V2 "
                            f"by greedy or group_limited_greedy only); {MOE_ROUTING_REFUSED}")
    groups, chosen = (1, 1) if routing == "greedy" else (get["n_group"], get["topk_group"])
    if not (isinstance(groups, int) and isinstance(chosen, int) and groups > 0 and experts % groups == 0
            and 0 < chosen <= groups):
        raise ManifestError(f"{arch}: {routing} routing needs n_group dividing n_routed_experts={experts} and "
                            f"topk_group in 1..n_group (n_group={groups!r}, topk_group={chosen!r})")
    per_group = experts // groups
    if routing == "noaux_tc" and per_group < 2:
        raise ManifestError(f"{arch}: groups are scored by their top two experts, and n_group={groups} leaves "
                            f"{per_group} expert per group")
    if k > chosen * per_group:
        raise ManifestError(f"{arch}: num_experts_per_tok={k} is more than the topk_group={chosen} groups of "
                            f"{per_group} experts hold")
    width = int(get["moe_intermediate_size"])
    return {"num_experts": experts, "experts_per_token": k, "expert_intermediate_size": width,
            "norm_topk_prob": routing == "noaux_tc" and bool(get["norm_topk_prob"]),
            "sparse_layers": tuple(range(dense, layers)),
            "shared_expert_intermediate_size": int(get["n_shared_experts"] or 0) * width,
            "routing": routing, "expert_groups": groups, "expert_groups_per_token": chosen,
            "routed_scaling_factor": float(get["routed_scaling_factor"])}


def read_rope(cfg: dict, arch: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) as transformers 5.24 reads them: config.json's `rope_scaling`
    (transformers 4) or else `rope_parameters` (5: rope_theta inside), rope_theta from that dict
    before the top-level one, a top-level original_max_position_embeddings (Phi-3's place) before
    the dict's, which defaults to max_position_embeddings; yarn's factor defaults to their ratio."""
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if kind not in ("default", *ROPE_SCALINGS):
        raise ManifestError(
            f"unsupported rope scaling {kind!r} for {arch}; supported: default, {', '.join(ROPE_SCALINGS)}")
    if kind == "longrope" and arch not in LONGROPE_ARCHITECTURES:
        raise ManifestError(
            f"unsupported rope scaling 'longrope' for {arch}: it is exported for {', '.join(LONGROPE_ARCHITECTURES)} "
            "(Phi-3/3.5/4-mini) only; MiniCPM3-4B's (MLA) is not yet")
    if partial_rotary_factor(cfg) != 1.0 and arch != "Phi3ForCausalLM":
        raise ManifestError(f"{arch}: partial_rotary_factor (RoPE on part of each head) is exported for "
                            "Phi3ForCausalLM only (transformers applies it there)")
    if kind == "default":
        return theta, None
    if kind in ("llama3", "yarn", "longrope"):
        rope["original_max_position_embeddings"] = int(cfg.get("original_max_position_embeddings")
                                                       or rope.get("original_max_position_embeddings")
                                                       or cfg["max_position_embeddings"])
    if kind in ("yarn", "longrope") and rope.get("factor") is None:
        rope["factor"] = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
    scaling = {"rope_type": kind, **{k: rope[k] for k in ROPE_SCALINGS[kind] if rope.get(k) is not None}}
    needed = ("factor", "low_freq_factor", "high_freq_factor", "short_factor", "long_factor")
    missing = [k for k in needed if k in ROPE_SCALINGS[kind] and k not in scaling]
    if missing:
        raise ManifestError(f"{arch}: {kind} rope scaling needs {', '.join(missing)}")
    if kind == "longrope":
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
        width = int(head_dim * partial_rotary_factor(cfg)) // 2
        for name in ("short_factor", "long_factor"):
            if len(scaling[name]) != width:
                raise ManifestError(f"{arch}: longrope's {name} has {len(scaling[name])} entries; the {width} rotary "
                                    "frequencies of a head need one each")
    return theta, scaling


def max_positions(cfg: dict, scaling: dict | None) -> int:
    """max_position_embeddings; for yarn at least original x factor, the context yarn stretches
    to (Qwen2.5's cards add yarn to a config of 32,768 positions to reach 131,072: vLLM reads it so)."""
    positions = int(cfg.get("max_position_embeddings", 2048))
    if scaling and scaling["rope_type"] == "yarn":
        positions = max(positions, int(scaling["original_max_position_embeddings"] * scaling["factor"]))
    return positions


def partial_rotary_factor(cfg: dict) -> float:
    """The share of each head RoPE rotates (its first channels): config.json's rope_parameters
    (transformers 5.24) or top level (4)."""
    rope = cfg.get("rope_parameters") or {}
    return float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))


def optional_float(value) -> float | None:
    return None if value is None else float(value)


def read_mlp_activation(cfg: dict, arch: str, strict: bool = True) -> str:
    """"silu" (Llama's family) or "gelu_tanh" (Gemma's gelu_pytorch_tanh, read from
    hidden_activation, which transformers' Gemma models use, before hidden_act). strict: refuse
    another activation (sizing the cache alone does not need it)."""
    if arch in GEMMA_LAYER_TYPES:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh" and strict:
            raise ManifestError(f"{arch}: only the gelu_pytorch_tanh MLP is supported (hidden_activation={act!r})")
        return "gelu_tanh"
    if cfg.get("hidden_act", "silu") != "silu" and strict:
        raise ManifestError(f"{arch}: only a SiLU MLP is supported (hidden_act={cfg.get('hidden_act')!r})")
    return "silu"


def gemma3_rope(cfg: dict) -> tuple[dict, float]:
    """Gemma 3's global RoPE (as a config read_rope reads) and its sliding layers' base, from
    either form: rope_parameters per layer type ({"full_attention": {...}, "sliding_attention":
    {...}}, as transformers 5.24 saves them) or rope_theta (default 1e6) / rope_scaling beside
    rope_local_base_freq (default 10,000)."""
    per_type = cfg.get("rope_parameters") or {}
    if "full_attention" not in per_type:
        return {**cfg, "rope_theta": cfg.get("rope_theta") or 1e6}, float(cfg.get("rope_local_base_freq") or 1e4)
    local = per_type.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ManifestError(f"Gemma3ForCausalLM: a scaled local RoPE ({local['rope_type']!r}) is not supported")
    return ({**cfg, "rope_scaling": None, "rope_parameters": {"rope_theta": 1e6, **per_type["full_attention"]}},
            float(local.get("rope_theta", 1e4)))


def smollm3_rope_flags(cfg: dict) -> list[int]:
    """SmolLM3's no_rope_layers (1 = RoPE, 0 = none), or transformers' default: no RoPE in every
    no_rope_layer_interval-th layer."""
    layers, interval = int(cfg["num_hidden_layers"]), int(cfg.get("no_rope_layer_interval", 4))
    flags = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ManifestError(f"no_rope_layers has {len(flags)} entries for {layers} layers")
    return [int(f) for f in flags]


def sliding_layers(cfg: dict, arch: str, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that slide) as transformers 5.24 applies sliding_window: Mistral's and
    Phi-3's to every layer; Qwen2's, Qwen3's and SmolLM3's only with use_sliding_window, to the layers
    layer_types names sliding_attention (by default Qwen's from max_window_layers on, SmolLM3's
    layers without RoPE); Gemma 2's and 3's always, to the layers layer_types names (by default
    GEMMA_LAYER_TYPES'); Llama's never. (None, ()) when no layer slides."""
    window = cfg.get("sliding_window")
    if not window or arch not in (*WINDOW_EVERYWHERE, *WINDOW_FLAGGED, *GEMMA_LAYER_TYPES):
        return None, ()
    if arch in WINDOW_EVERYWHERE:
        return int(window), tuple(range(layers))
    if arch in WINDOW_FLAGGED and not cfg.get("use_sliding_window"):
        return None, ()
    default = {**WINDOW_FLAGGED, **GEMMA_LAYER_TYPES}[arch]
    types = cfg.get("layer_types") or ["sliding_attention" if default(cfg, i) else "full_attention"
                                       for i in range(layers)]
    sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    return (int(window), sliding) if sliding else (None, ())


def check_attention_dtype(spec: ModelSpec, dtype: str) -> None:
    """MLA caches run MLA_KV_DTYPES only (MLA_REFUSED_DTYPE says why)."""
    if spec.attention == "mla" and dtype not in MLA_KV_DTYPES:
        raise ManifestError(f"KV dtype {dtype} is not available for MLA ({spec.architecture}); it supports "
                            f"{', '.join(MLA_KV_DTYPES)}: {MLA_REFUSED_DTYPE}")


# ---------------------------------------------------------------- KV-cache arithmetic

def kv_bytes_per_token(spec: ModelSpec, dtype: str) -> int:
    """Bytes one token occupies in the cache, summed over its tensors (cache_tensors): K and V,
    every layer and KV head (plus scales); for MLA one latent of kv_lora_rank + qk_rope_head_dim
    per layer (no factor 2: it is K and V), plus its two scales for int8."""
    return sum(t.bytes_per_token for t in cache_tensors(spec, dtype, spec.max_positions))


def kv_bytes(spec: ModelSpec, dtype: str, tokens: int, batch: int = 1) -> int:
    return kv_bytes_per_token(spec, dtype) * tokens * batch


def capacity_bucket(tokens: int, max_seq_len: int) -> int:
    """Smallest capacity holding `tokens` on a grid of BUCKETS_PER_OCTAVE steps per power of two
    (at least MIN_CAPACITY), capped at max_seq_len.

    ONNX Runtime's attention cost follows the buffer capacity, not the valid length, so the
    in-place cache lives in the smallest bucket that fits the longest active sequence, and the
    grid is finer than powers of two: a decode step of small-llama (2 threads) past 2,048 tokens
    took 24.4 ms in a 4,096 buffer, 22.0 in 2,560 and 20.6 in 2,112; past 1,024, 21.1 / 19.6 / 18.2
    ms in 2,048 / 1,280 / 1,088 (medians of 5 x 15 steps, interleaved). Growing copies the cache,
    which a quarter of an octave of decoding repays many times over."""
    if tokens > max_seq_len:
        raise ManifestError(f"{tokens} tokens exceed the engine's max_seq_len {max_seq_len}")
    if tokens <= MIN_CAPACITY:
        return min(max_seq_len, MIN_CAPACITY)
    step = (1 << (math.ceil(math.log2(tokens)) - 1)) // BUCKETS_PER_OCTAVE
    return min(max_seq_len, -(-tokens // step) * step)


# ---------------------------------------------------------------- tensor names and shapes

ITEMSIZE = {"float32": 4, "float16": 2, "int8": 1, "uint8": 1, "float8e4m3fn": 1}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple  # ints and symbolic dim names


@dataclass(frozen=True)
class CacheTensor:
    """One cache tensor (a past_key_values.* input) as a slot holds it: per position `heads` x
    `width` elements of `dtype`, and at most `tokens` positions per sequence. window None: the
    tensor holds positions 0..tokens-1 (max_seq_len) where they are; a window W: a sliding layer's
    ring of `tokens` = ring_tokens(W, max_chunk) cells, position p in cell p mod tokens. Every size
    the runtime reads (slot bytes, block bytes, the reservation, the host pool) is derived from these."""

    name: str
    dtype: str
    heads: int
    width: int
    tokens: int
    window: int | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.heads * self.width * ITEMSIZE[self.dtype]

    def block_shape(self, block_tokens: int) -> tuple[int, int, int]:
        return (self.heads, block_tokens, self.width)

    def bytes_per_block(self, block_tokens: int) -> int:
        return self.bytes_per_token * block_tokens

    def held(self, capacity: int) -> int:
        """Positions a slot of `capacity` holds of this tensor: a ring all its cells whatever the
        capacity (its cell of p is p mod tokens, baked into the graph)."""
        return self.tokens if self.window is not None else min(capacity, self.tokens)


def ring_tokens(window: int, max_chunk: int) -> int:
    """Cells of a sliding layer's ring: a step writes up to max_chunk positions per row at p mod R
    before attending, and its first query still needs the window-1 positions before it, so R =
    window + max_chunk - 1 keeps every key any query of the step may read (what the step
    overwrites lies at or before p - window). The window counts at least one KV block (16), so
    R >= max_chunk + 15: a block a step fills (its first position up to 15 before the step's) is
    still whole in the ring right after that step, when the prefix cache copies it out."""
    return max(window, KV_BLOCK_TOKENS) + max_chunk - 1


def slot_bytes(tensors: tuple[CacheTensor, ...], capacity: int) -> int:
    """Bytes of one slot of `capacity` positions over every cache tensor."""
    return sum(t.bytes_per_token * t.held(capacity) for t in tensors)


def cache_tensors(spec: ModelSpec, dtype: str, tokens: int, max_chunk: int | None = None) -> tuple[CacheTensor, ...]:
    """Every cache tensor in graph order, each holding `tokens` positions per sequence: per layer
    key and value [kv_heads, stored head_dim] (int8/int4: and their fp16 scales [kv_heads, 1]), or
    for MLA the latent [1, r + dr] (int8: and latent_scale [1, 2], the scales of c_kv and k_pe).
    With max_chunk, a sliding layer's tensors hold a ring of ring_tokens(window, max_chunk) cells
    instead, where that is fewer than `tokens`."""
    d = kv_dtype(dtype)
    width = d.stored_head_dim(spec.head_dim)
    scale_width = MLA_SCALE_PARTS if spec.attention == "mla" else 1
    rings = layer_rings(spec, tokens, max_chunk)
    return tuple(CacheTensor(name, SCALE_STORAGE if name.endswith("_scale") else d.storage, spec.num_kv_heads,
                             scale_width if name.endswith("_scale") else width, rings.get(i, tokens),
                             spec.sliding_window if i in rings else None)
                 for i in range(spec.num_layers)
                 for name in kv_tensor_names(i, "past_key_values", d.has_scale_tensors, spec.attention))


def layer_rings(spec: ModelSpec, tokens: int, max_chunk: int | None) -> dict[int, int]:
    """layer -> its ring's cells, for the sliding layers whose ring is shorter than `tokens`."""
    if max_chunk is None or spec.sliding_window is None:
        return {}
    ring = ring_tokens(spec.sliding_window, max_chunk)
    return {i: ring for i in spec.sliding_layers} if ring < tokens else {}


def kv_tensor_names(layer: int, prefix: str, quantized_scales: bool, attention: str = "mha") -> list[str]:
    if attention == "mla":
        return [f"{prefix}.{layer}.latent"] + ([f"{prefix}.{layer}.latent_scale"] if quantized_scales else [])
    names = [f"{prefix}.{layer}.key", f"{prefix}.{layer}.value"]
    if quantized_scales:
        names += [f"{prefix}.{layer}.key_scale", f"{prefix}.{layer}.value_scale"]
    return names


def io_tensors(spec: ModelSpec, layout: str, dtype: str,
               tensors: tuple[CacheTensor, ...] | None = None) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """ONNX graph inputs and outputs for a layout; the order is the exported order.

    concat (Optimum-compatible): past [batch, kv_heads, past_len, D] in, present with
    past_len + seq out; logits for every position, as Optimum's contract has it.
    inplace: one buffer [batch, kv_heads, capacity, D] per tensor, given as input and returned as
    output so a runtime binds both to the same memory. The step's tokens are packed: input_ids and
    positions [tokens] hold the real new tokens of every row; row_tokens [batch, seq] indexes row
    b's new tokens in them (they land at write_positions[b] ..); rows 0..P-1 of attention_extent =
    (P, L, D) attend with all their queries over their first L positions, every row's first token
    also as a decode query over the first D (the longest one-token row's positions); token_slots [tokens] picks each token's attention output
    from [P x seq chunk outputs, batch decode outputs]; logits [kept, vocab] only for the tokens in
    logit_index (generation: each sampling row's last token). The runner builds all of it from a
    right-padded batch (runtime/runners/ort.py, pack_step).
    longrope (Phi-3/4): prompt_lengths, after the layout's inputs, gives each row's length its
    factors are chosen from (ModelSpec.long_factors: the prompt's, or the sequence's it was recomputed at),
    per row (concat, [batch]) or per token, its row's (inplace, [tokens]); the manifest lists it
    for longrope models only.
    MLA: one tensor per layer, past_key_values.{i}.latent -> present.{i}.latent, [batch, 1, T, r + dr];
    int8 adds past_key_values.{i}.latent_scale [batch, 1, T, 2] (the scales of c_kv and k_pe).
    tensors (default: every layer holding max_positions): a ring tensor (CacheTensor.window) is
    [batch, heads, R, width] in place, and in concat its past is the last ring_past <= R
    positions, its present the last ring_total <= R of past + new."""
    check_layout_dtype(layout, dtype)
    check_attention_dtype(spec, dtype)
    if layout == "concat":
        inputs = [TensorSpec("input_ids", "int64", ("batch", "seq")),
                  TensorSpec("attention_mask", "int64", ("batch", "total")),
                  TensorSpec("position_ids", "int64", ("batch", "seq"))]
        past_len, present_len, past_prefix, present_prefix = "past", "total", "past_key_values", "present"
    else:
        inputs = [TensorSpec("input_ids", "int64", ("tokens",)),
                  TensorSpec("positions", "int64", ("tokens",)),
                  TensorSpec("write_positions", "int64", ("batch",)),
                  TensorSpec("row_tokens", "int64", ("batch", "seq")),
                  TensorSpec("attention_extent", "int64", (3,)),
                  TensorSpec("token_slots", "int64", ("tokens",)),
                  TensorSpec("logit_index", "int64", ("kept",))]
        past_len = present_len = "capacity"
        past_prefix, present_prefix = "past_key_values", "present"
    if spec.longrope_original is not None:  # each row's prompt length (concat) or each token's row's (inplace)
        inputs.append(TensorSpec("prompt_lengths", "int64", ("batch",) if layout == "concat" else ("tokens",)))
    logits_shape = ("batch", "seq", spec.vocab_size) if layout == "concat" else ("kept", spec.vocab_size)
    outputs = [TensorSpec("logits", "float32", logits_shape)]
    tensors = cache_tensors(spec, dtype, spec.max_positions) if tensors is None else tensors
    for (past, present), t in zip(kv_pairs(spec, dtype), tensors):
        ring_past, ring_present = (t.tokens, t.tokens) if layout == "inplace" else ("ring_past", "ring_total")
        inputs.append(TensorSpec(past, t.dtype, ("batch", t.heads, ring_past if t.window else past_len, t.width)))
        outputs.append(TensorSpec(present, t.dtype, ("batch", t.heads, ring_present if t.window else present_len,
                                                     t.width)))
    return inputs, outputs


def kv_buffer_shape(tensor: TensorSpec, rows: int, length: int) -> tuple[int, int, int, int]:
    """Shape of a runtime buffer for a cache tensor: [rows, kv_heads, length, D or its scales]."""
    return (rows, tensor.shape[1], length, tensor.shape[3])


def kv_pairs(spec: ModelSpec, dtype: str) -> list[tuple[str, str]]:
    """(input name, output name) of every cache tensor: the aliases of the inplace layout."""
    d = kv_dtype(dtype)
    pairs = []
    for i in range(spec.num_layers):
        pairs += list(zip(kv_tensor_names(i, "past_key_values", d.has_scale_tensors, spec.attention),
                          kv_tensor_names(i, "present", d.has_scale_tensors, spec.attention)))
    return pairs


# ---------------------------------------------------------------- KV blocks and their namespace

@dataclass(frozen=True)
class KVBlockSpec:
    """One KV block: `tokens` consecutive positions of every cache tensor (K, V and, for per-token
    quantized caches, their scales), exactly as a runtime slot holds them. `tensors` are the cache
    tensors in graph order; block_shape(name) is one block of that tensor."""

    tokens: int
    tensors: tuple[CacheTensor, ...]

    def block_shape(self, name: str) -> tuple[int, int, int]:
        return next(t for t in self.tensors if t.name == name).block_shape(self.tokens)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def bytes_per_block(self) -> int:
        return sum(t.bytes_per_block(self.tokens) for t in self.tensors)


def kv_block_spec(manifest: "Manifest", tokens: int = KV_BLOCK_TOKENS) -> KVBlockSpec:
    return KVBlockSpec(tokens, manifest.cache_tensors)


def cache_namespace(manifest: "Manifest", block_tokens: int = KV_BLOCK_TOKENS) -> bytes:
    """What makes two K/V blocks of the same tokens interchangeable: the checkpoint's bytes (and
    the KV calibration made from it), the engine's weight quantization and backend (int8/int4
    weights produce different K/V), the KV dtype and layout, the block size and the format.
    A digest, so keys are the same in every process and on every replica."""
    source = {k: v for k, v in manifest.source.items() if k != "path"}  # the same checkpoint anywhere
    facts = {"source": source, "weights": manifest.engine.get("weights", "fp32"),
             "backend": manifest.engine.get("backend", "onnxruntime"), "kv_dtype": manifest.kv_dtype,
             "kv_layout": manifest.kv_layout, "block_tokens": block_tokens, "format_version": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).digest()


# ---------------------------------------------------------------- the manifest

@dataclass
class Manifest:
    model: ModelSpec
    kv_layout: str
    kv_dtype: str
    max_seq_len: int
    tokenizer: dict  # files, bos/eos/pad token ids
    source: dict  # checkpoint path, sha256 fingerprint
    versions: dict  # exporter and libraries
    onnx_file: str = MODEL_FILE
    opset: int = OPSET
    engine: dict = field(default_factory=dict)  # filled by `engines build`
    format_version: int = FORMAT_VERSION
    # the most tokens one step writes per row (the prefill chunk bound); None: unbounded, and no
    # layer holds a ring (every tensor keeps max_seq_len positions)
    max_chunk: int | None = None

    def __post_init__(self):
        check_layout_dtype(self.kv_layout, self.kv_dtype)
        check_attention_dtype(self.model, self.kv_dtype)
        if self.max_chunk is not None and not 0 < self.max_chunk <= self.max_seq_len:
            raise ManifestError(f"max_chunk must be in 1..{self.max_seq_len} (max_seq_len), got {self.max_chunk}")
        if not 0 < self.max_seq_len <= self.model.max_positions:
            raise ManifestError(
                f"max_seq_len must be in 1..{self.model.max_positions} (the model's positions), "
                f"got {self.max_seq_len}")

    @property
    def kv(self) -> KVDType:
        return KV_DTYPES[self.kv_dtype]

    @property
    def cache_tensors(self) -> tuple[CacheTensor, ...]:
        """The per-tensor sizes of the cache: max_seq_len positions per sequence, a sliding
        layer's ring where max_chunk gives one (cache_tensors)."""
        return cache_tensors(self.model, self.kv_dtype, self.max_seq_len, self.max_chunk)

    @property
    def rings(self) -> bool:
        """Whether some layer holds a ring (only its window plus a chunk) rather than every position."""
        return any(t.window is not None for t in self.cache_tensors)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position costs in every tensor, rings included (slot_bytes counts what rings hold)."""
        return sum(t.bytes_per_token for t in self.cache_tensors)

    def io(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        return io_tensors(self.model, self.kv_layout, self.kv_dtype, self.cache_tensors)

    def to_dict(self) -> dict:
        inputs, outputs = self.io()
        d = asdict(self)
        d["kv"] = {"layout": self.kv_layout, "dtype": self.kv_dtype, "storage": self.kv.storage,
                   "scale": self.kv.scale, "runs_on": list(self.kv.runs_on), "note": self.kv.note,
                   "bytes_per_token": self.kv_bytes_per_token, "block_tokens": KV_BLOCK_TOKENS,
                   "slot_bytes": slot_bytes(self.cache_tensors, self.max_seq_len),
                   "tensors": [{"name": t.name, "tokens": t.tokens, "window": t.window} for t in self.cache_tensors]}
        d["io"] = {"inputs": [asdict(t) for t in inputs], "outputs": [asdict(t) for t in outputs]}
        return d

    def save(self, directory: Path) -> Path:
        path = Path(directory) / MANIFEST_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: Path) -> "Manifest":
        path = Path(directory) / MANIFEST_FILE
        if not path.is_file():
            raise ManifestError(f"no {MANIFEST_FILE} in {directory} (run `python -m export` first)")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ManifestError(f"{path} is not valid JSON: {e}") from None
        version = d.get("format_version")
        if not isinstance(version, int) or version != FORMAT_VERSION:
            age = "newer" if isinstance(version, int) and version > FORMAT_VERSION else "older"
            raise ManifestError(
                f"{path} has manifest format {version!r}, {age} than the one this kvforge reads "
                f"({FORMAT_VERSION}); re-export with this version (`make export`) or upgrade kvforge")
        try:
            fields = {k: d[k] for k in ("kv_layout", "kv_dtype", "max_seq_len", "tokenizer",
                                        "source", "versions", "onnx_file", "opset", "engine",
                                        "format_version", "max_chunk")}
            return cls(model=ModelSpec(**d["model"]), **fields)
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{path} is missing or has a malformed field: {e}") from None
