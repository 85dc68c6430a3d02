"""python -m export --model PRESET_OR_DIR --out DIR [--kv-layout ...] [--kv-dtype ...] [--max-seq-len N]

Writes DIR/model.onnx, DIR/manifest.json and the tokenizer files, atomically (kvforge.cli).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from kvforge.manifest import (DEFAULT_MAX_CHUNK, KV_DTYPES, KV_LAYOUTS, Manifest, ManifestError, ModelSpec,
                              check_attention_dtype, check_layout_dtype, layer_rings)
from kvforge import env
from kvforge.cli import atomic_directory, fail_cleanly, free_large_buffers_at_once, progress

CHECKPOINT_CACHE = Path(os.environ.get(env.CHECKPOINTS, "build/checkpoints"))
PARITY_SLICE = "parity-slice"
PARITY_SLICE_GIB = 4.0  # about 1B parameters in float32
PARITY_SLICE_LAYERS = 2


def resolve_model(model: str) -> Path:
    """A preset name becomes its materialized checkpoint directory; anything else is a path."""
    from export.presets import PRESETS, materialize

    if model in PRESETS:
        return materialize(model, CHECKPOINT_CACHE)
    path = Path(model)
    if not path.exists():
        raise ManifestError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor an existing path")
    return path


def library_versions() -> dict:
    import onnx
    import onnxscript
    import torch
    import transformers

    return {"kvforge": "0.1.0", "exporter": "torch.onnx.export(dynamo=True)", "torch": torch.__version__,
            "transformers": transformers.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "python": sys.version.split()[0]}


def export(model: str, out: Path, kv_layout: str, kv_dtype: str, max_seq_len: int | None,
           max_chunk: int | None = None, layers: int | None = None,
           parity_slice_gib: float = PARITY_SLICE_GIB) -> Manifest:
    """max_chunk: the most tokens a step may write per row, for a model with sliding windows
    (default DEFAULT_MAX_CHUNK; none for one without): their layers then hold a ring of the
    window plus one chunk (kvforge.manifest.ring_tokens), not max_seq_len positions. layers: the
    checkpoint's first decoder layers only (a parity slice).

    An export whose weights pass parity_slice_gib also holds a slice of itself (the first
    PARITY_SLICE_LAYERS layers, in out/parity-slice): what the engine build's parity gate and
    export.verify run, since two copies of a 7-8B model's float32 weights do not fit in RAM."""
    from export import checkpoint
    from export.onnx_export import export_onnx

    check_layout_dtype(kv_layout, kv_dtype)
    started = time.perf_counter()
    with progress(f"resolving model {model}"):
        source = resolve_model(model)
        config = checkpoint.read_config(source)
        if layers is not None:
            config = {**config, "num_hidden_layers": layers,
                      **({"layer_types": config["layer_types"][:layers]} if "layer_types" in config else {})}
        spec = ModelSpec.from_hf_config(config)
        check_attention_dtype(spec, kv_dtype)
        tokenizer = checkpoint.tokenizer_info(source)
    max_seq_len = max_seq_len if max_seq_len is not None else spec.max_positions
    if spec.sliding_window is None and max_chunk is not None:
        raise ManifestError(f"--max-chunk bounds the rings of sliding-window layers; {spec.architecture} here has none")
    # a ring that would reach max_seq_len is no ring: then every layer holds every position and
    # steps stay unbounded (max_chunk None)
    max_chunk = max_chunk or DEFAULT_MAX_CHUNK
    if not layer_rings(spec, max_seq_len, max_chunk):
        max_chunk = None
    manifest = Manifest(model=spec, kv_layout=kv_layout, kv_dtype=kv_dtype, max_seq_len=max_seq_len,
                        tokenizer=tokenizer, source={}, versions=library_versions(), max_chunk=max_chunk)
    with atomic_directory(out) as tmp:
        calibrated = KV_DTYPES[kv_dtype].scale == "per-channel"
        with progress("reading the safetensors index, hashing the checkpoint"):
            if calibrated:  # runs the model: its weights in memory
                _, torch_model = checkpoint.load_model(source, kv_layout, KV_DTYPES[kv_dtype])
            else:
                torch_model = checkpoint.skeleton(spec, kv_layout, KV_DTYPES[kv_dtype])
            torch_model.hold_rings(layer_rings(spec, max_seq_len, max_chunk))
            weights = checkpoint.CheckpointWeights(source, torch_model, config)
            manifest.source = {"path": str(Path(source).resolve()), "sha256": checkpoint.fingerprint(source)}
        if calibrated:
            from export.calibrate import calibrate, calibration_ids

            with progress("calibrating static KV scales"):
                manifest.source["kv_calibration"] = calibrate(torch_model, calibration_ids(source))
        with progress(f"tracing to ONNX (opset {manifest.opset}, {kv_layout} layout, {kv_dtype} KV), "
                      f"then writing the weights a layer at a time"):
            export_onnx(torch_model, manifest, tmp / manifest.onnx_file, weights)
        for name in tokenizer["files"]:
            shutil.copy2(Path(source) / name, tmp / name)
        weight_bytes = (tmp / (manifest.onnx_file + ".data")).stat().st_size
        if layers is None and weight_bytes > parity_slice_gib * 2**30 and spec.num_layers > PARITY_SLICE_LAYERS:
            with progress(f"{weight_bytes / 2**30:.1f} GiB of weights: exporting the first {PARITY_SLICE_LAYERS} "
                          f"layers as its parity slice"):
                export(str(source), tmp / PARITY_SLICE, kv_layout, kv_dtype, max_seq_len, max_chunk, PARITY_SLICE_LAYERS)
            manifest.source["parity_slice"] = {"directory": PARITY_SLICE, "layers": PARITY_SLICE_LAYERS}
        manifest.versions["export_seconds"] = round(time.perf_counter() - started, 2)
        manifest.save(tmp)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"exported {out} ({size / 2**20:.1f} MiB, KV {manifest.kv_bytes_per_token} bytes/token) "
          f"in {manifest.versions['export_seconds']:.1f} s", file=sys.stderr)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m export", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="preset name (tiny-llama, small-llama) or HF checkpoint dir")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--kv-layout", default="inplace", choices=KV_LAYOUTS)
    parser.add_argument("--kv-dtype", default="fp32", choices=list(KV_DTYPES))
    parser.add_argument("--max-seq-len", type=int, default=None, help="cache capacity limit (default: model positions)")
    parser.add_argument("--max-chunk", type=int, default=None,
                        help=f"sliding-window models: the most tokens a step writes per row; each sliding layer "
                             f"holds its window + this - 1 positions (default {DEFAULT_MAX_CHUNK})")
    parser.add_argument("--parity-slice-gib", type=float, default=PARITY_SLICE_GIB,
                        help=f"above this many GiB of weights, also export the first {PARITY_SLICE_LAYERS} layers as "
                             f"the slice the engine's parity gate and export.verify run (default {PARITY_SLICE_GIB:g})")
    args = parser.parse_args(argv)
    free_large_buffers_at_once()
    export(args.model, args.out, args.kv_layout, args.kv_dtype, args.max_seq_len, args.max_chunk,
           parity_slice_gib=args.parity_slice_gib)
    return 0


if __name__ == "__main__":
    sys.exit(fail_cleanly(main))
