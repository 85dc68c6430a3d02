"""The KVFORGE_* environment beyond the engine's settings, written and read here.

The engine's settings travel as KVFORGE_<SETTING> variables too, from the launcher to the llm
model's process; kvforge/engine_config.py derives, writes and reads those. Serving knobs travel
by environment, never in the model config, so a path or a Redis password never reaches model
metadata or logs.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

CONTROL_KEY = "KVFORGE_CONTROL_KEY"  # guards Triton's control APIs and the llm model's clear_prefix_cache
OPENAI_API_KEY = "KVFORGE_OPENAI_API_KEY"  # the bearer key the OpenAI-compatible API then requires
ACCESS_LOG = "KVFORGE_ACCESS_LOG"
PD_AUTHKEY = "KVFORGE_PD_AUTHKEY"  # the prefill worker's connection key, from the engine that starts it
TOKEN_TRACE = "KVFORGE_TOKEN_TRACE"  # 1: access-log lines carry each response's engine and send times
# the launcher's scratch folder (in /dev/shm where there is one): the engine's hand-offs and its worker's
# socket go there, and the launcher removes it once the server stopped, however the model's process ended
RUN_FOLDER = "KVFORGE_RUN_FOLDER"
CHECKPOINTS = "KVFORGE_CHECKPOINTS"  # where presets are materialized (default: build/checkpoints)


def traces_tokens(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(TOKEN_TRACE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{TOKEN_TRACE} must be 0 or 1 (got {value!r})")
    return value == "1"
