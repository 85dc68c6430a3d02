"""python -m bench.moe_ops [--threads N] [--models]: why a sparse layer is exported as ONNX Runtime's MoE node.

One sparse feed-forward (router, top-k of E SwiGLU experts, weighted sum) of a small config, exported
three ways, timed at batch 1 (one decode token) and over a 256-token prefill chunk:

    moe     one com.microsoft.MoE node (what export.model.moe emits): each token runs its k experts
    gather  standard ops: TopK, Gather of the k experts' matrices per token, batched MatMuls
    dense   standard ops: every expert over every token, weighted by the routing (zero off the top k)

beside a dense SwiGLU MLP of the active width (k x I): the cost of a dense model with the same
active parameters; and the MoE node as `engines build --weights int8|int4` makes it (QMoE,
engines.onnxruntime_build.quantize_experts), in blocks of 32 and with one scale per row. Random fp32 weights; the same router logits for all; the outputs are checked
against each other before timing. Median of the timed calls, microseconds.

--routing: DeepSeek's routings alone (export.model.moe.DeepseekMoE.choose: V2 greedy, V2
group_limited_greedy over 8 groups keeping 3, V3 noaux_tc over 8 groups keeping 4), exported, checked
against the eager module and timed: what they add in front of the MoE node.

--models: whole exports at batch 1: decode tokens/s of a random Qwen3-MoE checkpoint of these
shapes (MODEL_LAYERS layers) beside the dense Qwen3 of the same active parameters (intermediate
size k x I), the two taking turns (bench.common.interleaved_steps)."""
from __future__ import annotations

import argparse
import copy
import time

import numpy as np

HIDDEN, EXPERTS, K, WIDTH = 1024, 32, 4, 512  # 201 MB of fp32 experts: far past the caches
TOKENS = (1, 256)
MODEL_LAYERS, MODEL_CONTEXT = 4, 256


