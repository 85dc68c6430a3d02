"""python -m engines build|check|repository

  build EXPORT_DIR --backend onnxruntime|tensorrt|auto --out DIR [--weights fp32|fp16|int8|int4]
  check EXPORT_DIR --target tensorrt [--tensorrt-version V]   ops the TensorRT parser lacks
  repository ENGINE_DIR --repo DIR                            write the Triton model configs
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engines.onnxruntime_build import WEIGHT_MODES
from kvforge.cli import atomic_directory, fail_cleanly, free_large_buffers_at_once, progress
from kvforge.manifest import MLA_NO_TENSORRT, MOE_NO_TENSORRT, RINGS_NO_TENSORRT, Manifest, ManifestError


def choose_backend(requested: str, manifest: Manifest, export_dir: Path) -> str:
    """The backend to build for; the cache dtype decides first, before any check of the host."""
    runs_on = manifest.kv.runs_on
    model = manifest.model
    refusal = (f"an MLA export ({model.architecture}): {MLA_NO_TENSORRT}" if model.attention == "mla"
               else f"a mixture-of-experts export ({model.architecture}): {MOE_NO_TENSORRT}" if model.num_experts
               else f"a ring-cache export: {RINGS_NO_TENSORRT}" if manifest.rings else None)
    if refusal is not None:
        if requested == "tensorrt":
            raise ManifestError(f"{export_dir} is {refusal}")
        runs_on = tuple(b for b in runs_on if b != "tensorrt")
    wanted = runs_on if requested == "auto" else (requested,)
    if not set(wanted) & set(runs_on):
        raise ManifestError(f"the {manifest.kv_dtype} KV cache of {export_dir} cannot run on "
                            f"{' or '.join(wanted) or 'any backend'}: {manifest.kv.note}")
    if requested == "onnxruntime" or "tensorrt" not in runs_on:
        return "onnxruntime"
    from kvforge.tensorrt_host import missing_requirement

    missing = missing_requirement()
    if requested == "tensorrt" and missing:
        raise ManifestError(f"cannot build a TensorRT engine: {missing}")
    if requested == "auto" and missing:
        print(f"[kvforge] backend auto: {missing}; building the ONNX Runtime engine", file=sys.stderr)
        return "onnxruntime"
    return "tensorrt"


def build(args) -> int:
    manifest = Manifest.load(args.export_dir)
    if manifest.engine:
        raise ManifestError(f"{args.export_dir} is already an engine; build from the export directory")
    backend = choose_backend(args.backend, manifest, args.export_dir)
    with atomic_directory(args.out) as tmp:
        if backend == "tensorrt":
            from engines import tensorrt_build

            engine = tensorrt_build.build(args.export_dir, tmp, manifest, precision=args.precision,
                                          progress=progress)
        else:
            from engines import onnxruntime_build

            engine = onnxruntime_build.build(args.export_dir, tmp, manifest, weights=args.weights,
                                             threads=args.threads, progress=progress)
        Manifest(**{**manifest.__dict__, "engine": engine}).save(tmp)
    print(f"built {backend} engine {args.out}: {engine['size_bytes'] / 2**20:.1f} MiB in "
          f"{engine['build_seconds']:.1f} s" + (f", parity drift {engine['parity_max_abs_diff']:.2g}"
                                               if "parity_max_abs_diff" in engine else ""), file=sys.stderr)
    return 0


def check(args) -> int:
    from engines import trt_ops

    manifest = Manifest.load(args.export_dir)
    target = args.tensorrt_version or trt_ops.DEFAULT_TARGET
    problems = trt_ops.unsupported_ops(Path(args.export_dir) / manifest.onnx_file, target)
    for line in problems:
        print(line)
    print(f"TensorRT {target}: " + (f"{len(problems)} problem(s)" if problems else "every op is supported"))
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["repository"]:
        from engines import repository

        return repository.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m engines", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build an engine from an export directory")
    b.add_argument("export_dir", type=Path)
    b.add_argument("--backend", default="auto", choices=("onnxruntime", "tensorrt", "auto"))
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--weights", default="fp32", choices=(*WEIGHT_MODES, "bf16"),
                   help="ONNX Runtime weight dtype (bf16: refused, with the reason)")
    b.add_argument("--precision", default="fp16", choices=("fp16", "bf16", "fp32"), help="TensorRT weight precision")
    b.add_argument("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (default: all cores)")
    c = sub.add_parser("check", help="list ops the TensorRT ONNX parser cannot import")
    c.add_argument("export_dir", type=Path)
    c.add_argument("--target", default="tensorrt", choices=("tensorrt",))
    c.add_argument("--tensorrt-version", default=None)
    sub.add_parser("repository", help="write Triton model configs for an engine (see engines/repository.py)")
    args = parser.parse_args(argv)
    free_large_buffers_at_once()
    return build(args) if args.command == "build" else check(args)


if __name__ == "__main__":
    sys.exit(fail_cleanly(main))
