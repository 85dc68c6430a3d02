"""The one stand-in the suite allows for a runner: OrtInplaceRunner's own KV slots and copies
(its numpy buffers, SlotReservation, resize / move / read_blocks / write_blocks, unchanged code)
with a step that writes each new token's K/V as a function of the token and its position instead
of running a graph. The packed rows' and the prefix cache's tests then run in milliseconds and can
check every position a move, a resize or a copy left in a slot; what the graph computes, and that
the engine decodes the same with a hit or a swapped row, stays with the real-export tests."""
from __future__ import annotations

import numpy as np

from kvforge.manifest import Manifest, ModelSpec
from runtime.runners.base import Runner
from runtime.runners.ort import OrtInplaceRunner

VOCAB = 256


def tiny_manifest(max_seq_len: int = 512, kv_dtype: str = "fp32") -> Manifest:
    """A two-layer manifest with no export behind it (the stand-in reads only its KV sizes)."""
    spec = ModelSpec("LlamaForCausalLM", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, vocab_size=VOCAB, max_positions=max_seq_len, rope_theta=10000.0,
                     rms_norm_eps=1e-6, attention_bias=False, tie_word_embeddings=False)
    return Manifest(spec, "inplace", kv_dtype, max_seq_len, tokenizer={}, source={}, versions={})


def kv_of(tokens, start: int) -> np.ndarray:
    """The K/V value the stand-in writes for tokens at positions start.. (token + position / 4096:
    exact in float32 for the sizes used here)."""
    return np.asarray(tokens, np.float32) + (start + np.arange(len(tokens), dtype=np.float32)) / 4096


class ArithmeticRunner(OrtInplaceRunner):
    def __init__(self, manifest: Manifest | None = None):
        Runner.__init__(self, manifest or tiny_manifest())  # no ONNX Runtime session: nothing runs a graph

    def step(self, input_ids, write_positions, num_new, logit_positions=None, prompt_lengths=None):
        positions = self.check_step(np.asarray(input_ids), np.asarray(write_positions), np.asarray(num_new),
                                    logit_positions)
        for b, (start, n) in enumerate(zip(np.asarray(write_positions), np.asarray(num_new))):
            for buf in self.buffers.values():
                buf[b, :, start:start + n] = kv_of(input_ids[b, :n], int(start))[None, :, None]
        return np.zeros((len(input_ids), positions.shape[1], VOCAB), np.float32)

    def row_kv(self, row: int, length: int) -> np.ndarray:
        """The values row holds at positions 0..length-1 (every tensor, head and channel agree)."""
        values = [buf[row, :, :length] for buf in self.buffers.values()]
        assert all((v == v[:1, :, :1]).all() for v in values) and all((v == values[0]).all() for v in values)
        return values[0][0, :, 0]
