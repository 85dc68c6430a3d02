"""Which ready replica gets a request (docs/fleet.md says why).

kv (the default): a replica's cost is the prompt tokens it would compute (the prompt minus the
cached prefix its index predicts) plus balance_tokens for every sequence it already serves; the
cheapest wins, ties go to the one routed to least. round-robin takes the ready replicas in
turn, whatever they cache; affinity sends every request of a session (the X-Session-ID header,
or the OpenAI API's `user`) to the replica its hash names, by kv when it has none or that
replica is not ready. Those two are there to compare against (bench/fleet.py) and for
operators whose clients expect one of them.
"""
from __future__ import annotations

import hashlib

from frontend.router.prompts import Prompt
from frontend.router.replicas import Replica

POLICIES = ("kv", "round-robin", "affinity")


class Policy:
    def __init__(self, name: str, replicas: list[Replica], balance_tokens: int):
        self.name, self.replicas, self.balance_tokens = name, replicas, balance_tokens
        self.last_chosen = 0  # round-robin: the number of the replica chosen last

    def choose(self, prompts: list[Prompt], exclude: list[Replica], owner: Replica | None = None,
               session: str | None = None) -> Replica | None:
        """The ready replica the policy picks for this request, or the owner of the request a
        `stop` names."""
        candidates = [r for r in self.replicas if r.ready and r not in exclude]
        if owner in candidates:
            return owner
        if self.name == "round-robin":  # the next ready one after the last chosen (a retry: after the failed one)
            chosen = min(candidates, key=lambda r: (r.number - 1 - self.last_chosen) % len(self.replicas), default=None)
            self.last_chosen = chosen.number if chosen else self.last_chosen
            return chosen
        if self.name == "affinity" and session is not None:
            home = self.replicas[session_home(session, len(self.replicas))]
            if home in candidates:
                return home
        tokens = sum(p.tokens for p in prompts)

        def cost(replica: Replica) -> tuple:
            work = tokens - replica.cached_prefix_tokens(prompts) + self.balance_tokens * replica.load
            return work, replica.load, sum(replica.routed.values()), replica.number

        return min(candidates, key=cost, default=None)


def session_home(session: str, replicas: int) -> int:
    """The index of a session's replica: a stable hash (Python's hash() changes per process, and
    a restarted router must send a session where it went before)."""
    return int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big") % replicas