def graphs(weights: dict[str, np.ndarray]) -> dict:
    """name -> ModelProto over x [T, HIDDEN] -> y [T, HIDDEN]."""
    from onnx import TensorProto, helper, numpy_helper

    from engines.onnxruntime_build import quantize_experts

    def model(nodes, names):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", HIDDEN])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", HIDDEN])
        inits = [numpy_helper.from_array(weights[n], n) for n in names]
        inits += [numpy_helper.from_array(np.array(v, dtype=np.int64), n) for n, v in
                  (("k", [K]), ("split", [WIDTH, WIDTH]), ("one", [1]), ("zero", [0]))]
        graph = helper.make_graph(nodes, "ffn", [x], [y], inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])

    def swiglu(gate_up, out, split="split"):  # gate_up [..., 2I] as [gate | up] -> silu(gate) * up
        return [helper.make_node("Split", [gate_up, split], ["g", "u"], axis=-1),
                helper.make_node("Sigmoid", ["g"], ["sg"]), helper.make_node("Mul", ["g", "sg"], ["silu"]),
                helper.make_node("Mul", ["silu", "u"], [out])]

    router = [helper.make_node("MatMul", ["x", "router"], ["logits"])]
    top_k = [helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
             helper.make_node("TopK", ["probs", "k"], ["topv", "topi"], axis=-1),
             helper.make_node("ReduceSum", ["topv", "one"], ["topsum"], keepdims=1),
             helper.make_node("Div", ["topv", "topsum"], ["topw"])]
    moe = model(router + [helper.make_node(
        "MoE", ["x", "logits", "fc1_interleaved", "", "fc2"], ["y"], domain="com.microsoft", k=K,
        activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
        normalize_routing_weights=1)], ["router", "fc1_interleaved", "fc2"])
    gather = model(router + top_k + [
        helper.make_node("Gather", ["fc1_t", "topi"], ["w1"], axis=0),  # [T, k, H, 2I]
        helper.make_node("Unsqueeze", ["x", "one"], ["x3"]),  # [T, 1, H]
        helper.make_node("Unsqueeze", ["x3", "one"], ["x4"]),  # [T, 1, 1, H]
        helper.make_node("MatMul", ["x4", "w1"], ["h"]),  # [T, k, 1, 2I]
        *swiglu("h", "act"),
        helper.make_node("Gather", ["fc2_t", "topi"], ["w2"], axis=0),  # [T, k, I, H]
        helper.make_node("MatMul", ["act", "w2"], ["o"]),  # [T, k, 1, H]
        helper.make_node("Reshape", ["o", "o_shape"], ["o3"]),  # [T, k, H]
        helper.make_node("Unsqueeze", ["topw", "none_axis"], ["w3"]),  # [T, k, 1]
        helper.make_node("Mul", ["o3", "w3"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "one"], ["y"], keepdims=0)],
        ["router", "fc1_t", "fc2_t", "o_shape", "none_axis"])
    dense = model(router + top_k + [
        helper.make_node("MatMul", ["x", "fc1_all"], ["h"]),  # [T, E * 2I]
        helper.make_node("Reshape", ["h", "expert_rows"], ["h3"]),  # [T, E, 2I]
        *swiglu("h3", "act"),  # [T, E, I]
        helper.make_node("Transpose", ["act"], ["act_e"], perm=[1, 0, 2]),  # [E, T, I]
        helper.make_node("MatMul", ["act_e", "fc2_t"], ["o"]),  # [E, T, H]
        helper.make_node("Shape", ["logits"], ["logits_shape"]),
        helper.make_node("ConstantOfShape", ["logits_shape"], ["zeros"]),
        helper.make_node("ScatterElements", ["zeros", "topi", "topw"], ["route"], axis=1),  # [T, E]
        helper.make_node("Transpose", ["route"], ["route_e"], perm=[1, 0]),
        helper.make_node("Unsqueeze", ["route_e", "minus_one"], ["route3"]),  # [E, T, 1]
        helper.make_node("Mul", ["o", "route3"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted", "zero"], ["y"], keepdims=0)],
        ["router", "fc1_all", "fc2_t", "expert_rows", "minus_one"])
    active = model([helper.make_node("MatMul", ["x", "active_fc1"], ["h"]), *swiglu("h", "act", "active_split"),
                    helper.make_node("MatMul", ["act", "active_fc2"], ["y"])],
                   ["active_fc1", "active_fc2", "active_split"])
    quantized = {}
    for bits, block in ((8, 32), (8, None), (4, 32), (4, None)):
        quantized[f"QMoE int{bits} {'block 32' if block else 'per row'}"] = qmoe = copy.deepcopy(moe)
        quantize_experts(qmoe, bits, block)
    return {"moe": moe, "gather": gather, "dense": dense, "dense MLP of the active width": active, **quantized}


def make_weights(rng) -> dict[str, np.ndarray]:
    gate, up = (rng.standard_normal((EXPERTS, WIDTH, HIDDEN), dtype=np.float32) * 0.03 for _ in range(2))
    down = rng.standard_normal((EXPERTS, HIDDEN, WIDTH), dtype=np.float32) * 0.03
    fc1 = np.concatenate([gate, up], axis=1)  # [E, 2I, H], [gate; up] as transformers holds it
    return {
        "router": rng.standard_normal((HIDDEN, EXPERTS), dtype=np.float32) * 0.03,
        "fc1_interleaved": np.stack([gate, up], axis=2).reshape(EXPERTS, 2 * WIDTH, HIDDEN),
        "fc2": down,
        "fc1_t": np.ascontiguousarray(fc1.transpose(0, 2, 1)),  # [E, H, 2I]
        "fc2_t": np.ascontiguousarray(down.transpose(0, 2, 1)),  # [E, I, H]
        "fc1_all": np.ascontiguousarray(fc1.transpose(2, 0, 1).reshape(HIDDEN, EXPERTS * 2 * WIDTH)),
        "expert_rows": np.array([0, EXPERTS, 2 * WIDTH], dtype=np.int64),
        "o_shape": np.array([0, K, HIDDEN], dtype=np.int64),
        "none_axis": np.array([-1], dtype=np.int64),
        "minus_one": np.array([-1], dtype=np.int64),
        "active_fc1": rng.standard_normal((HIDDEN, 2 * K * WIDTH), dtype=np.float32) * 0.03,
        "active_fc2": rng.standard_normal((K * WIDTH, HIDDEN), dtype=np.float32) * 0.03,
        "active_split": np.array([K * WIDTH, K * WIDTH], dtype=np.int64),
    }


def median_us(session, x: np.ndarray, calls: int) -> float:
    for _ in range(5):
        session.run(None, {"x": x})
    times = []
    for _ in range(calls):
        began = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - began)
    return float(np.median(times)) * 1e6


def routing_ops(threads: int, calls: int) -> dict[tuple[str, int], float]:
    """(routing, tokens) -> median us of DeepseekMoE.choose over router logits [tokens, EXPERTS]."""
    import logging
    import tempfile
    import warnings
    from pathlib import Path

    import onnxruntime as ort
    import torch

    from export.model.moe import DeepseekMoE
    from kvforge.manifest import ModelSpec

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    times = {}
    for routing, groups, kept in (("greedy", 1, 1), ("group_limited_greedy", 8, 3), ("noaux_tc", 8, 4)):
        spec = ModelSpec(architecture="DeepseekV3ForCausalLM", num_layers=1, hidden_size=HIDDEN, num_heads=1,
                         num_kv_heads=1, head_dim=64, intermediate_size=WIDTH, vocab_size=2, max_positions=1,
                         rope_theta=1e4, rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False,
                         num_experts=EXPERTS, experts_per_token=K, expert_intermediate_size=WIDTH, sparse_layers=(0,),
                         norm_topk_prob=routing == "noaux_tc", routing=routing, expert_groups=groups,
                         expert_groups_per_token=kept, routed_scaling_factor=2.5)
        block = DeepseekMoE(spec).eval()
        block.forward = block.choose  # the routing alone: logits -> (the node's logits, the factor)
        torch.nn.init.normal_(block.gate.weight, 0.0, 0.1)
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            path = str(Path(tmp) / "choose.onnx")
            torch.onnx.export(block, (torch.randn(4, EXPERTS),), path, dynamo=True, opset_version=24, report=False,
                              dynamic_shapes=({0: torch.export.Dim("T", min=1)},), input_names=["x"])
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
            for tokens in TOKENS:
                x = np.random.default_rng(tokens).standard_normal((tokens, EXPERTS), dtype=np.float32)
                (logits, factor), (eager_logits, eager_factor) = session.run(None, {"x": x}), block(torch.from_numpy(x))
                np.testing.assert_allclose(factor, eager_factor.numpy(), rtol=1e-5)
                np.testing.assert_allclose(logits, eager_logits.numpy(), rtol=1e-5)  # -inf at the same experts
                times[routing, tokens] = median_us(session, x, calls)
    return times


def whole_models(threads: int, steps: int) -> dict[str, float]:
    """name -> decode tokens/s at batch 1, MODEL_CONTEXT cached tokens (random weights, fp32, in place)."""
    import tempfile
    from pathlib import Path

    import torch
    import transformers

    from bench.common import TRAINED_MODEL, decode_rate, interleaved_steps
    from export.__main__ import export
    from runtime.runners import open_runner

    common = dict(hidden_size=HIDDEN, num_hidden_layers=MODEL_LAYERS, num_attention_heads=16, num_key_value_heads=4,
                  head_dim=64, vocab_size=4096, max_position_embeddings=1024, intermediate_size=K * WIDTH)
    configs = {"moe": transformers.Qwen3MoeConfig(num_experts=EXPERTS, num_experts_per_tok=K,
                                                  moe_intermediate_size=WIDTH, norm_topk_prob=True, **common),
               "dense": transformers.Qwen3Config(**common)}
    runners = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in configs.items():
            config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(Path(tmp) / name)
            for file in ("tokenizer.json", "tokenizer_config.json"):
                (Path(tmp) / name / file).write_bytes((TRAINED_MODEL / file).read_bytes())
            export(str(Path(tmp) / name), Path(tmp) / f"{name}-export", "inplace", "fp32", 1024)
            runners[name] = (open_runner(Path(tmp) / f"{name}-export", threads=threads), None)
        times = interleaved_steps(runners, 1, MODEL_CONTEXT, steps, rounds=3)
    return {name: decode_rate(1, seconds) for name, seconds in times.items()}


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--models", action="store_true", help="also time whole exports (MoE vs dense, batch 1)")
    parser.add_argument("--routing", action="store_true", help="also time DeepSeek's routing ops alone")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = args.threads
    options.log_severity_level = 3  # the graphs share one list of constants; each leaves some unused
    sessions = {name: ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
                for name, m in graphs(make_weights(rng)).items()}
    print(f"sparse FFN: hidden {HIDDEN}, {EXPERTS} experts of width {WIDTH}, top {K}; {args.threads} threads, "
          f"median of {args.calls} calls")
    for tokens in TOKENS:
        x = rng.standard_normal((tokens, HIDDEN), dtype=np.float32)
        outputs = {name: s.run(None, {"x": x})[0] for name, s in sessions.items()}
        for name in ("gather", "dense"):  # the same function as the MoE node's
            np.testing.assert_allclose(outputs[name], outputs["moe"], atol=1e-4, rtol=1e-3)
        scale = np.abs(outputs["moe"]).max()
        errors = {name: np.abs(out - outputs["moe"]).max() / scale for name, out in outputs.items() if "QMoE" in name}
        times = {name: median_us(s, x, args.calls if tokens == 1 else max(10, args.calls // 10))
                 for name, s in sessions.items()}
        print(f"{tokens} token(s): " + ", ".join(f"{name} {us:,.0f} us" for name, us in times.items()))
        print("  quantized experts' max error / max |output|: "
              + ", ".join(f"{name} {error:.3f}" for name, error in errors.items()))
    if args.routing:
        for (routing, tokens), us in routing_ops(args.threads, args.calls).items():
            print(f"DeepSeek {routing} routing, {tokens} token(s): {us:,.1f} us")
    if args.models:
        rates = whole_models(args.threads, args.calls // 4)
        print(f"{MODEL_LAYERS}-layer exports, batch 1 at {MODEL_CONTEXT} tokens: "
              + ", ".join(f"{name} {rate:.1f} tokens/s" for name, rate in rates.items())
              + f" (moe step = {rates['dense'] / rates['moe']:.2f}x dense's)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
