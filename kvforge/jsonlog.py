"""One JSON object per line, appended: the access log and supervision events (LOG_DIR/kvforge.jsonl)."""
from __future__ import annotations

import json
import time
from pathlib import Path


def append_json_line(path: Path | None, record: dict) -> bool:
    """Append one JSON line; False (never an exception) when the disk is full or the file gone."""
    if path is None:
        return False
    line = json.dumps(dict(time=round(time.time(), 3), **record)) + "\n"
    try:
        with open(path, "a") as f:
            f.write(line)
        return True
    except OSError:
        return False
