"""The control key: it guards Triton's control APIs and the llm model's clear_prefix_cache."""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from kvforge import env
from launcher.tritonserver import ServerError

DEFAULT_KEY_FILE = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "kvforge" / "control.key"


def control_key(key_file: Path = DEFAULT_KEY_FILE) -> tuple[str, str]:
    """(key, where it came from): $KVFORGE_CONTROL_KEY, else key_file, created 0600 on first use."""
    if os.environ.get(env.CONTROL_KEY):
        return os.environ[env.CONTROL_KEY], f"${env.CONTROL_KEY}"
    key_file = Path(key_file)
    if not key_file.exists():
        key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    if key_file.stat().st_mode & 0o077:
        raise ServerError(f"the control key file {key_file} is readable by others; chmod 600 it")
    key = key_file.read_text().strip()
    if not re.fullmatch(r"[A-Za-z0-9_-]{16,}", key):
        raise ServerError(f"the control key in {key_file} must be 16+ characters of A-Z a-z 0-9 _ -")
    return key, str(key_file)
