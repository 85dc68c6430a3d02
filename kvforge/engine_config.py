"""EngineConfig: every setting of the engine (runtime/llm_engine.py), each declared once.

A setting is a field below; its `setting(...)` declaration holds the default, the bounds or
choices, the help and the channel by which it reaches a served engine:
- LAUNCHER: a flag of `python -m launcher` (which `launcher.fleet` passes to every replica),
  carried to the llm model's process as the variable KVFORGE_<NAME> (a path or a Redis password
  never reaches model metadata or logs);
- REPOSITORY: a flag of `python -m engines repository`, written into the llm model's config.pbtxt
  (slots and KV bytes size Triton's batches too, so they belong to the repository);
- API: in-process only, `LLMEngine(engine_dir, name=value)`.
The flags, the variables, their parsing and checking, the environment the launcher writes and
the config the llm model reads back are all derived from these fields: a new setting is one
field here and its use in the engine.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHER, REPOSITORY, API = "launcher", "repository", "api"
ENV_PREFIX = "KVFORGE_"

DEFAULT_KV_CACHE_BYTES = 1 << 30
# A prefill step's attention scores (chunk rows x chunk x keys x heads x 4 B, one layer at a time)
# stay within this: the chunk narrows as the context grows (kvforge/limits.py prefill_chunk).
# 256 MiB keeps every preset's 512-token chunks up to 4K context (small-llama: 128 MiB at 4K).
DEFAULT_SCORES_BYTES = 256 << 20
MIN_PREFILL_BUDGET, MAX_PREFILL_BUDGET = 2, 8192
# the default inter-token-latency target, in measured decode steps: a step beside decoding rows
# takes at most this many. `python -m bench --sections stream_gaps` (small-llama, 2026-12-05, two
# runs of 10 rounds each) put the knee at 1.3: stream ITL p99 2.5-2.8x its pace alone (1.5:
# 2.7-3.4x, fixed 32 tokens: 8.4x), largest gap at most 4.0x in every round (1.5: up to 8.3x),
# long prompts' TTFT 1.0-1.4x alone; 1.15 starves the prompts (TTFT 1.9x)
ITL_TARGET_DECODE_STEPS = 1.3
MAX_ITL_TARGET_MS, MAX_ITL_STEPS = 10_000.0, 100.0
SCHEDULERS = ("stall-free", "alternate")
# An idle intra-op thread spins this long for its next operator before it sleeps (0: it sleeps at
# once). A wake-up per operator is what a batch-1 step waits on, and a bounded spin ends when the
# engine goes idle. `make bench`'s spin section, small-llama, 2 threads, 4 rounds taking turns
# (0 / 100 / 1000 us): decode step median fp32 15.8 / 14.8 / 15.0 ms, int8 6.1 / 5.0 / 5.3 ms;
# served with kvforge's gRPC client on the same cores 64 / 68 / 66 tokens/s at concurrency 1,
# 385 / 395 / 374 at 16; but aiperf's worker processes on the same 2 cores got 47 / 41 / 29
# tokens/s at concurrency 1 and 147 / 138 / 109 at 4: there a spinning thread takes the CPU the
# client needs (--spin-us 0 then; unbounded spinning had cost it 20-34%).
DEFAULT_SPIN_US = 100
MAX_SPIN_US = 10_000  # ONNX Runtime warns above this: the spin then costs more CPU than a wake-up
MAX_THREADS = 256
TRANSPORTS = ("shm", "redis")
# Prompts with fewer uncached tokens stay local: a remote prefill costs a round trip and a
# hand-off, which a few hundred tokens of stall-free prefill do not repay (bench mixed_load).
THRESHOLD_TOKENS = 512
SPECULATIVE_METHODS = ("off", "ngram")
MAX_DRAFT_TOKENS = 4
MAX_SPECULATION = 16  # the largest max_draft_tokens / max_ngram accepted
SOLO_PREFILL_TOKENS = 512
DEFAULT_KV_DISK_BYTES = 8 << 30


def setting(default, help: str, *, channel: str = LAUNCHER, low=None, above=None, high=None, unit: str = "",
            choices: tuple = (), flag: str | None = None, scale: int = 1, needs: tuple[str, object] | None = None):
    """A field's declaration: low/high are inclusive bounds, `above` an exclusive lower one; `unit`
    names the number's unit in messages; `flag` overrides --NAME; the flag's value times `scale`
    is the setting's (--kv-cache-mib); `needs` = (setting, value): it only matters with that one."""
    return field(default=default, metadata=dict(help=help, channel=channel, low=low, above=above, high=high,
                                                unit=unit, choices=choices, flag=flag, scale=scale, needs=needs))


