"""Which instance of a disaggregated engine takes a request: a new one's prefill instance, a prefilled
one's decode instance (vLLM's disaggregated proxy and SGLang's router pick the same two ways).

    round_robin    the next instance of the role in turn, whatever it holds
    least_loaded   the one with the fewest sequences (running or waiting), then the most free blocks,
                   then the lowest number

Only live instances are candidates; None when a role has none left.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol


class Candidate(Protocol):
    index: int
    alive: bool

    def load(self) -> tuple[int, int]: ...  # (sequences held, -free blocks): less is lighter


class Router:
    def __init__(self, policy: Literal["round_robin", "least_loaded"]) -> None:
        self.policy = policy
        self._turn: dict[str, int] = {}  # role -> how many times it was picked

    def pick(self, role: str, instances: Sequence[Candidate]) -> Candidate | None:
        alive = [i for i in instances if i.alive]
        if not alive:
            return None
        if self.policy == "least_loaded":
            return min(alive, key=lambda i: (*i.load(), i.index))
        return alive[self._turn.get(role, 0) % len(alive)]

    def picked(self, role: str) -> None:
        """The pick was taken (a decode instance without room leaves the turn where it was)."""
        self._turn[role] = self._turn.get(role, 0) + 1
