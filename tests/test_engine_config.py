"""EngineConfig (kvforge/engine_config.py): a setting declared once reaches the engine by both
channels, its flags, variables, defaults and checks derived from the declaration.

The dummy settings are added the way a developer adds one: a line in the declaration, in a copy
of this checkout, whose own Makefile, launcher, fleet, `engines repository` and llm model
configuration code then carry them (in a subprocess running that copy's code)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from kvforge import engine_config
from kvforge.engine_config import EngineConfig
from tests.conftest import ROOT
from tests.test_layout import PACKAGES

DECLARATION = "    # ---- in-process only\n"
DUMMIES = (
    '    dummy_knob: int | None = setting(None, "a test\'s launcher setting", low=1)\n'
    '    dummy_rows: int | None = setting(None, "a test\'s repository setting", channel=REPOSITORY, low=1)\n')

# Run in the copy: each channel's real plumbing, from the command line make runs to the LLMEngine
# the llm model (model_repository/llm/1/model.py) builds from its config.pbtxt and environment.
PLUMBING = textwrap.dedent(r"""
    import json, shlex, subprocess, sys
    from pathlib import Path

    from engines import repository
    from kvforge.engine_config import EngineConfig
    from launcher import __main__ as launcher, fleet
    from launcher.tritonserver import server_env
    from runtime.llm_engine import LLMEngine

    engine_dir, repo = Path(sys.argv[1]), Path(sys.argv[2])

    def made(target, **variables):
        # the command `make TARGET VARIABLES` runs, from after `python -m MODULE`
        printed = subprocess.run(["make", "-n", "-s", target, *(f"{k}={v}" for k, v in variables.items())],
                                 capture_output=True, text=True, check=True).stdout
        lines = printed.replace("\\\n", " ").splitlines()  # a recipe's continued lines as one
        words = shlex.split(next(line for line in lines if " -m launcher" in line))
        return words[words.index("-m") + 2:]

    def served(launcher_argv):
        # what the llm model of a launcher started with these flags runs
        args = launcher.parse_args(launcher_argv)
        environ = server_env(launcher.model_environment(launcher.engine_settings(args), "key", Path("log")))
        with LLMEngine(engine_dir, EngineConfig.served(repository.parameters_of(repo, "llm"), environ)) as engine:
            return engine.config

    repository.main([str(engine_dir), "--repo", str(repo), "--slots", "2", "--dummy-rows", "3"])
    serve = made("serve", ENGINE_FLAGS="--dummy-knob 7", PREFILL_BUDGET=64)
    config = served(serve)
    fleet_args = fleet.parse_args(made("fleet", REPLICAS=2, ENGINE_FLAGS="--dummy-knob 5"))
    replica = fleet.make_replicas(fleet_args, "key")[1]
    in_fleet = served(replica.launcher_args())
    refusals = []
    for argv in (serve + ["--dummy-knob", "0"], ["--repo", str(repo), "--dummy-knob", "lots"]):
        try:
            launcher.engine_settings(launcher.parse_args(argv))
        except launcher.ConfigError as e:
            refusals.append(str(e))
        except SystemExit as e:  # argparse: the flag's type
            refusals.append(f"exit {e.code}")
    print(json.dumps(dict(knob=config.dummy_knob, rows=config.dummy_rows, slots=config.slots,
                          budget=config.prefill_budget, fleet_knob=in_fleet.dummy_knob, fleet_rows=in_fleet.dummy_rows,
                          fleet_host_bytes=in_fleet.kv_host_bytes, refusals=refusals,
                          variables=sorted(k for k in launcher.model_environment(config, "key", Path("log"))
                                           if "DUMMY" in k))))
""")


@pytest.fixture(scope="module")
def checkout_with_dummies(tmp_path_factory):
    """A copy of this checkout's code whose EngineConfig declares two settings more, nothing else changed."""
    copy = tmp_path_factory.mktemp("checkout")
    ignore = shutil.ignore_patterns("__pycache__", "engine", "config.pbtxt")
    for package in (*PACKAGES, "model_repository"):
        shutil.copytree(ROOT / package, copy / package, ignore=ignore)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, copy)
    declarations = copy / "kvforge" / "engine_config.py"
    source = declarations.read_text()
    assert source.count(DECLARATION) == 1
    declarations.write_text(source.replace(DECLARATION, DUMMIES + DECLARATION))
    return copy


