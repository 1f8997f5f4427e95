"""Peak resident memory of a benchmark: this process plus its live descendants.

The engine core runs in a child process by default, so the benchmark's own peak RSS alone
misses the model and KV cache. Linux keeps each process's peak (`VmHWM` in
`/proc/PID/status`); summing it over the process tree before the engine shuts down gives an
upper bound of the run's peak (the processes may have peaked at different moments).
"""

from __future__ import annotations

import os
import resource


def _status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
                kids.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return kids


def peak_rss_mib() -> float:
    """Sum of peak RSS (MiB) of this process and every live descendant; call it while the
    engine is still up. Off Linux, this process's `ru_maxrss` only."""
    own = _status_kib(os.getpid(), "VmHWM")
    if own is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    total = own
    stack = _children(os.getpid())
    seen: set[int] = set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        total += _status_kib(pid, "VmHWM") or 0
        stack.extend(_children(pid))
    return total / 1024.0
