"""What the engine core publishes for the dashboard: `StepTimes` (where a step's time goes)
and `make_engine_snapshot` (the KV block map, each request's progress, the step-time split).

Cost model: the step pays four `perf_counter` calls and four additions (always on, so the
split is there the moment a dashboard connects); the snapshot itself walks every KV block and
the queues once (a few microseconds per thousand blocks), and `EngineCoreProc` builds one at
most every `SNAPSHOT_INTERVAL_S` and only while a front end asked for them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedllm.engine import EngineSnapshot, RequestProgress

if TYPE_CHECKING:
    from pagedllm.core.request import Request
    from pagedllm.core.sched.scheduler import Scheduler

SNAPSHOT_INTERVAL_S = 1.0
# Above this many blocks, a map cell stands for several blocks (the page draws one square
# per cell; a GPU cache can have hundreds of thousands of blocks).
MAX_MAP_CELLS = 16384
# Requests listed per queue; the counts are always whole.
MAX_LISTED_REQUESTS = 64

BLOCK_FREE, BLOCK_IN_USE, BLOCK_CACHED = 0, 1, 2


class StepTimes:
    """Sums of the phases of the steps since the last `take()`: scheduling, model forward,
    sampling (as the model runner reports it), output processing."""

    __slots__ = ("num_steps", "schedule", "model", "sampling", "output")

    def __init__(self) -> None:
        self.num_steps = 0
        self.schedule = self.model = self.sampling = self.output = 0.0

    def add(self, schedule: float, execute: float, sampling: float, output: float) -> None:
        """`execute`: the executor's whole call, of which `sampling` was spent sampling."""
        self.num_steps += 1
        self.schedule += schedule
        self.model += max(execute - sampling, 0.0)
        self.sampling += sampling
        self.output += output

    def take(self) -> tuple[int, tuple[float, float, float, float]]:
        """(steps, mean seconds per step of each phase), and start over."""
        n = self.num_steps
        means = (0.0, 0.0, 0.0, 0.0)
        if n:
            means = (self.schedule / n, self.model / n, self.sampling / n, self.output / n)
        self.__init__()
        return n, means


def block_state_map(scheduler: Scheduler) -> tuple[bytes, int]:
    """One byte per block (see `EngineSnapshot`), and how many blocks a byte stands for."""
    blocks = scheduler.kv_cache_manager.block_pool.blocks
    states = bytes(
        BLOCK_IN_USE if b.ref_cnt else (BLOCK_CACHED if b.block_hash is not None else BLOCK_FREE)
        for b in blocks
    )
    per_cell = -(-len(states) // MAX_MAP_CELLS)
    if per_cell == 1:
        return states, 1
    # A cell shows its busiest block: in use over cached over free. Ranking the states in that
    # order swaps 1 and 2, a permutation that is its own inverse.
    swap = bytes.maketrans(bytes((BLOCK_IN_USE, BLOCK_CACHED)), bytes((BLOCK_CACHED, BLOCK_IN_USE)))
    ranks = states.translate(swap)
    cells = bytes(max(ranks[i : i + per_cell]) for i in range(0, len(ranks), per_cell))
    cells = cells.translate(swap)
    return cells, per_cell


def _progress(request: Request) -> RequestProgress:
    return RequestProgress(
        request_id=request.request_id,
        status=request.status.name,
        num_prompt_tokens=request.num_prompt_tokens,
        num_computed_tokens=min(request.num_computed_tokens, request.num_prompt_tokens),
        num_output_tokens=request.num_output_tokens,
        arrival_time=request.arrival_time,
        num_preemptions=request.num_preemptions,
    )


def make_engine_snapshot(scheduler: Scheduler, step_times: StepTimes) -> EngineSnapshot:
    """The scheduler's state now, and the step-time split since the last snapshot (taken)."""
    block_states, per_cell = block_state_map(scheduler)
    running = scheduler.running
    waiting = list(scheduler.waiting)
    num_steps, means = step_times.take()
    return EngineSnapshot(
        timestamp=time.time(),
        num_blocks=scheduler.kv_cache_manager.num_blocks,
        block_states=block_states,
        blocks_per_cell=per_cell,
        running=[_progress(r) for r in running[:MAX_LISTED_REQUESTS]],
        waiting=[_progress(r) for r in waiting[:MAX_LISTED_REQUESTS]],
        num_running=len(running),
        num_waiting=len(waiting),
        num_preemptions_total=scheduler.num_preemptions_total,
        num_steps=num_steps,
        step_times=means,
    )
