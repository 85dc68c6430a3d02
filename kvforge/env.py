"""The KVFORGE_* environment: what the launcher hands the llm model's process, written and read here.

Serving knobs travel by environment, never in the model config, so a path or a Redis password
never reaches model metadata or logs. `model_environment` is the launcher's side;
the llm model reads the same names, with `engine_options` and `seconds`.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CONTROL_KEY = "KVFORGE_CONTROL_KEY"  # guards Triton's control APIs and the llm model's clear_prefix_cache
OPENAI_API_KEY = "KVFORGE_OPENAI_API_KEY"  # the bearer key the OpenAI-compatible API then requires
ACCESS_LOG = "KVFORGE_ACCESS_LOG"
PREFIX_CACHE = "KVFORGE_PREFIX_CACHE"  # 0 | 1
KV_HOST_BYTES = "KVFORGE_KV_HOST_BYTES"
KV_DISK_DIR = "KVFORGE_KV_DISK_DIR"
KV_DISK_BYTES = "KVFORGE_KV_DISK_BYTES"
KV_REDIS_URL = "KVFORGE_KV_REDIS_URL"
KV_REDIS_TTL = "KVFORGE_KV_REDIS_TTL"
QUEUE_TIMEOUT = "KVFORGE_QUEUE_TIMEOUT"
REQUEST_TIMEOUT = "KVFORGE_REQUEST_TIMEOUT"
THREADS = "KVFORGE_THREADS"  # ONNX Runtime intra-op threads (default: every core)
SPIN_US = "KVFORGE_SPIN_US"  # microseconds an idle intra-op thread spins for work before it sleeps (0: never)
PREFILL_BUDGET = "KVFORGE_PREFILL_BUDGET"  # a fixed number of prompt tokens per step beside the decoding rows
ITL_TARGET_MS = "KVFORGE_ITL_TARGET_MS"  # the step length the prompt budget keeps beside decoding rows
ITL_TARGET_STEPS = "KVFORGE_ITL_TARGET_STEPS"  # the same in measured decode steps
SCHEDULER = "KVFORGE_SCHEDULER"  # stall-free | alternate
SCHEDULERS = ("stall-free", "alternate")
DISAGGREGATE = "KVFORGE_DISAGGREGATE"  # 0 | 1: a prefill worker process beside the decode engine
PREFILL_THREADS = "KVFORGE_PREFILL_THREADS"  # the prefill worker's intra-op threads
PD_THRESHOLD = "KVFORGE_PD_THRESHOLD"  # uncached prompt tokens above which a prompt is prefilled remotely
PD_TRANSPORT = "KVFORGE_PD_TRANSPORT"  # shm (one host) | redis (the KV Redis tier)
PD_AUTHKEY = "KVFORGE_PD_AUTHKEY"  # the prefill worker's connection key, from the engine that starts it
SPECULATIVE = "KVFORGE_SPECULATIVE"  # off | ngram: requests verify tokens drafted from their context
SPECULATIVE_METHODS = ("off", "ngram")
SPECULATIVE_TOKENS = "KVFORGE_SPECULATIVE_TOKENS"  # the most tokens a draft holds
TOKEN_TRACE = "KVFORGE_TOKEN_TRACE"  # 1: access-log lines carry each response's engine and send times
CHECKPOINTS = "KVFORGE_CHECKPOINTS"  # where presets are materialized (default: build/checkpoints)

# engine option -> its variable, for the whole-number options
WHOLE_NUMBERS = {"kv_host_bytes": KV_HOST_BYTES, "kv_disk_bytes": KV_DISK_BYTES, "kv_redis_ttl": KV_REDIS_TTL,
                 "prefill_budget": PREFILL_BUDGET}


def model_environment(control_key: str, access_log: Path, prefix_cache: bool = True,
                      kv_host_bytes: int | None = None, kv_disk_dir: Path | None = None,
                      kv_disk_bytes: int | None = None, kv_redis_url: str | None = None,
                      kv_redis_ttl: int | None = None, queue_timeout: float | None = None,
                      request_timeout: float | None = None, prefill_budget: int | None = None,
                      itl_target_ms: float | None = None, itl_target_steps: float | None = None, scheduler: str | None = None, disaggregate: bool = False, prefill_threads: int | None = None,
                      pd_threshold: int | None = None, pd_transport: str | None = None,
                      speculative: str | None = None, speculative_tokens: int | None = None,
                      spin_us: int | None = None) -> dict[str, str]:
    """The variables for the llm model's process (unset options are left out; a KVFORGE_KV_REDIS_URL
    already in the launcher's environment reaches the model with the rest of it)."""
    values = {CONTROL_KEY: control_key, ACCESS_LOG: str(access_log), PREFIX_CACHE: "1" if prefix_cache else "0",
              KV_HOST_BYTES: kv_host_bytes, KV_DISK_DIR: kv_disk_dir and Path(kv_disk_dir).resolve(),
              KV_DISK_BYTES: kv_disk_bytes, KV_REDIS_URL: kv_redis_url, KV_REDIS_TTL: kv_redis_ttl,
              QUEUE_TIMEOUT: queue_timeout, REQUEST_TIMEOUT: request_timeout, PREFILL_BUDGET: prefill_budget,
              ITL_TARGET_MS: itl_target_ms, ITL_TARGET_STEPS: itl_target_steps, SCHEDULER: scheduler, DISAGGREGATE: "1" if disaggregate else None, PREFILL_THREADS: prefill_threads,
              PD_THRESHOLD: pd_threshold, PD_TRANSPORT: pd_transport, SPECULATIVE: speculative,
              SPECULATIVE_TOKENS: speculative_tokens, SPIN_US: spin_us}
    return {name: str(value) for name, value in values.items() if value is not None and value != ""}