def test_a_setting_declared_once_reaches_the_engine_through_make_serve_and_the_fleet(
        checkout_with_dummies, exports, tmp_path):
    engine_dir = exports()
    result = subprocess.run([sys.executable, "-c", PLUMBING, str(engine_dir), str(tmp_path / "repo")],
                            cwd=checkout_with_dummies, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    # the launcher channel: make serve's ENGINE_FLAGS -> launcher flag -> KVFORGE_DUMMY_KNOB -> the model's config
    assert seen["variables"] == ["KVFORGE_DUMMY_KNOB"]
    assert (seen["knob"], seen["budget"]) == (7, 64)
    # the repository channel: --dummy-rows -> config.pbtxt -> the model's config
    assert (seen["rows"], seen["slots"]) == (3, 2)
    # make fleet: every replica's launcher gets the flag, beside its share of the KV pool
    assert (seen["fleet_knob"], seen["fleet_rows"]) == (5, 3)
    assert seen["fleet_host_bytes"] > 0
    # the declaration's bound and type are checked on the command line, named by the derived flag
    assert seen["refusals"] == ["--dummy-knob must be >= 1, got 0", "exit 2"]


def test_every_launcher_setting_round_trips_through_flags_and_environment(tmp_path):
    """Each setting given a value other than its default on the command line comes back from the
    variables the launcher writes, unchanged (the two directions are one declaration's)."""
    values = dict(kv_host_bytes=1 << 20, kv_disk_dir=tmp_path, kv_disk_bytes=1 << 30, kv_redis_url="redis://h:1/0",
                  kv_redis_ttl=60, queue_timeout=2.5, request_timeout=30.0, itl_target_ms=40.0, scheduler="alternate",
                  threads=3, spin_us=0, disaggregate=True, prefill_threads=1, pd_threshold=100,
                  pd_transport="redis", speculative="ngram", speculative_tokens=6, jump_forward=False,
                  attention_scores_bytes=64 << 20)
    # prefix_cache stays on (--disaggregate needs it); the other two targets exclude itl_target_ms (below)
    others = {"prefix_cache", "itl_target_steps", "prefill_budget"}
    assert set(values) | others == {f.name for f in engine_config.settings(engine_config.LAUNCHER)}
    config = EngineConfig(**values)
    parser = argparse.ArgumentParser()
    engine_config.add_flags(parser, engine_config.LAUNCHER)
    given = engine_config.given(parser.parse_args(engine_config.flags_of(values)), engine_config.LAUNCHER)
    assert engine_config.from_flags(given) == config == EngineConfig.served({}, config.environment())
    for target in (dict(itl_target_steps=2.5), dict(prefill_budget=64)):
        other = dataclasses.replace(config, itl_target_ms=None, **target)
        assert EngineConfig.served({}, other.environment()) == other
    off = dataclasses.replace(config, prefix_cache=False, disaggregate=False, kv_disk_dir=None, kv_redis_url=None,
                              pd_transport="shm", pd_threshold=512, prefill_threads=None)
    assert EngineConfig.served({}, off.environment()) == off


def test_repository_settings_round_trip_through_config_pbtxt_parameters():
    config = EngineConfig(slots=4, max_waiting=9, kv_cache_bytes=64 << 20)
    assert EngineConfig.served(config.parameters(), {}) == config
    with pytest.raises(ValueError, match="config.pbtxt parameter slots must be a whole number"):
        EngineConfig.served({"slots": "four"}, {})


def test_settings_are_checked_where_they_are_declared():
    with pytest.raises(ValueError, match=r"prefill_budget must be in 2\.\.8192, got 1"):
        EngineConfig(prefill_budget=1)
    with pytest.raises(ValueError, match="give one"):
        EngineConfig(prefill_budget=32, itl_target_steps=2.0)
    with pytest.raises(ValueError, match="pd_threshold needs disaggregate=True"):
        EngineConfig(pd_threshold=100)
    with pytest.raises(ValueError, match="scheduler must be one of stall-free, alternate"):
        EngineConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="KVFORGE_SPIN_US must be in 0..10000, got 20000"):
        engine_config.read_variable("spin_us", {"KVFORGE_SPIN_US": "20000"})
    with pytest.raises(KeyError, match="no setting 'spin'"):
        engine_config.variable("spin")
    with pytest.raises(TypeError):
        dataclasses.replace(EngineConfig(), no_such_setting=1)