@dataclass(frozen=True)
class EngineConfig:
    # ---- the repository's (config.pbtxt)
    slots: int | None = setting(None, "sequences decoding at once (default: as many as fit the KV bytes at full "
                                "context, at most what the engine was built for)", channel=REPOSITORY, low=1)
    max_waiting: int | None = setting(None, "requests that may wait for a slot (default: kvforge/limits.py's "
                                      "WAITING_PER_SLOT per slot; 0 refuses every request as a full queue would)",
                                      channel=REPOSITORY, low=0)
    kv_cache_bytes: int | None = setting(
        None, f"KV memory the llm model may promise, mapped at startup (default: {DEFAULT_KV_CACHE_BYTES >> 20} MiB, "
        "or one sequence at the engine's max_seq_len if more; refused at start beyond the RAM available)",
        channel=REPOSITORY, above=0, flag="--kv-cache-mib", scale=1 << 20)
    # ---- the launcher's (KVFORGE_* variables)
    prefix_cache: bool = setting(True, "reuse the KV of repeated prompt prefixes")
    kv_host_bytes: int | None = setting(None, "byte budget of the host RAM KV block pool (default: a quarter of "
                                        "RAM, at most 8 GiB)", low=0)
    kv_disk_dir: Path | None = setting(None, "a local-disk KV tier below RAM in this directory (a restarted server "
                                       "hits what it stored; default: off)", needs=("prefix_cache", True))
    kv_disk_bytes: int = setting(DEFAULT_KV_DISK_BYTES, "byte budget of the disk tier", above=0)
    kv_redis_url: str | None = setting(None, "a shared Redis KV tier, redis://[:PASSWORD@]HOST:PORT/DB or "
                                       "rediss://... (default: off; $KVFORGE_KV_REDIS_URL keeps a password off "
                                       "the command line)", needs=("prefix_cache", True))
    kv_redis_ttl: int | None = setting(None, "seconds before a Redis KV entry expires (default: never; Redis's "
                                       "maxmemory policy evicts)", above=0)
    queue_timeout: float | None = setting(None, "seconds a request may wait for a KV slot before it is refused",
                                          above=0, unit="seconds")
    request_timeout: float | None = setting(None, "seconds a request may run in all before it is ended",
                                            above=0, unit="seconds")
    itl_target_steps: float | None = setting(
        None, f"the engine step length that prompt tokens may fill beside decoding rows, in measured decode steps "
        f"(default {ITL_TARGET_DECODE_STEPS:g}): larger favours time to first token, smaller the other streams' "
        "inter-token latency", above=1, high=MAX_ITL_STEPS, unit="decode steps")
    itl_target_ms: float | None = setting(None, "the same target in milliseconds, whatever a decode step takes",
                                          above=0, high=MAX_ITL_TARGET_MS, unit="milliseconds")
    prefill_budget: int | None = setting(None, "instead of the target: a fixed number of prompt tokens per engine "
                                         "step beside every decoding row", low=MIN_PREFILL_BUDGET,
                                         high=MAX_PREFILL_BUDGET)
    scheduler: str = setting(SCHEDULERS[0], "stall-free: every step runs every decoding row plus prompt chunks up "
                             "to the budget; alternate: prompt-chunk steps take turns with decode steps",
                             choices=SCHEDULERS)
    threads: int | None = setting(None, "the engine's threads (default: every core)", low=1, high=MAX_THREADS,
                                  flag="--decode-threads")
    spin_us: int | None = setting(None, f"microseconds an idle ONNX Runtime thread spins for work before it sleeps "
                                  f"(default {DEFAULT_SPIN_US}; spinning speeds decode on cores the engine has to "
                                  "itself and slows clients sharing them: docs/serving.md#threads)",
                                  low=0, high=MAX_SPIN_US)
    disaggregate: bool = setting(False, "prefill long prompts in a prefill worker process beside the decode "
                                 "engine, the KV handed over through the block store "
                                 "(docs/serving.md#disaggregated-prefill)", needs=("prefix_cache", True))
    prefill_threads: int | None = setting(None, "the prefill worker's threads", low=1, high=MAX_THREADS,
                                          needs=("disaggregate", True))
    pd_threshold: int = setting(THRESHOLD_TOKENS, "uncached prompt tokens above which a prompt goes to the prefill "
                                "worker", low=0, needs=("disaggregate", True))
    pd_transport: str = setting(TRANSPORTS[0], "shm: /dev/shm on this host; redis: through the Redis KV tier",
                                choices=TRANSPORTS, needs=("disaggregate", True))
    speculative: str = setting(SPECULATIVE_METHODS[0], "ngram: requests draft tokens from their own prompt and "
                               "output and verify them in one step (prompt lookup; the same greedy and seeded "
                               "text); off: only requests asking speculative=ngram do", choices=SPECULATIVE_METHODS)
    speculative_tokens: int = setting(MAX_DRAFT_TOKENS, "the most tokens a draft holds (it adapts to acceptance)",
                                      low=1, high=MAX_SPECULATION, needs=("speculative", "ngram"))
    # `python -m bench --sections structured`, idle machine, 2026-12-06: 4.83x tokens/s at batch 1 and
    # 2.18x at batch 16 on a schema with long fixed keys (81-82% of its tokens forced), identical tokens
    jump_forward: bool = setting(True, "a guided request takes the tokens its grammar forces (the only one its "
                                 "mask allows, several in a row: JSON keys, punctuation) at once and the next step "
                                 "feeds them as one chunk instead of one decode step each; the same tokens "
                                 "(requests asking for log-probs decode step by step); off: one step per token")
    attention_scores_bytes: int = setting(
        DEFAULT_SCORES_BYTES, "the attention scores one prefill step may make per layer (chunk rows x chunk x keys x "
        "heads x 4 B): long contexts take narrower prompt chunks (also the step model's)", above=0,
        flag="--attention-scores-mib", scale=1 << 20)
    # ---- in-process only
    admission: str = setting("optimistic", "optimistic: admit on the KV sequences hold now and preempt the "
                             "youngest when they outgrow it; reserve: promise prompt + max_tokens up front",
                             channel=API, choices=("optimistic", "reserve"))
    solo_prefill_tokens: int = setting(SOLO_PREFILL_TOKENS, "prompt tokens per step when no row decodes",
                                       channel=API, low=1)

    def __post_init__(self):
        check(vars(self))

    def environment(self) -> dict[str, str]:
        """The launcher-channel settings that are set, as the llm model's variables (an unset one
        leaves the variable the launcher's own environment may hold, e.g. the fleet's threads)."""
        return {variable(f): _text(getattr(self, f.name)) for f in settings(LAUNCHER)
                if getattr(self, f.name) is not None}

    def parameters(self) -> dict[str, str]:
        """The repository-channel settings that are set, as the llm model's config.pbtxt parameters."""
        return {f.name: _text(getattr(self, f.name)) for f in settings(REPOSITORY) if getattr(self, f.name) is not None}

    @classmethod
    def served(cls, parameters: Mapping[str, str], environ: Mapping[str, str] = os.environ) -> "EngineConfig":
        """The config a served llm model runs: its config.pbtxt parameters and its KVFORGE_* environment."""
        values = {f.name: parse(f, parameters[f.name], f"config.pbtxt parameter {f.name}")
                  for f in settings(REPOSITORY) if parameters.get(f.name, "") != ""}
        values.update({f.name: value for f in settings(LAUNCHER)
                       if (value := read_variable(f.name, environ)) is not None})
        return cls(**values)


