"""Tests for pagedllm.engine.stall: the watchdog's verdicts, its log lines, the test-only
step blocker (the server-level test is tests/entrypoints/test_health_stall.py)."""

from __future__ import annotations

import logging
import threading

import pytest

from pagedllm.engine.stall import StallWatchdog, StepBlocker, describe_in_flight
from tests.core.utils import create_requests, create_scheduler, step


def make_watchdog(has_work=lambda: True, describe=lambda: "1 running, 0 waiting: r (RUNNING)"):
    return StallWatchdog(
        10.0, 0, has_work=has_work, describe=describe, send=lambda h: None, stop=threading.Event()
    )


def test_stalled_only_with_work_and_past_the_timeout(caplog):
    work = [True]
    dog = make_watchdog(has_work=lambda: work[0])
    start = dog._progress_ts
    assert dog.check(start + 9.0).stalled_for_s == 0
    work[0] = False
    assert dog.check(start + 30.0).stalled_for_s == 0  # idle is not stalled
    work[0] = True
    with caplog.at_level(logging.ERROR, logger="pagedllm.engine.stall"):
        health = dog.check(start + 12.0)
        again = dog.check(start + 13.0)
    assert health.stalled_for_s == pytest.approx(12.0)
    assert "engine 0 stalled" in health.reason and "r (RUNNING)" in health.reason
    assert again.stalled_for_s == pytest.approx(13.0)
    stall_logs = [r for r in caplog.records if "stalled" in r.getMessage()]
    assert len(stall_logs) == 1, "the stall is logged once, when it starts"


def test_recovers_after_progress(caplog):
    dog = make_watchdog()
    assert dog.check(dog._progress_ts + 11.0).stalled_for_s > 0
    dog.progress()
    with caplog.at_level(logging.WARNING, logger="pagedllm.engine.stall"):
        assert dog.check().stalled_for_s == 0
    assert any("recovered" in r.getMessage() for r in caplog.records)


def test_a_failing_description_still_reports_the_stall():
    def broken() -> str:
        raise RuntimeError("changed size during iteration")

    dog = make_watchdog(describe=broken)
    health = dog.check(dog._progress_ts + 11.0)
    assert health.stalled_for_s > 0 and "could not list the requests" in health.reason


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="stall_timeout_s"):
        StallWatchdog(0, 0, lambda: True, lambda: "", lambda h: None, threading.Event())


def test_describe_names_each_request_and_its_state():
    scheduler = create_scheduler(max_num_batched_tokens=10, max_num_seqs=1)
    for request in create_requests(3, prompt_len=16):
        scheduler.add_request(request)
    step(scheduler)
    text = describe_in_flight(scheduler, limit=2)
    assert text.startswith("1 running, 2 waiting: ")
    assert "req0 (RUNNING, prompt 10/16 computed, 0 output tokens)" in text
    assert "req1 (WAITING" in text and "req2" not in text and "and 1 more" in text


def test_step_blocker_waits_while_the_file_exists(tmp_path):
    path = tmp_path / "block"
    path.touch()
    blocker = StepBlocker(str(path))
    released = threading.Event()
    thread = threading.Thread(target=lambda: (blocker.wait(threading.Event()), released.set()))
    thread.start()
    assert not released.wait(0.3)
    path.unlink()
    assert released.wait(10)
    thread.join()
    StepBlocker(None).wait(threading.Event())  # unset: returns at once
