"""The process boundary: EngineCoreProc behind SyncMPClient / AsyncMPClient, on a model-free
fake core (tests/engine/fake_engine_core.py), so every case runs in about a second."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pagedllm.engine import EngineCoreOutputs, EngineCoreRequest
from pagedllm.engine.core_client import (
    AsyncMPClient,
    DPLBSyncMPClient,
    EngineCoreClient,
    InprocClient,
    SyncMPClient,
)
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.sampling_params import SamplingParams
from tests.engine.fake_engine_core import CRASH_TOKEN, FakeEngineCore, fake_config


def _request(rid: str, prompt: list[int], max_tokens: int = 4) -> EngineCoreRequest:
    return EngineCoreRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), time.time())


def _collect(client: EngineCoreClient, n_requests: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    finished = 0
    deadline = time.monotonic() + 10
    while finished < n_requests:
        assert time.monotonic() < deadline, "engine outputs timed out"
        for out in client.get_output().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            finished += out.finished
    return tokens


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once reaped or defunct.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not _pid_alive(pid):
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def sync_client():
    client = SyncMPClient(fake_config(), engine_core_cls=FakeEngineCore)
    yield client
    client.shutdown()


def test_make_client_picks_the_client(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    client = EngineCoreClient.make_client(fake_config(), engine_core_cls=FakeEngineCore)
    assert isinstance(client, InprocClient) and client.num_blocks == 42
    client.add_request(_request("a", [1, 2], max_tokens=2))
    assert _collect(client, 1) == {"a": [3, 4]}
    client.shutdown()


def test_sync_client_round_trip_and_utilities(sync_client):
    assert sync_client.num_blocks == 42
    sync_client.add_request(_request("a", [1, 2, 3], max_tokens=3))
    sync_client.add_request(_request("b", [10], max_tokens=5))
    assert _collect(sync_client, 2) == {"a": [4, 5, 6], "b": [11, 12, 13, 14, 15]}
    assert sync_client.call_utility("get_num_blocks") == 42
    assert sync_client.reset_prefix_cache() is True
    with pytest.raises(RuntimeError, match="no utility method"):
        sync_client.call_utility("no_such_method")
    with pytest.raises(RuntimeError, match="no utility method"):
        sync_client.call_utility("_private")


def test_abort_and_stats_go_back_to_zero():
    client = SyncMPClient(fake_config(step_delay=0.01), engine_core_cls=FakeEngineCore)
    try:
        client.add_request(_request("long", [1], max_tokens=10_000))
        first = client.get_output()
        while not first.outputs:
            first = client.get_output()
        client.abort_requests(["long"])
        deadline = time.monotonic() + 5
        stats = None
        while stats is None or stats.num_running_reqs != 0:
            assert time.monotonic() < deadline
            stats = client.get_output().scheduler_stats
        assert stats.kv_cache_usage == 0.0
    finally:
        client.shutdown()


def test_startup_failure_is_a_clear_error():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="initialization failed.*bad checkpoint"):
        SyncMPClient(fake_config(fail_start=True), engine_core_cls=FakeEngineCore)
    assert time.monotonic() - t0 < 30


def test_one_dp_engine_failing_to_start_is_a_clear_error(capfd, tmp_path):
    """Engine 0 fails while engine 1 is still starting: the front end names engine 0's cause,
    and engine 1, stopped mid-start, reports no failure of its own."""
    config = fake_config(
        parallel={"data_parallel_size": 2},
        fail_start=0,
        start_delay=60,
        starting_file=str(tmp_path / "engine-1-starting"),
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="initialization failed.*bad checkpoint"):
        EngineCoreClient.make_client(config, engine_core_cls=FakeEngineCore)
    assert time.monotonic() - t0 < 60  # not the start-up timeout
    logs = capfd.readouterr().err
    assert re.search(r"EngineCore_DP0 .*failed to start", logs), logs
    assert re.search(r"EngineCore_DP1 .*start-up interrupted by a signal", logs), logs
    assert not re.search(r"EngineCore_DP1 .*failed", logs), logs


def test_killed_engine_fails_requests_quickly(sync_client):
    sync_client.add_request(_request("a", [1], max_tokens=2))
    _collect(sync_client, 1)
    os.kill(sync_client.engine_pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            sync_client.get_output()
    assert time.monotonic() - t0 < 2
    with pytest.raises(EngineDeadError):
        sync_client.add_request(_request("b", [1]))
    with pytest.raises(EngineDeadError):
        sync_client.call_utility("get_num_blocks")


def test_dead_worker_kills_an_idle_engine_quickly():
    """The executor's failure callback wakes an idle busy loop: no request needs to run for
    the client to learn the engine is dead."""
    client = SyncMPClient(fake_config(worker_dies_after=0.2), engine_core_cls=FakeEngineCore)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1 died"):
            client.get_output()
        assert time.monotonic() - t0 < 2
        assert client.is_dead
    finally:
        client.shutdown()


def test_crash_in_step_reports_the_cause(sync_client):
    sync_client.add_request(_request("bad", [CRASH_TOKEN]))
    with pytest.raises(EngineDeadError, match="boom"):
        while True:
            sync_client.get_output()
    assert _wait_gone(sync_client.engine_pid)


def test_shutdown_stops_the_process(sync_client):
    pid = sync_client.engine_pid
    sync_client.shutdown()
    assert _wait_gone(pid)
    sync_client.shutdown()  # idempotent


def test_sigterm_stops_the_engine_process(sync_client):
    os.kill(sync_client.engine_pid, signal.SIGTERM)
    assert _wait_gone(sync_client.engine_pid)
    with pytest.raises(EngineDeadError):
        sync_client.get_output()


def test_engine_dies_with_its_parent(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from pagedllm.engine.core_client import SyncMPClient
        from tests.engine.fake_engine_core import FakeEngineCore, fake_config
        client = SyncMPClient(fake_config(), engine_core_cls=FakeEngineCore)
        print(client.engine_pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd()
    )
    try:
        engine_pid = int(parent.stdout.readline())
        assert _pid_alive(engine_pid)
        parent.kill()
        parent.wait()
        assert _wait_gone(engine_pid, timeout=10)
    finally:
        parent.kill()
        parent.wait()


def test_async_client():
    async def main():
        client = AsyncMPClient(fake_config(), engine_core_cls=FakeEngineCore)
        try:
            await client.add_request_async(_request("a", [5], max_tokens=3))
            tokens: list[int] = []
            while len(tokens) < 3:
                out: EngineCoreOutputs = await client.get_output_async()
                tokens += [t for o in out.outputs for t in o.new_token_ids]
            assert tokens == [6, 7, 8]
            assert await client.call_utility_async("get_num_blocks") == 42
            os.kill(client.engine_pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                while True:
                    await asyncio.wait_for(client.get_output_async(), 5)
        finally:
            client.shutdown()

    asyncio.run(main())


# --------------------------------------------------------------------- data parallelism


@pytest.fixture(scope="module")
def dp_client():
    """Two fake engines behind one DPLBSyncMPClient, shared by the tests below (the last one
    kills them)."""
    config = fake_config(parallel={"data_parallel_size": 2}, step_delay=0.01)
    client = EngineCoreClient.make_client(config, engine_core_cls=FakeEngineCore)
    yield client
    client.shutdown()


def _engines_of(client: EngineCoreClient, n_requests: int) -> dict[str, int]:
    """request id -> index of the engine that ran it, once `n_requests` have finished."""
    engines: dict[str, int] = {}
    finished = 0
    deadline = time.monotonic() + 60
    while finished < n_requests:
        assert time.monotonic() < deadline, "engine outputs timed out"
        outputs = client.get_output()
        for out in outputs.outputs:
            engines[out.request_id] = outputs.engine_index
            finished += out.finished
    return engines


def _pinned(rid: str, rank: int, max_tokens: int = 4) -> EngineCoreRequest:
    request = _request(rid, [1], max_tokens)
    request.data_parallel_rank = rank
    return request


@pytest.mark.distributed
def test_dp_client_balances_and_routes(dp_client):
    client = dp_client
    assert isinstance(client, DPLBSyncMPClient) and client.num_engines == 2
    for i in range(20):  # a burst, faster than any published count
        client.add_request(_request(f"r{i}", [i], max_tokens=3))
    engines = _engines_of(client, 20)
    # 10 / 10, unless a publish lands mid-burst on a loaded machine.
    assert abs(list(engines.values()).count(0) - 10) <= 2
    client.add_request(_pinned("pinned", 1))
    assert _engines_of(client, 1)["pinned"] == 1
    with pytest.raises(ValueError, match="data_parallel_rank=2"):
        client.add_request(_pinned("x", 2))
    # An abort goes to the engine that holds the request: its running count drops to 0.
    client.add_request(_pinned("long", 1, max_tokens=10_000))
    while not client.get_output().outputs:
        pass
    client.abort_requests(["long"])
    deadline = time.monotonic() + 5
    while True:
        assert time.monotonic() < deadline
        out = client.get_output()
        if out.engine_index == 1 and out.scheduler_stats.num_running_reqs == 0:
            break
    # A busy engine gets fewer new requests, once the coordinator has published it.
    for i in range(6):
        client.add_request(_pinned(f"busy{i}", 0, max_tokens=10_000))
    deadline = time.monotonic() + 60
    while client._lb.counts[0] != [0, 6]:
        assert time.monotonic() < deadline, "no published counts"
        client.get_output()
    for i in range(10):
        client.add_request(_request(f"burst{i}", [i], max_tokens=2))
    engines = _engines_of(client, 10)
    # Scores 6 (engine 0) vs 0: engine 1 takes 2, then they alternate.
    assert sum(engines[f"burst{i}"] == 1 for i in range(10)) >= 6
    client.abort_requests([f"busy{i}" for i in range(6)])
    assert client.call_utility("get_num_blocks") == 42  # every engine answers


@pytest.mark.distributed
def test_dp_engine_death_fails_only_its_requests(dp_client):
    client = dp_client
    for rid, rank in (("a", 0), ("b", 1)):
        client.add_request(_pinned(rid, rank, max_tokens=10_000))
    seen: set[str] = set()  # (the outputs of earlier tests' aborted requests may still come)
    while not seen >= {"a", "b"}:
        seen |= {o.request_id for o in client.get_output().outputs}
    os.kill(client.engine_pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while True:
        assert time.monotonic() < deadline, "the death was not reported"
        out = client.get_output()
        if out.errored_requests is not None:
            break
    assert out.engine_index == 1 and list(out.errored_requests) == ["b"]
    assert "data-parallel engine 1" in out.errored_requests["b"]
    assert set(client.dead_engines) == {1}
    # The live engine keeps serving: "a" still runs, new requests go to engine 0.
    client.add_request(_request("c", [1], max_tokens=3))
    engines = _engines_of(client, 1)
    assert engines["c"] == 0 and engines["a"] == 0
    with pytest.raises(EngineDeadError, match="engine 1"):
        client.add_request(_pinned("d", 1))
    os.kill(client.engine_pids[0], signal.SIGKILL)  # the last one: everything stops
    with pytest.raises(EngineDeadError):
        while True:
            client.get_output()
    pids = list(client.engine_pids.values())
    coordinator = client._resources.launcher.coordinator.proc
    client.shutdown()
    assert all(_wait_gone(pid) for pid in pids)
    assert not coordinator.is_alive()
