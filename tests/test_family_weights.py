"""Quantized weights for every family (tests/families.py's tiny checkpoints): `engines build
--weights int8|int4` passes its parity gate, the engine generates through LLMEngine, and its
log-probs of the fp32 engine's greedy tokens stay within logprob_bound() of the fp32 engine's.

The bound comes from the build's own gate, not from a run: the gate lets an engine's logits move
by at most PARITY_TOLERANCE[weights] of the export's logit range (the quantizer's error: int8
per-tensor weights and per-tensor dynamic activations, int4 blocks of 32 with int8 activations),
and log p(t) = z_t - logsumexp(z) moves by at most |dz_t| + max|dz| <= 2 max|dz| (logsumexp is
1-Lipschitz in the max norm). So |d log p| <= 2 x tolerance x range, the logit range the gate saw on
its prompts (recorded in the engine's manifest: parity_logit_range). The gate checks other prompts
than these; the error is the rounded weights', the same on any prompt of this scale."""
from __future__ import annotations

import pytest

from engines.onnxruntime_build import PARITY_TOLERANCE
from tests.families import FAMILIES, NEW_TOKENS

QUANTIZED = ("int8", "int4")


def logprob_bound(weights: str, logit_range: float) -> float:
    return 2 * PARITY_TOLERANCE[weights] * logit_range


def float_matrices(engine_dir) -> set[str]:
    """The ops reading the engine's float32 initializers of two or more dimensions, int4's
    MatMulNBits scales aside."""
    import onnx

    from kvforge.manifest import MODEL_FILE
    from kvforge.onnx_graphs import all_nodes

    model = onnx.load(str(engine_dir / MODEL_FILE))
    floats = {i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT and len(i.dims) >= 2}
    return {n.op_type for n in all_nodes(model.graph) if floats & set(n.input)} - {"MatMulNBits"}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_engines_generate_near_fp32(family_exports, family_checkpoints, family, tmp_path):
    """Each engine builds from the family's fp32 export (the CLI, in process); teacher-forced on
    the fp32 engine's greedy tokens, the quantized engines' log-probs stay within the bound and
    differ from fp32's (the weights were quantized); every matrix but the embedding table is
    quantized (a tied table too, as the lm_head); LLMEngine generates what the engine's runner
    generates greedily."""
    from engines.__main__ import main as engines_cli
    from kvforge.manifest import Manifest
    from runtime.greedy import followed_logprobs
    from runtime.llm_engine import LLMEngine, SamplingParams
    from runtime.runners import open_runner

    export_dir, prompt = family_exports(family), family_checkpoints[family].prompt
    engines = {}
    for weights in ("fp32", *QUANTIZED):
        engines[weights] = tmp_path / weights
        assert engines_cli(["build", str(export_dir), "--backend", "onnxruntime", "--weights", weights,
                            "--threads", "1", "--out", str(engines[weights])]) == 0
    built = {w: Manifest.load(d).engine for w, d in engines.items()}
    tokens, logprobs = followed_logprobs([open_runner(engines[w], threads=1) for w in engines], prompt, NEW_TOKENS)
    assert len(set(tokens)) > 8  # not a degenerate loop
    for weights, got in zip(QUANTIZED, logprobs[1:]):
        drift = max(abs(a - b) for a, b in zip(got, logprobs[0]))
        assert 0 < drift <= logprob_bound(weights, built[weights]["parity_logit_range"]), (weights, drift)
        assert float_matrices(engines[weights]) == {"Gather"}  # the embedding table alone stays float
        own = followed_logprobs([open_runner(engines[weights], threads=1)], prompt, NEW_TOKENS)[0]
        with LLMEngine(engines[weights], threads=1, prefix_cache=False) as engine:
            result = engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))[0]
        assert result.token_ids == own
