"""The API servers of `--api-server-count K` open together (api_server_procs.StartGate): a
server that is ready waits until every sibling has closed its "starting" responder, since on
the shared socket that responder would answer 503 to connections meant for a ready server."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

from pagedllm.entrypoints.openai.api_server_procs import StartGate


def _arrive_late(gate: StartGate, delay_s: float, arrived_at) -> None:
    time.sleep(delay_s)
    arrived_at.value = time.monotonic()
    gate.arrive()


def test_gate_opens_only_when_every_process_arrived():
    ctx = multiprocessing.get_context("spawn")
    gate = StartGate(ctx, 2)
    arrived_at = ctx.Value("d", 0.0)
    sibling = ctx.Process(target=_arrive_late, args=(gate, 1.0, arrived_at))
    sibling.start()
    try:
        gate.arrive()
        assert asyncio.run(gate.wait_all(timeout_s=60.0)) is True
        opened_at = time.monotonic()
        assert arrived_at.value > 0.0  # the sibling had arrived ...
        assert opened_at >= arrived_at.value  # ... before this one opened
    finally:
        sibling.join(timeout=30)
    assert sibling.exitcode == 0


def test_gate_serves_anyway_after_its_timeout():
    gate = StartGate(multiprocessing.get_context("spawn"), 3)
    gate.arrive()
    gate.arrive()
    start = time.monotonic()
    assert asyncio.run(gate.wait_all(timeout_s=0.3)) is False
    assert time.monotonic() - start >= 0.3
