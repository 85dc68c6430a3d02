"""Facts about a TensorRT host, shared by the engine builder (engines/tensorrt_build.py) and the
serving runner (runtime/runners/trt.py): is TensorRT usable here, which TensorRT and GPU a
plan is tied to, and a logger that keeps TensorRT's errors. Imports TensorRT only when called.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvforge.manifest import ManifestError

REBUILD = "rebuild it on this host with `python -m engines build EXPORT_DIR --backend tensorrt`"


def missing_requirement() -> str | None:
    """None when TensorRT imports and a CUDA GPU is visible; otherwise one line naming what is missing."""
    missing = []
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        missing.append("TensorRT is not installed (pip package tensorrt; needs NVIDIA's index)")
    except OSError as e:  # the wheel is there but libnvinfer or the CUDA libraries are not
        missing.append(f"TensorRT does not load ({e})")
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        missing.append("cuda-python is not installed (pip package cuda-python), so no CUDA GPU can be used")
    else:
        err, count = cudart.cudaGetDeviceCount()
        if err != cudart.cudaError_t.cudaSuccess or not count:
            missing.append(f"no CUDA GPU visible ({cudart.cudaGetErrorString(err)[1].decode()})")
    return "; ".join(missing) or None


def cuda(result):
    """cuda-python returns (error, *values): raise on an error, else return the value."""
    from cuda.bindings import runtime as cudart

    err, *values = result
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"CUDA {err.name}: {cudart.cudaGetErrorString(err)[1].decode()}")
    return values[0] if values else None


def platform() -> dict:
    """What a plan is tied to: the TensorRT version and the GPU it was built on."""
    import tensorrt as trt
    from cuda.bindings import runtime as cudart

    props = cuda(cudart.cudaGetDeviceProperties(cuda(cudart.cudaGetDevice())))
    name = props.name.decode() if isinstance(props.name, bytes) else str(props.name)
    return {"tensorrt_version": trt.__version__, "compute_capability": f"{props.major}.{props.minor}",
            "gpu_name": name.rstrip("\x00")}


def check_engine_match(recorded: dict, running: dict) -> None:
    """A plan only deserializes on the TensorRT version and GPU architecture that built it
    ("Version tag does not match" otherwise); say so with both sides named instead."""
    for key, what in (("tensorrt_version", "TensorRT"), ("compute_capability", "GPU compute capability")):
        if recorded.get(key) != running[key]:
            raise ManifestError(f"the engine was built with {what} {recorded.get(key) or '(not recorded)'} "
                                f"but this host has {what} {running[key]}; {REBUILD}")


def read_plan(path: Path) -> bytes:
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"TensorRT plan {path} is missing; {REBUILD}") from None
    except OSError as e:
        raise ManifestError(f"cannot read TensorRT plan {path}: {e.strerror}") from None
    if not data:
        raise ManifestError(f"TensorRT plan {path} is empty (an interrupted build?); {REBUILD}")
    return data


def capturing_logger(trt):
    """A TensorRT logger that keeps the errors, so a refusal can quote them."""

    class Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
            elif severity == trt.ILogger.Severity.WARNING:
                print(f"[tensorrt] {msg}", file=sys.stderr)

    return Logger()
