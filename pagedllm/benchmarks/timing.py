"""Wall-clock timing of one callable, for the kernel microbenchmarks in `scripts/`."""

from __future__ import annotations

import time
from collections.abc import Callable


def call_seconds(fn: Callable[[], object], passes: int) -> list[float]:
    """Seconds of each of `passes` calls of `fn`, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times
