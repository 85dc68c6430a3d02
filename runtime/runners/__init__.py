"""Runners: one step of the decoder over a batch of KV slots (base.py), on ONNX Runtime (ort.py,
everywhere) or TensorRT (trt.py, GPU hosts only). `open_runner` picks one from the manifest;
TensorRT is imported only when chosen, so a CPU host never needs it."""
from __future__ import annotations

from pathlib import Path

from kvforge.engine_config import read_variable
from kvforge.manifest import Manifest, ManifestError
from runtime.runners.base import Runner
from runtime.runners.ort import OrtConcatRunner, OrtInplaceRunner


def open_runner(engine_dir: Path, threads: int | None = None, spin_us: int | None = None) -> Runner:
    """The runner for an engine or export directory, chosen from its manifest (threads and
    spin_us: ONNX Runtime's, runners/ort.py session_options)."""
    engine_dir = Path(engine_dir)
    manifest = Manifest.load(engine_dir)
    backend = manifest.engine.get("backend", "onnxruntime")
    if backend == "tensorrt":
        from runtime.runners.trt import TensorRTRunner

        return TensorRTRunner(manifest, engine_dir / manifest.engine["file"])
    import onnxruntime

    built_with = manifest.engine.get("onnxruntime_version")
    if built_with and built_with != onnxruntime.__version__:
        raise ManifestError(f"engine {engine_dir} was built with ONNX Runtime {built_with} but this runtime "
                            f"is {onnxruntime.__version__}; rebuild it with `make build-engines`")
    path = engine_dir / manifest.engine.get("file", manifest.onnx_file)
    if not path.is_file():
        raise ManifestError(f"{path} is missing; rebuild with `make build-engines`")
    cls = OrtInplaceRunner if manifest.kv_layout == "inplace" else OrtConcatRunner
    # the serving host decides its threads ($KVFORGE_THREADS) before the build host did (the manifest)
    return cls(manifest, path, threads or read_variable("threads") or manifest.engine.get("threads"), spin_us)
