"""Which CPU cores each worker process of one machine runs its threads on.

`PAGEDLLM_CPU_OMP_THREADS_BIND` (like vLLM's VLLM_CPU_OMP_THREADS_BIND):
- `auto` (default): the cores the engine process may use, split into equal contiguous groups,
  one per local rank (with fewer cores than ranks, rank i gets core i mod #cores);
- `nobind`: no pinning; each worker keeps PyTorch's default thread count;
- explicit groups, one per local rank, separated by `|`: `0-3|4-7`, or `0,2|1,3`.

A pinned worker runs as many compute threads as it has cores (capped by OMP_NUM_THREADS when
that is set), so ranks of one tensor-parallel group never fight over a core and a collective
never waits for a peer that the OS scheduler put to sleep.
"""

from __future__ import annotations

import os

CPU_BIND_ENV = "PAGEDLLM_CPU_OMP_THREADS_BIND"


def _parse_cores(text: str) -> set[int]:
    cores: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def plan_cpu_binding(
    local_world_size: int, spec: str | None = None, available: set[int] | None = None
) -> list[set[int]] | None:
    """Cores per local rank (None: do not pin). `spec` defaults to the environment variable,
    `available` to this process's affinity. ValueError naming the variable on a bad spec."""
    spec = (spec if spec is not None else os.environ.get(CPU_BIND_ENV, "auto")).strip()
    available = sorted(available if available is not None else os.sched_getaffinity(0))
    if spec == "nobind":
        return None
    if spec == "auto":
        n = len(available)
        if n < local_world_size:
            return [{available[i % n]} for i in range(local_world_size)]
        per = n // local_world_size
        return [set(available[i * per : (i + 1) * per]) for i in range(local_world_size)]
    try:
        groups = [_parse_cores(g) for g in spec.split("|")]
    except ValueError:
        groups = []
    if len(groups) != local_world_size or not all(groups):
        raise ValueError(
            f"{CPU_BIND_ENV}={spec!r} must be 'auto', 'nobind' or {local_world_size} core "
            "groups separated by '|' (e.g. '0-3|4-7')"
        )
    outside = set().union(*groups) - set(available)
    if outside:
        raise ValueError(
            f"{CPU_BIND_ENV}={spec!r} names cores {sorted(outside)} this process cannot use"
        )
    return groups


def bind_threads(cores: set[int] | None) -> int | None:
    """Pin this process to `cores` and size PyTorch's thread pool to them (call before the
    first parallel op, so the pool's threads inherit the affinity); returns that thread
    count. No-op (None) for None."""
    if not cores:
        return None
    import torch

    os.sched_setaffinity(0, cores)
    limit = os.environ.get("OMP_NUM_THREADS")
    threads = len(cores) if not limit else max(1, min(len(cores), int(limit)))
    torch.set_num_threads(threads)
    return threads
