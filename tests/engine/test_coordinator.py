"""DPCoordinator: its state (counts, deaths, heartbeats), the wave barrier seam, and the
process end to end (engines' counts and a death report reach a subscribed front end)."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from pagedllm.engine import EngineCoreRequestType
from pagedllm.engine.coordinator import (
    CoordinatorState,
    DPCoordinator,
    WaveBarrier,
    report_engine_death,
)


def test_state_counts_deaths_and_heartbeats():
    state = CoordinatorState(2, heartbeat_timeout_s=5.0)
    assert state.on_counts(0, 3, 1, now=0.0)
    assert not state.on_counts(0, 3, 1, now=1.0)  # unchanged
    assert state.on_counts(1, 0, 2, now=4.0)
    assert state.check_heartbeats(now=6.5) == [0]  # engine 0 silent since t=1.0: > 5 s
    assert state.snapshot() == {"counts": [[0, 0], [0, 2]], "dead": {0: "no heartbeat for 5s"}}
    assert not state.on_counts(0, 9, 9, now=7.0)  # the dead stay dead
    assert state.on_dead(1, "process exited with code -9")
    assert not state.on_dead(1, "again")


def test_wave_barrier_waits_for_every_live_engine():
    barrier = WaveBarrier(3)
    assert barrier.engine_done(0, 0) is None
    assert barrier.engine_done(1, 0) is None
    assert barrier.engine_done(1, 0) is None  # a repeat changes nothing
    assert barrier.engine_done(2, 1) is None  # stale / future wave: ignored
    assert barrier.engine_done(2, 0) == 1
    assert barrier.engine_done(0, 1) is None
    assert barrier.engine_dead(1) is None
    assert barrier.engine_dead(2) == 2  # the only live engine (0) has finished wave 1


@pytest.mark.distributed
def test_coordinator_process_publishes_counts_and_deaths(tmp_path):
    coordinator = DPCoordinator(2, None, str(tmp_path))
    ctx = zmq.Context()
    try:
        front = ctx.socket(zmq.SUB)
        front.setsockopt(zmq.SUBSCRIBE, b"")
        front.connect(coordinator.front_publish_address)
        engines = ctx.socket(zmq.SUB)
        engines.setsockopt(zmq.SUBSCRIBE, b"")
        engines.connect(coordinator.engine_publish_address)
        push = ctx.socket(zmq.PUSH)
        push.connect(coordinator.input_address)

        def wait_for(predicate):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if front.poll(100):
                    msg = msgspec.msgpack.decode(front.recv())
                    if predicate(msg):
                        return msg
                else:  # the first counts may go out before the subscription is seen
                    push.send(msgspec.msgpack.encode(["counts", 1, 2, 5]))
            raise AssertionError("no such publish")

        wait_for(lambda m: m["counts"] == [[0, 0], [2, 5]])
        report_engine_death(ctx, coordinator.input_address, 0, "process exited with code -9")
        msg = wait_for(lambda m: m["dead"])
        assert msg["dead"] == {0: "process exited with code -9"}
        coordinator.shutdown()  # tells the engines to stop on its way out
        assert engines.poll(5000)
        assert engines.recv_multipart()[0] == EngineCoreRequestType.SHUTDOWN.value
    finally:
        coordinator.shutdown()
        ctx.destroy(linger=0)
