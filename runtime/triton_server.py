"""Moved to launcher/ (`python -m launcher`); this name keeps `python -m runtime.triton_server` and
old imports working."""
import sys

from launcher.__main__ import main
from launcher.harness import TritonServer, free_ports  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