def settings(channel: str | None = None) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(EngineConfig) if channel in (None, f.metadata["channel"])]


def setting_named(name: str) -> dataclasses.Field:
    for f in dataclasses.fields(EngineConfig):
        if f.name == name:
            return f
    raise KeyError(f"EngineConfig has no setting {name!r}")


def kind(f: dataclasses.Field) -> type:
    """The setting's value type (int, float, str, bool or Path), without the None of an optional one."""
    hint = _hints()[f.name]
    return next(t for t in typing.get_args(hint) or (hint,) if t is not type(None))


@functools.cache
def _hints() -> dict[str, object]:
    return typing.get_type_hints(EngineConfig)


def variable(setting: dataclasses.Field | str) -> str:
    """A launcher-channel setting's variable: KVFORGE_<NAME>."""
    f = setting_named(setting) if isinstance(setting, str) else setting
    return ENV_PREFIX + f.name.upper()


def flag(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _text(value) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


def parse(f: dataclasses.Field, text: str, source: str):
    """A setting's value from its text (a variable or a config.pbtxt parameter); unchecked."""
    t = kind(f)
    if t is bool:
        if text not in ("0", "1"):
            raise ValueError(f"{source} must be 0 or 1 (got {text!r})")
        return text == "1"
    if t is int:
        if not text.lstrip("-").isdigit():
            raise ValueError(f"{source} must be a whole number (got {text!r})")
        return int(text)
    if t is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{source} must be a number of {f.metadata['unit']} (got {text!r})") from None
    return t(text)


def read_variable(name: str, environ: Mapping[str, str] = os.environ):
    """A launcher-channel setting from the environment, parsed and checked; None when unset or empty."""
    f = setting_named(name)
    text = environ.get(variable(f), "")
    if text == "":
        return None
    value = parse(f, text, variable(f))
    if problem := bounds_problem(f, value):
        raise ValueError(f"{variable(f)} {problem}")
    return value


def bounds_problem(f: dataclasses.Field, value, as_flag: bool = False) -> str | None:
    """What is wrong with one setting's value on its own, or None (as_flag: in the flag's units)."""
    m, t = f.metadata, kind(f)
    if value is None:
        return None if f.default is None else "must be given"
    accepted = {float: (int, float), Path: (str, os.PathLike)}.get(t, t)
    if not isinstance(value, accepted) or isinstance(value, bool) and t is not bool:
        return f"must be {'a whole number' if t is int else 'a number' if t is float else t.__name__}, got {value!r}"
    if m["choices"] and value not in m["choices"]:
        return f"must be one of {', '.join(m['choices'])}, got {value!r}"
    low, above, high, unit = m["low"], m["above"], m["high"], " " + m["unit"] if m["unit"] else ""
    if not ((low is not None and value < low) or (above is not None and value <= above) or
            (high is not None and value > high)):
        return None
    scale = m["scale"] if as_flag else 1
    low, above, high, value = (None if x is None else _number(x // scale if scale != 1 else x)
                               for x in (low, above, high, value))
    if high is None:
        return f"must be {'>=' if low is not None else '>'} {low if low is not None else above}{unit}, got {value}"
    if low is not None:
        return f"must be in {low}..{high}{unit}, got {value}"
    return f"must be in ({above}, {high}]{unit}, got {value}"


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check(values: Mapping[str, object], as_flags: bool = False) -> None:
    """Refuse a bad setting or combination of settings with one line naming them (by their
    fields, or by their flags when the launcher checks its command line)."""
    name = flag if as_flags else (lambda f: f.name)
    for f in settings():
        if problem := bounds_problem(f, values[f.name], as_flags):
            raise ValueError(f"{name(f)} {problem}")
    for f in settings():
        if f.metadata["needs"] and values[f.name] not in (f.default, None):
            other, wanted = f.metadata["needs"]
            if values[other] != wanted:
                raise ValueError(f"{name(f)} {_requirement(setting_named(other), wanted, as_flags)}")
    fixed, targets = values["prefill_budget"], [setting_named(n) for n in ("itl_target_ms", "itl_target_steps")
                                                  if values[n] is not None]
    if len(targets) == 2:
        raise ValueError(f"{name(targets[0])} and {name(targets[1])} are one target: give one")
    if fixed is not None and targets:
        raise ValueError(f"{name(setting_named('prefill_budget'))} fixes the prompt tokens per step and "
                         f"{name(targets[0])} derives them: give one")
    if values["pd_transport"] == "redis" and values["disaggregate"] and not values["kv_redis_url"]:
        raise ValueError(f"{name(setting_named('pd_transport'))} redis hands KV over through the Redis KV tier: "
                         f"give {name(setting_named('kv_redis_url'))}")


def _requirement(f: dataclasses.Field, wanted, as_flag: bool) -> str:
    """What a setting needs of another one, and (on a command line) how to get it."""
    if not as_flag:
        return f"needs {f.name}={wanted!r}"
    if kind(f) is bool and f.default:
        return f"needs {flag(f)} on: drop {flag(f)} off"
    needed = flag(f) if kind(f) is bool else f"{flag(f)} {wanted}"
    return f"only matters with {needed}: add {needed}"


# ------------------------------------------------------------------ command lines

def add_flags(parser: argparse.ArgumentParser, channel: str | None = None,
              helps: Mapping[str, str] | None = None) -> None:
    """One flag per setting of the channel (None: every setting), each defaulting to None (not
    given): what was given is then EngineConfig's, the rest its defaults. helps: another help
    text for some settings (the fleet splits some among its replicas)."""
    for f in settings(channel):
        m, t, help = f.metadata, kind(f), (helps or {}).get(f.name, f.metadata["help"])
        if t is bool and not f.default:
            parser.add_argument(flag(f), dest=f.name, action="store_true", default=None, help=help)
        elif t is bool:
            parser.add_argument(flag(f), dest=f.name, choices=("on", "off"), default=None, help=f"{help} (default: on)")
        else:
            default = f.default // m["scale"] if m["scale"] != 1 and f.default is not None else f.default
            shown = f" (default: {default})" if f.default is not None else ""
            parser.add_argument(flag(f), dest=f.name, type=t, choices=m["choices"] or None, default=None,
                                metavar=flag(f)[2:].upper().replace("-", "_") if not m["choices"] else None,
                                help=help + ("" if "default" in help else shown))


def given(args: argparse.Namespace, channel: str | None = None) -> dict[str, object]:
    """The settings given as flags (add_flags), as EngineConfig's values."""
    values = {}
    for f in settings(channel):
        value, scale = getattr(args, f.name), f.metadata["scale"]
        if value is None:
            continue
        if kind(f) is bool:
            values[f.name] = value == "on" if isinstance(value, str) else value
        else:
            values[f.name] = value * scale if scale != 1 else value
    return values


def from_flags(values: Mapping[str, object]) -> EngineConfig:
    """EngineConfig from `given` values, a mistake named by its flag."""
    check({f.name: values.get(f.name, f.default) for f in settings()}, as_flags=True)
    return EngineConfig(**values)


def flags_of(values: Mapping[str, object]) -> list[str]:
    """The command line that gives these settings (`given`'s inverse)."""
    out = []
    for name, value in values.items():
        f = setting_named(name)
        if kind(f) is bool and not f.default:
            out += [flag(f)] if value else []
        elif kind(f) is bool:
            out += [flag(f), "on" if value else "off"]
        else:
            out += [flag(f), str(value // f.metadata["scale"] if f.metadata["scale"] != 1 else value)]
    return out
