"""Tests for pagedllm.engine.snapshot: the dashboard's view of an engine core (block map,
request progress, step-time split), over the fake-runner scheduler of tests/core/utils.py."""

from __future__ import annotations

import pytest

from pagedllm.engine.snapshot import (
    BLOCK_CACHED,
    BLOCK_FREE,
    BLOCK_IN_USE,
    MAX_LISTED_REQUESTS,
    BlockMap,
    StepTimes,
    make_engine_snapshot,
)
from tests.core.utils import create_requests, create_scheduler, run_to_completion, step


def test_block_map_tells_free_in_use_and_cached_blocks():
    scheduler = create_scheduler(num_blocks=32, block_size=4, max_num_seqs=1)
    first, second = create_requests(2, prompt_len=8, max_tokens=4)
    scheduler.add_request(first)
    step(scheduler)  # first's 8 prompt tokens fill 2 blocks
    states, per_cell = BlockMap().build(scheduler)
    assert per_cell == 1 and len(states) == 32
    held = set(scheduler.kv_cache_manager.get_block_ids("req0"))
    assert {i for i, s in enumerate(states) if s == BLOCK_IN_USE} == held
    assert BLOCK_CACHED not in states

    run_to_completion(scheduler)  # first finishes: its full blocks stay cached, evictable
    states, _ = BlockMap().build(scheduler)
    assert BLOCK_IN_USE not in states
    cached = {i for i, s in enumerate(states) if s == BLOCK_CACHED}
    assert cached and cached <= held

    scheduler.add_request(second)
    step(scheduler)
    states, _ = BlockMap().build(scheduler)
    assert {i for i, s in enumerate(states) if s == BLOCK_IN_USE} == set(
        scheduler.kv_cache_manager.get_block_ids("req1")
    )


def test_a_big_cache_is_drawn_in_cells_showing_their_busiest_block(monkeypatch):
    import pagedllm.engine.snapshot as snapshot

    monkeypatch.setattr(snapshot, "MAX_MAP_CELLS", 8)
    scheduler = create_scheduler(num_blocks=32, block_size=4)
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    pool.blocks[9].block_hash = b"x"  # cell 2 (blocks 8-11): cached
    pool.blocks[13].block_hash = b"y"  # cell 3 (blocks 12-15): cached and in use -> in use
    manager.req_to_blocks["r"] = [pool.blocks[5], pool.blocks[14]]  # cells 1 and 3: in use
    states, per_cell = BlockMap().build(scheduler)
    assert per_cell == 4
    assert list(states) == [
        BLOCK_FREE, BLOCK_IN_USE, BLOCK_CACHED, BLOCK_IN_USE, *[BLOCK_FREE] * 4
    ]  # fmt: skip


def test_the_cached_part_is_rebuilt_within_its_time_budget(monkeypatch):
    scheduler = create_scheduler(num_blocks=32, block_size=4)
    pool = scheduler.kv_cache_manager.block_pool
    block_map = BlockMap()
    monkeypatch.setattr(BlockMap, "BASE_BUDGET", 1e-12)  # rebuilt "never again"
    block_map.build(scheduler)
    pool.blocks[3].block_hash = b"x"
    scheduler.kv_cache_manager.req_to_blocks["r"] = [pool.blocks[7]]
    states, _ = block_map.build(scheduler)
    assert states[7] == BLOCK_IN_USE, "blocks in use are current in every map"
    assert states[3] == BLOCK_FREE, "the cached part waits for its next rebuild"
    block_map._next_base = 0.0
    assert BlockMap().build(scheduler)[0][3] == BLOCK_CACHED


def test_snapshot_lists_request_progress_and_counts():
    scheduler = create_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    for request in create_requests(3, prompt_len=16, max_tokens=8):
        scheduler.add_request(request)
    step(scheduler)  # req0 gets 10 of its 16 prompt tokens; the rest wait
    snap = make_engine_snapshot(scheduler, StepTimes(), BlockMap())
    assert (snap.num_running, snap.num_waiting) == (1, 2)
    (running,) = snap.running
    assert (running.request_id, running.status) == ("req0", "RUNNING")
    assert (running.num_prompt_tokens, running.num_computed_tokens) == (16, 10)
    assert running.num_output_tokens == 0
    assert [r.request_id for r in snap.waiting] == ["req1", "req2"]
    assert snap.num_blocks == scheduler.kv_cache_manager.num_blocks


def test_snapshot_lists_are_capped_but_counts_are_whole():
    scheduler = create_scheduler(max_num_seqs=4)
    for request in create_requests(MAX_LISTED_REQUESTS + 5, prompt_len=4):
        scheduler.add_request(request)
    snap = make_engine_snapshot(scheduler, StepTimes(), BlockMap())
    assert len(snap.waiting) == MAX_LISTED_REQUESTS
    assert snap.num_waiting == MAX_LISTED_REQUESTS + 5


def test_step_times_average_and_reset():
    times = StepTimes()
    times.add(schedule=0.001, execute=0.010, sampling=0.002, output=0.003)
    times.add(schedule=0.003, execute=0.020, sampling=0.004, output=0.001)
    n, (sched, model, sampling, output) = times.take()
    assert n == 2
    assert sched == pytest.approx(0.002)
    assert model == pytest.approx(0.012)  # execute minus sampling
    assert sampling == pytest.approx(0.003)
    assert output == pytest.approx(0.002)
    assert times.take() == (0, (0.0, 0.0, 0.0, 0.0))