def engine_options(environ: Mapping[str, str] = os.environ) -> dict:
    """LLMEngine's scheduler, prefix-cache and tier keyword arguments from the environment."""
    enabled = environ.get(PREFIX_CACHE, "1")
    if enabled not in ("0", "1"):
        raise ValueError(f"{PREFIX_CACHE} must be 0 or 1 (got {enabled!r})")
    scheduler = environ.get(SCHEDULER) or SCHEDULERS[0]
    if scheduler not in SCHEDULERS:
        raise ValueError(f"{SCHEDULER} must be one of {', '.join(SCHEDULERS)} (got {scheduler!r})")
    options = dict(prefix_cache=enabled == "1", kv_disk_dir=environ.get(KV_DISK_DIR) or None,
                   kv_redis_url=environ.get(KV_REDIS_URL) or None, stall_free=scheduler == "stall-free")
    for key, name in WHOLE_NUMBERS.items():
        if (value := whole_number(name, environ)) is not None:
            options[key] = value
    if (target_ms := number(ITL_TARGET_MS, "milliseconds", environ)) is not None:
        options["itl_target"] = target_ms / 1000
    if (target_steps := number(ITL_TARGET_STEPS, "decode steps", environ)) is not None:
        options["itl_target_steps"] = target_steps
    if environ.get(DISAGGREGATE, "0") not in ("0", "1"):
        raise ValueError(f"{DISAGGREGATE} must be 0 or 1 (got {environ[DISAGGREGATE]!r})")
    if environ.get(DISAGGREGATE) == "1":
        pd = {"threads": PREFILL_THREADS, "threshold_tokens": PD_THRESHOLD}
        for name in pd.values():
            if not environ.get(name, "0").isdigit():
                raise ValueError(f"{name} must be a whole number (got {environ[name]!r})")
        options["disaggregation"] = {key: int(environ[name]) for key, name in pd.items() if environ.get(name)}
        if environ.get(PD_TRANSPORT):
            options["disaggregation"]["transport"] = environ[PD_TRANSPORT]
    speculative = environ.get(SPECULATIVE) or SPECULATIVE_METHODS[0]
    if speculative not in SPECULATIVE_METHODS:
        raise ValueError(f"{SPECULATIVE} must be one of {', '.join(SPECULATIVE_METHODS)} (got {speculative!r})")
    if not environ.get(SPECULATIVE_TOKENS, "0").isdigit():
        raise ValueError(f"{SPECULATIVE_TOKENS} must be a whole number (got {environ[SPECULATIVE_TOKENS]!r})")
    if speculative == "ngram":
        options["speculation"] = {"max_draft_tokens": int(environ[SPECULATIVE_TOKENS])} \
            if environ.get(SPECULATIVE_TOKENS) else {}
    return options


def seconds(name: str, environ: Mapping[str, str] = os.environ) -> float | None:
    return number(name, "seconds", environ)


def number(name: str, unit: str, environ: Mapping[str, str] = os.environ) -> float | None:
    value = environ.get(name)
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit} (got {value!r})") from None


def whole_number(name: str, environ: Mapping[str, str] = os.environ) -> int | None:
    value = environ.get(name, "")
    if not (value.isdigit() or value == ""):
        raise ValueError(f"{name} must be a whole number (got {value!r})")
    return int(value) if value else None


def threads(environ: Mapping[str, str] = os.environ) -> int | None:
    return whole_number(THREADS, environ) or None


def spin_us(environ: Mapping[str, str] = os.environ) -> int | None:
    return whole_number(SPIN_US, environ)


def traces_tokens(environ: Mapping[str, str] = os.environ) -> bool:
    value = environ.get(TOKEN_TRACE, "0")
    if value not in ("0", "1"):
        raise ValueError(f"{TOKEN_TRACE} must be 0 or 1 (got {value!r})")
    return value == "1"
