"""Logits only where generation samples them: the inplace graph projects logit_positions alone,
and the generation path's outputs are those of the every-position graph (issue #13)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from kvforge.manifest import Manifest, io_tensors
from runtime.runners import open_runner
from runtime.runners.base import last_positions, pack_step

LENGTHS = (37, 5, 64, 1)  # right-padded rows of different lengths, one of a single token
CHUNK = 24  # prompts go in chunks, so a chunk's last real position differs per row


def generation_vs_every_position(directory, steps: int = 12) -> tuple[float, list[int], list[int]]:
    """Chunked prefill then greedy decode, twice in lockstep: one runner asks for each row's last
    real position, the other for every position (indexing the sampled one afterwards).
    Returns (max abs diff of the sampled logits, greedy tokens of each)."""
    fast, full = open_runner(directory), open_runner(directory)
    rows, rng = len(LENGTHS), np.random.default_rng(3)
    vocab = fast.manifest.model.vocab_size
    prompts = [rng.integers(3, vocab, n) for n in LENGTHS]
    for r in (fast, full):
        r.allocate(rows, r.bucket_for(max(LENGTHS) + steps))
    cached, worst = np.zeros(rows, np.int64), 0.0
    last = {"fast": np.zeros(rows, np.int64), "full": np.zeros(rows, np.int64)}
    tokens = {"fast": [], "full": []}
    while (pending := np.array(LENGTHS) - cached).max() > 0:
        # a row whose prompt is in re-feeds its last token at its end (overwritten by decode)
        num_new = np.clip(pending, 1, CHUNK)
        starts = np.where(pending > 0, cached, cached - 1)
        ids = np.zeros((rows, int(num_new.max())), np.int64)
        for b, p in enumerate(prompts):
            ids[b, :num_new[b]] = p[starts[b]:starts[b] + num_new[b]]
        sampled = fast.step(ids, starts, num_new, last_positions(num_new))[:, 0]
        every = full.step(ids, starts, num_new)[np.arange(rows), num_new - 1]
        worst = max(worst, float(np.abs(sampled - every).max()))
        ending = (pending > 0) & (pending <= CHUNK)
        last["fast"][ending], last["full"][ending] = sampled[ending].argmax(-1), every[ending].argmax(-1)
        cached = starts + num_new
    positions = cached.copy()
    for _ in range(steps):
        ones = np.ones(rows, np.int64)
        a = fast.step(last["fast"][:, None], positions, ones, last_positions(ones))[:, 0]
        b = full.step(last["full"][:, None], positions, ones)[:, 0]
        worst = max(worst, float(np.abs(a - b).max()))
        tokens["fast"].append(last["fast"].tolist())
        tokens["full"].append(last["full"].tolist())
        last = {"fast": a.argmax(-1), "full": b.argmax(-1)}
        positions = positions + 1
    return worst, tokens["fast"], tokens["full"]


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_sampled_logits_equal_the_every_position_graph(exports, dtype):
    worst, fast, full = generation_vs_every_position(exports("inplace", dtype))
    assert worst <= 1e-5
    assert fast == full


def test_inplace_graph_projects_only_the_asked_positions(exports):
    directory = exports("inplace", "fp32")
    manifest = Manifest.load(directory)
    runner = open_runner(directory)
    runner.allocate(2, 64)
    ids = np.arange(3, 3 + 20, dtype=np.int64).reshape(2, 10)
    out = runner.step(ids, np.zeros(2, np.int64), np.array([10, 7]), np.array([[9, 0, 4], [6, 6, 1]]))
    assert out.shape == (2, 3, manifest.model.vocab_size)
    graph = onnx.load(str(directory / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input[:7]] == ["input_ids", "positions", "write_positions", "row_tokens",
                                                  "attention_extent", "token_slots", "logit_index"]
    assert graph.output[0].type.tensor_type.shape.dim[0].dim_param == "kept"
    # the final norm and lm_head read the hidden states gathered at logit_index, not every token
    producer = {out: n for n in graph.node for out in n.output}
    gather = producer[[n for n in graph.node if n.op_type == "RMSNormalization"][-1].input[0]]
    index = producer.get(gather.input[1])
    assert gather.op_type == "Gather" and "logit_index" in (gather.input[1], *(index.input if index else ()))
    for bad, message in (([[10], [0]], "0..9"), ([[-1], [0]], "0..9"), ([[0]], r"\[rows=2")):
        with pytest.raises(ValueError, match=message):
            runner.step(ids, np.zeros(2, np.int64), np.array([10, 7]), np.array(bad))


def test_concat_export_keeps_the_optimum_contract(exports):
    """The concat layout's inputs and outputs are unchanged: every position's logits, no new input;
    its runner picks the asked positions afterwards."""
    directory = exports("concat", "fp32")
    graph = onnx.load(str(directory / "model.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input[:4]] == ["input_ids", "attention_mask", "position_ids",
                                                  "past_key_values.0.key"]
    assert [d.dim_param for d in graph.output[0].type.tensor_type.shape.dim[:2]] == ["batch", "seq"]
    worst, fast, full = generation_vs_every_position(directory, steps=4)
    assert worst == 0.0 and fast == full


def test_eager_model_gathers_like_the_export(exports):
    """export.model eagerly, fed by the runner's pack_step: the inplace model's logits at
    logit_index equal the concat model's at those positions (the path the exporter is checked against)."""
    import torch

    from export import checkpoint
    from export.__main__ import resolve_model
    from kvforge.manifest import KV_DTYPES

    source = resolve_model("tiny-llama")
    _, inplace = checkpoint.load_model(source, "inplace", KV_DTYPES["fp32"])
    _, concat = checkpoint.load_model(source, "concat", KV_DTYPES["fp32"])
    spec = inplace.spec
    ids = torch.randint(3, spec.vocab_size, (2, 9))
    num_new, positions = np.array([9, 6]), np.array([[8], [5]])
    feeds = pack_step(ids.numpy(), np.zeros(2, np.int64), num_new, positions)
    with torch.no_grad():
        buffers = [torch.zeros(2, spec.num_kv_heads, 16, spec.head_dim)] * (2 * spec.num_layers)
        args = [torch.from_numpy(feeds[t.name]) for t in io_tensors(spec, "inplace", "fp32")[0][:7]]
        kept = inplace.eval()(*args, *buffers)[0]
        empty = [torch.zeros(2, spec.num_kv_heads, 0, spec.head_dim)] * (2 * spec.num_layers)
        mask = torch.from_numpy((np.arange(9)[None] < num_new[:, None]).astype(np.int64))
        every = concat.eval()(ids, mask, torch.arange(9).repeat(2, 1), *empty)[0]
    assert kept.shape == (2, spec.vocab_size)
    torch.testing.assert_close(kept, every[[0, 1], [8, 5]],
                               atol=1e-5, rtol=0)
