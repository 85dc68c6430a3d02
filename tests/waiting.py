"""Waiting for a condition in a test: a generous bound that fails on a hang, never a speed."""
from __future__ import annotations

import time

POLL_TIMEOUT = 120.0  # long enough for a Redis failover (node timeout and an election) on a loaded machine


def wait_for(condition, what: str, timeout: float = POLL_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_written(engine, tier: str, blocks: int) -> None:
    """Until the write-behind has stored `blocks` blocks in the tier (so a close drains nothing)."""
    wait_for(lambda: engine.stats()["tiers"][tier]["written_blocks"] == blocks
             and engine.stats()["tier_write_queue_blocks"] == 0, f"{blocks} blocks written to {tier}")
