"""Stall detection: an engine that is alive but makes no progress.

`StallWatchdog` is a thread in the engine process (EngineCoreProc starts it when
`stall_timeout_s > 0`). The busy loop calls `progress()` after every step and while it idles;
the watchdog wakes every `interval_s` and, whatever it finds, sends an `EngineHealth`
heartbeat to every front end: stalled when requests are waiting or running and no step has
finished for longer than the timeout (a hung collective, a deadlocked worker, a stuck grammar
compile). When a stall starts it logs, once, what was in flight; when steps resume it logs the
recovery. The front end (`MPClient.stalled_engines`) also counts an engine whose heartbeats
stop (a frozen process) as stalled.

`PAGEDLLM_TEST_BLOCK_STEP_FILE` (tests only): while that file exists, the busy loop does not
step (`StepBlocker`); read once at start-up, so the check costs nothing when unset.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.engine import EngineHealth

if TYPE_CHECKING:
    from pagedllm.core.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

BLOCK_STEP_FILE_ENV = "PAGEDLLM_TEST_BLOCK_STEP_FILE"
# Requests named in the stall's log line (the counts are always whole).
_MAX_LOGGED_REQUESTS = 50


def heartbeat_interval_s(timeout_s: float) -> float:
    """How often the watchdog looks and reports: a quarter of the timeout, at most 1 s."""
    return min(1.0, timeout_s / 4)


def describe_in_flight(scheduler: Scheduler, limit: int = _MAX_LOGGED_REQUESTS) -> str:
    """'2 running, 1 waiting: id (RUNNING, prompt 10/12 computed, 3 output tokens), ...'.
    Read from another thread while the busy loop is stuck, so it copies what it reads."""
    running = list(scheduler.running)
    waiting = list(scheduler.waiting)
    parts = [
        f"{r.request_id} ({r.status.name}, prompt "
        f"{min(r.num_computed_tokens, r.num_prompt_tokens)}/{r.num_prompt_tokens} computed, "
        f"{r.num_output_tokens} output tokens)"
        for r in (running + waiting)[:limit]
    ]
    more = len(running) + len(waiting) - len(parts)
    listed = ", ".join(parts) + (f", and {more} more" if more > 0 else "")
    return f"{len(running)} running, {len(waiting)} waiting: {listed}"


class StallWatchdog:
    """See the module docstring. `has_work()` and `describe()` are called from the watchdog
    thread; `send(health)` must be thread-safe (EngineCoreProc queues it for its output
    thread)."""

    def __init__(
        self,
        timeout_s: float,
        engine_index: int,
        has_work: Callable[[], bool],
        describe: Callable[[], str],
        send: Callable[[EngineHealth], None],
        stop: threading.Event,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"stall_timeout_s={timeout_s} must be positive to watch for stalls")
        self.timeout_s = timeout_s
        self.interval_s = heartbeat_interval_s(timeout_s)
        self.engine_index = engine_index
        self._has_work = has_work
        self._describe = describe
        self._send = send
        self._stop = stop
        self._progress_ts = time.monotonic()
        self._stalled_since: float | None = None
        self._reason = ""

    def progress(self) -> None:
        """The busy loop finished a step, or is idle: either way, not stalled."""
        self._progress_ts = time.monotonic()

    def check(self, now: float | None = None) -> EngineHealth:
        """The engine's health now; logs when a stall starts or ends."""
        now = time.monotonic() if now is None else now
        silent_for = now - self._progress_ts
        if silent_for <= self.timeout_s or not self._has_work():
            if self._stalled_since is not None:
                logger.warning(
                    "Engine %d recovered: a step finished after a stall of %.1fs",
                    self.engine_index,
                    now - self._stalled_since,
                )
                self._stalled_since = None
            return EngineHealth()
        if self._stalled_since is None:
            self._stalled_since = self._progress_ts
            try:
                in_flight = self._describe()
            except Exception as e:  # the state changed under us; the stall is what matters
                in_flight = f"(could not list the requests: {e})"
            self._reason = (
                f"engine {self.engine_index} stalled: no step finished for more than "
                f"{self.timeout_s:g}s (--stall-timeout-s) with {in_flight}"
            )
            logger.error("%s", self._reason)
        return EngineHealth(stalled_for_s=silent_for, reason=self._reason)

    def run(self) -> None:
        """The watchdog thread: a heartbeat every `interval_s` until `stop` is set."""
        while not self._stop.wait(self.interval_s):
            self._send(self.check())


class StepBlocker:
    """The test-only hook that wedges the busy loop (see the module docstring)."""

    def __init__(self, path: str | None) -> None:
        self.path = path or None

    @classmethod
    def from_env(cls) -> StepBlocker:
        return cls(os.environ.get(BLOCK_STEP_FILE_ENV))

    def wait(self, stop: threading.Event) -> None:
        """Returns once the file is gone (or `stop` is set)."""
        if self.path is None:
            return
        if os.path.exists(self.path):
            logger.warning("Step blocked while %s exists (%s)", self.path, BLOCK_STEP_FILE_ENV)
            while os.path.exists(self.path) and not stop.wait(0.05):
                pass
