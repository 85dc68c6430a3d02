"""Moved to export/train.py (`python -m export.train`); this name keeps `python -m bench.train` working."""
import sys

from export.train import main

if __name__ == "__main__":
    sys.exit(main())
