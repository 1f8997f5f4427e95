"""DPLoadBalancer: which data-parallel engine gets the next request.

The score of an engine is `4 * waiting + running` (vLLM's): a waiting request costs more than
a running one, since it still needs its whole prefill and a slot. The counts are those the DP
coordinator last published, plus this front end's own sends since then, each counted as
waiting; without the latter a burst of requests between two publishes would all land on the
engine that looked idlest. A publish replaces the counts whole (the engines' own numbers then
include what was sent).

A request with a `prompt_cache_key` (OpenAI's field: requests that share a long prefix share a
key) goes to its key's home engine, picked by a stable hash of the key, so that every API
server process (and every restart) sends the key to the engine whose prefix cache holds that
prefix. It overflows to the idlest engine while its home has more than `STICKY_SLACK` of score
above the idlest (about four more waiting requests), so that one hot key cannot pile
everything on one engine, or when its home is dead.
"""

from __future__ import annotations

import zlib
from collections.abc import Container

WAITING_WEIGHT = 4
STICKY_SLACK = 4 * WAITING_WEIGHT


class DPLoadBalancer:
    """Contract: `choose` returns the live engine with the lowest score (ties: the first one
    counting from `client_index`, so that several API servers do not all start on engine 0),
    or for a `key` its home engine (module docstring), and counts the new request on it;
    `update` takes the coordinator's counts."""

    def __init__(self, num_engines: int, client_index: int = 0) -> None:
        self.counts = [[0, 0] for _ in range(num_engines)]  # [waiting, running] per engine
        self._order = [(client_index + i) % num_engines for i in range(num_engines)]

    def update(self, counts: list[list[int]]) -> None:
        if len(counts) == len(self.counts):
            self.counts = [[int(w), int(r)] for w, r in counts]

    def score(self, rank: int) -> int:
        waiting, running = self.counts[rank]
        return WAITING_WEIGHT * waiting + running

    def choose(self, dead: Container[int] = (), key: str | None = None) -> int:
        """Raises ValueError when every engine is excluded."""
        best = None
        for rank in self._order:
            if rank not in dead and (best is None or self.score(rank) < self.score(best)):
                best = rank
        if best is None:
            raise ValueError("no live data-parallel engine to send the request to")
        if key is not None:
            home = self.home(key)
            if home not in dead and self.score(home) <= self.score(best) + STICKY_SLACK:
                best = home
        self.counts[best][0] += 1
        return best

    def home(self, key: str) -> int:
        """The engine a prompt_cache_key belongs to (the same in every process)."""
        return zlib.crc32(key.encode()) % len(self.counts)
