"""What the engine core publishes for the dashboard: `StepTimes` (where a step's time goes)
and `make_engine_snapshot` (the KV block map, each request's progress, the step-time split).

Cost model: the step pays four `perf_counter` calls and four additions (always on, so the
split is there the moment a dashboard connects); `EngineCoreProc` builds a snapshot at most
every `SNAPSHOT_INTERVAL_S` and only while a front end asked for one, and `BlockMap` keeps
the block map's share of the engine's time under half a percent whatever the cache size.
"""

from __future__ import annotations

import time
from itertools import chain
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

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


class BlockMap:
    """Builds the block map (see `EngineSnapshot`). The blocks in use are current in every
    map (read from the requests' block lists: cheap). Which free blocks still hold a cached
    prefix needs a look at every block (about 0.1 us each), so that part is rebuilt only as
    often as keeps it under `BASE_BUDGET` of the engine's time: every snapshot for a CPU-sized
    cache, every few seconds for a GPU's hundreds of thousands of blocks (a block freed since
    shows as free until then)."""

    BASE_BUDGET = 0.005

    def __init__(self) -> None:
        self._base: np.ndarray | None = None  # BLOCK_CACHED where a block has a hash
        self._next_base = 0.0

    def build(self, scheduler: Scheduler) -> tuple[bytes, int]:
        """The map's bytes and how many blocks a byte stands for."""
        manager = scheduler.kv_cache_manager
        blocks = manager.block_pool.blocks
        num_blocks = len(blocks)
        now = time.perf_counter()
        if self._base is None or len(self._base) != num_blocks or now >= self._next_base:
            hashed = (b.block_hash is not None for b in blocks)
            self._base = np.fromiter(hashed, dtype=bool, count=num_blocks).astype(np.uint8)
            self._base *= BLOCK_CACHED
            done = time.perf_counter()
            self._next_base = done + (done - now) / self.BASE_BUDGET
        states = self._base.copy()
        held = map(attrgetter("block_id"), chain.from_iterable(manager.req_to_blocks.values()))
        states[np.fromiter(held, dtype=np.int64)] = BLOCK_IN_USE
        per_cell = -(-num_blocks // MAX_MAP_CELLS)
        if per_cell == 1:
            return states.tobytes(), 1
        # A cell shows its busiest block: in use over cached over free. Ranking the states in
        # that order swaps 1 and 2, a permutation that is its own inverse.
        swap = np.array([BLOCK_FREE, BLOCK_CACHED, BLOCK_IN_USE], dtype=np.uint8)
        padded = np.zeros(-(-num_blocks // per_cell) * per_cell, dtype=np.uint8)
        padded[:num_blocks] = swap[states]
        return swap[padded.reshape(-1, per_cell).max(axis=1)].tobytes(), per_cell


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


def make_engine_snapshot(
    scheduler: Scheduler, step_times: StepTimes, block_map: BlockMap
) -> EngineSnapshot:
    """The scheduler's state now, and the step-time split since the last snapshot (taken)."""
    block_states, per_cell = block_map.build(scheduler)
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
