"""Write the Triton model repository's config.pbtxt files from an engine's manifest.

    python -m engines repository ENGINE_DIR --repo DIR [--slots N] [--kv-cache-mib M]

Models: `llm` (decoupled streaming generation with continuous batching), `step` (the raw
decoder step with dynamic batching: logits of every position, for scoring), and thin aliases
that forward to `llm` without a second engine: `ensemble` and `tensorrt_llm_bls` (the model
names TensorRT-LLM clients default to, same inputs as `llm`) and `vllm_model` (the vLLM
backend's convention: max_batch_size 0, `sampling_parameters` as JSON). Batch sizes, queue
bounds and instance kinds come from kvforge.limits, so Triton and the runtime agree. The engine
dir is recorded relative to the repository: repository and engine move together (e.g. into a
docker image). The committed model.py files are copied when DIR is not this checkout's
model_repository.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
from pathlib import Path

from kvforge.cli import fail_cleanly
from kvforge.manifest import Manifest, ManifestError
from kvforge.limits import DEFAULT_KV_CACHE_BYTES, Limits

DEFAULT_ENGINE_DIR = Path("model_repository/llm/1/engine")
MODEL_SOURCES = Path(__file__).resolve().parents[1] / "model_repository"
MODELS = ("llm", "step", "ensemble", "tensorrt_llm_bls", "vllm_model")
# model -> the committed directory its model.py comes from (the two TensorRT-LLM names share one)
SOURCES = {"ensemble": "tensorrt_llm_bls"}
# Arrivals within this window reach execute() together. The llm model's execute() returns at
# once and a request that arrives mid-step joins the engine's next step (continuous batching),
# so waiting would only add to its TTFT: requests queued meanwhile still arrive as one batch.
LLM_QUEUE_DELAY_US = 0
STEP_QUEUE_DELAY_US = 2000


def tensor(name: str, dtype: str, dims: list[int], optional: bool = False, ragged: bool = False) -> str:
    extra = (" optional: true" if optional else "") + (" allow_ragged_batch: true" if ragged else "")
    return f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{extra} }}'


# The llm model's inputs: TensorRT-LLM's ensemble / tensorrt_llm_bls names and dtypes, plus the
# tensorrt_llm model's input_ids / input_lengths / request_output_len / stop that llama-index
# sends to cancel (request_output_len UINT32 as it sends it), and older aliases of renamed
# inputs (random_seed, min_length). README "Inputs and outputs" says what each does.
LLM_INPUTS = [
    tensor("text_input", "TYPE_STRING", [1], optional=True),
    tensor("input_ids", "TYPE_INT32", [-1], optional=True, ragged=True),
    tensor("input_lengths", "TYPE_INT32", [1], optional=True),
    tensor("max_tokens", "TYPE_INT32", [1], optional=True),
    tensor("request_output_len", "TYPE_UINT32", [1], optional=True),
    tensor("stream", "TYPE_BOOL", [1], optional=True),
    tensor("stop", "TYPE_BOOL", [1], optional=True),
    tensor("exclude_input_in_output", "TYPE_BOOL", [1], optional=True),
    tensor("stop_words", "TYPE_STRING", [-1], optional=True, ragged=True),
    tensor("bad_words", "TYPE_STRING", [-1], optional=True, ragged=True),
    tensor("end_id", "TYPE_INT32", [1], optional=True),
    tensor("pad_id", "TYPE_INT32", [1], optional=True),
    tensor("temperature", "TYPE_FP32", [1], optional=True),
    tensor("top_k", "TYPE_INT32", [1], optional=True),
    tensor("top_p", "TYPE_FP32", [1], optional=True),
    tensor("seed", "TYPE_UINT64", [1], optional=True),
    tensor("random_seed", "TYPE_UINT64", [1], optional=True),
    tensor("repetition_penalty", "TYPE_FP32", [1], optional=True),
    tensor("presence_penalty", "TYPE_FP32", [1], optional=True),
    tensor("frequency_penalty", "TYPE_FP32", [1], optional=True),
    tensor("min_tokens", "TYPE_INT32", [1], optional=True),
    tensor("min_length", "TYPE_INT32", [1], optional=True),
    tensor("length_penalty", "TYPE_FP32", [1], optional=True),
    tensor("beam_width", "TYPE_INT32", [1], optional=True),
    tensor("num_return_sequences", "TYPE_INT32", [1], optional=True),
    tensor("return_log_probs", "TYPE_BOOL", [1], optional=True),
    tensor("return_num_input_tokens", "TYPE_BOOL", [1], optional=True),
    tensor("return_num_output_tokens", "TYPE_BOOL", [1], optional=True),
    # the prefix cache: a tenant's salt, and the operator's clear (needs the control key)
    tensor("cache_salt", "TYPE_STRING", [1], optional=True),
    tensor("clear_prefix_cache", "TYPE_BOOL", [1], optional=True),
    tensor("control_key", "TYPE_STRING", [1], optional=True),
]
LLM_OUTPUTS = [
    tensor("text_output", "TYPE_STRING", [-1]),
    tensor("output_ids", "TYPE_INT32", [-1]),
    tensor("num_input_tokens", "TYPE_INT32", [1]),
    tensor("num_output_tokens", "TYPE_INT32", [1]),  # tokens in this response
    tensor("sequence_length", "TYPE_INT32", [1]),  # tokens generated so far
    tensor("finish_reason", "TYPE_STRING", [1]),  # "" until the last response
    tensor("cum_log_probs", "TYPE_FP32", [-1]),
    tensor("output_log_probs", "TYPE_FP32", [-1, -1]),
    tensor("cached_tokens", "TYPE_INT32", [1]),  # prompt tokens served by the prefix cache
]
# The vLLM backend's inputs and outputs (its model.py's auto-completed config), with max_batch_size 0
VLLM_INPUTS = [
    tensor("text_input", "TYPE_STRING", [1]),
    tensor("stream", "TYPE_BOOL", [1], optional=True),
    tensor("sampling_parameters", "TYPE_STRING", [1], optional=True),
    tensor("exclude_input_in_output", "TYPE_BOOL", [1], optional=True),
    tensor("return_finish_reason", "TYPE_BOOL", [1], optional=True),
    tensor("return_cumulative_logprob", "TYPE_BOOL", [1], optional=True),
    tensor("return_num_input_tokens", "TYPE_BOOL", [1], optional=True),
    tensor("return_num_output_tokens", "TYPE_BOOL", [1], optional=True),
]
VLLM_OUTPUTS = [
    tensor("text_output", "TYPE_STRING", [-1]),
    tensor("finish_reason", "TYPE_STRING", [-1]),
    tensor("cumulative_logprob", "TYPE_FP32", [-1]),
    tensor("num_input_tokens", "TYPE_UINT32", [1]),
    tensor("num_output_tokens", "TYPE_UINT32", [-1]),
]
ALIAS_QUEUE_DELAY_US = 0


def parameters(values: dict[str, object]) -> str:
    return ",\n".join(f'  {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in values.items())


def model_config(name: str, max_batch_size: int, inputs: list[str], outputs: list[str], queue_delay_us: int,
                 kind: str, params: dict[str, object], decoupled: bool = False) -> str:
    policy = "model_transaction_policy { decoupled: true }\n" if decoupled else ""
    # dynamic batching needs a batch dimension; max_batch_size 0 (vllm_model) has none
    batching = f'dynamic_batching {{ max_queue_delay_microseconds: {queue_delay_us} }}\n' if max_batch_size else ""
    return (f'# generated by `python -m engines repository` from the engine manifest; do not edit\n'
            f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n{policy}{batching}'
            f'instance_group [ {{ count: 1 kind: {kind} }} ]\n'
            f'input [\n' + ",\n".join(inputs) + '\n]\n'
            f'output [\n' + ",\n".join(outputs) + '\n]\n'
            f'parameters [\n{parameters(params)}\n]\n')


def write_repository(engine_dir: Path, repo: Path, slots: int | None = None,
                     kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES) -> None:
    engine_dir, repo = Path(engine_dir), Path(repo)
    manifest = Manifest.load(engine_dir)
    if not (engine_dir / "tokenizer.json").is_file():
        raise ManifestError(f"{engine_dir} has no tokenizer.json; the llm model needs it")
    limits = Limits.from_manifest(manifest, slots=slots, kv_cache_bytes=kv_cache_bytes)
    # one instance owns the whole KV pool and all CPU threads; on a GPU host it owns the device
    kind = "KIND_GPU" if manifest.engine.get("backend") == "tensorrt" else "KIND_CPU"
    relative_engine = os.path.relpath(engine_dir.resolve(), repo.resolve())
    configs = {
        "llm": model_config(
            "llm", limits.slots, LLM_INPUTS, LLM_OUTPUTS, LLM_QUEUE_DELAY_US, kind,
            dict(engine_dir=relative_engine, slots=limits.slots, max_waiting=limits.max_waiting,
                 kv_cache_bytes=kv_cache_bytes),
            decoupled=True),
        "step": model_config(
            "step", limits.score_rows,
            [tensor("input_ids", "TYPE_INT64", [-1], ragged=True)],
            [tensor("logits", "TYPE_FP32", [-1, manifest.model.vocab_size])],
            STEP_QUEUE_DELAY_US, kind, dict(engine_dir=relative_engine)),
        # the aliases only forward requests: a CPU instance each, whatever runs the engine
        **{name: model_config(name, limits.slots, LLM_INPUTS, LLM_OUTPUTS, ALIAS_QUEUE_DELAY_US, "KIND_CPU",
                              dict(forward_to="llm"), decoupled=True)
           for name in ("ensemble", "tensorrt_llm_bls")},
        "vllm_model": model_config("vllm_model", 0, VLLM_INPUTS, VLLM_OUTPUTS, ALIAS_QUEUE_DELAY_US, "KIND_CPU",
                                   dict(forward_to="llm"), decoupled=True),
    }
    for name, config in configs.items():
        version = repo / name / "1"
        version.mkdir(parents=True, exist_ok=True)
        source = MODEL_SOURCES / SOURCES.get(name, name) / "1" / "model.py"
        if source.resolve() != (version / "model.py").resolve():
            shutil.copyfile(source, version / "model.py")
        (repo / name / "config.pbtxt").write_text(config)


def engine_dir_of(repo: Path, model: str) -> Path:
    """The engine dir the llm model's config.pbtxt names (relative to the repository)."""
    config = (repo / model / "config.pbtxt").read_text()
    found = re.search(r'key: "engine_dir" value: \{ string_value: "([^"]+)" \}', config)
    if not found:
        raise ValueError(f"{repo / model / 'config.pbtxt'} names no engine_dir; run `python -m engines repository`")
    return (repo / found.group(1)).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines repository", description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_dir", type=Path, nargs="?", default=DEFAULT_ENGINE_DIR)
    parser.add_argument("--repo", type=Path, default=Path("model_repository"))
    parser.add_argument("--slots", type=int, help="sequences decoding at once (default: derived from the manifest)")
    parser.add_argument("--kv-cache-mib", type=int, default=DEFAULT_KV_CACHE_BYTES >> 20,
                        help="KV memory the llm model may promise (default: %(default)s)")
    args = parser.parse_args(argv)

    def run() -> int:
        write_repository(args.engine_dir, args.repo, args.slots, args.kv_cache_mib << 20)
        print(f"wrote {', '.join(f'{args.repo}/{m}/config.pbtxt' for m in MODELS)} for {args.engine_dir}")
        return 0

    return fail_cleanly(run)


if __name__ == "__main__":
    sys.exit(main())
