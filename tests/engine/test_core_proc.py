"""EngineCoreProc's per-engine config and cores (the processes themselves run in
test_core_client.py)."""

from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

from pagedllm.config import KVTransferConfig
from pagedllm.engine.core_proc import engine_cpu_cores, pin_engine_process, set_data_parallel_rank
from pagedllm.worker.cpu_binding import CPU_BIND_ENV
from tests.engine.fake_engine_core import fake_config


def test_each_data_parallel_engine_is_its_own_kv_peer():
    kv = KVTransferConfig(kv_connector="P2pZmqConnector", engine_id="prefill", kv_port=7100)
    config = fake_config(parallel={"data_parallel_size": 4}, kv_transfer_config=kv)
    set_data_parallel_rank(config, dp_rank=3, local_dp_rank=1)
    assert (
        config.parallel_config.data_parallel_rank,
        config.parallel_config.data_parallel_rank_local,
    ) == (3, 1)
    assert (kv.engine_id, kv.kv_port) == ("prefill_dp3", 7101)
    # One engine keeps the ids it was given; a free port (0) stays free.
    single = KVTransferConfig(kv_connector="P2pZmqConnector", engine_id="decode")
    set_data_parallel_rank(fake_config(kv_transfer_config=single), 0, 0)
    assert (single.engine_id, single.kv_port) == ("decode", 0)


def test_engines_of_one_cpu_node_split_its_cores(monkeypatch):
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    cores = {0, 1, 2, 3, 4}
    two = fake_config(parallel={"data_parallel_size": 3, "data_parallel_size_local": 2})
    assert [engine_cpu_cores(two, r, cores) for r in (0, 1)] == [{0, 1}, {2, 3}]
    # One engine on the node, GPUs, or a binding the user set: no pinning here.
    one = fake_config(parallel={"data_parallel_size": 2, "data_parallel_size_local": 1})
    assert engine_cpu_cores(one, 0, cores) is None
    assert engine_cpu_cores(fake_config(parallel={"data_parallel_size": 2}), 1, cores) == {2, 3}
    gpu = fake_config(
        parallel={"data_parallel_size": 2}, device_config=SimpleNamespace(device="cuda")
    )
    assert engine_cpu_cores(gpu, 0, cores) is None
    monkeypatch.setenv(CPU_BIND_ENV, "nobind")
    assert engine_cpu_cores(two, 0, cores) is None


def _pinned_engine(config) -> tuple[int, set[int] | None, int, str | None]:
    import torch  # loaded before the pinning, as in a spawned engine process

    before = torch.get_num_threads()
    cores = pin_engine_process(config, 1)
    return before, cores, torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_a_spawned_engine_runs_one_thread_per_core_of_its_own(monkeypatch):
    """An engine process is spawned with torch already sized for all of the node's cores;
    pinned to its share, it must run that many compute threads, not the node's count."""
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    config = fake_config(parallel={"data_parallel_size": 2})
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        before, cores, after, env = pool.apply(_pinned_engine, (config,))
    share = max(1, len(os.sched_getaffinity(0)) // 2)
    assert len(cores) == share and after == share and env == str(share)
    assert before == len(os.sched_getaffinity(0))  # what it was sized for before


def test_idle_step_sends_its_gauges_to_every_front_end():
    """Several API servers: a step's scheduler stats go to one of them (counted once); the
    step that leaves the engine idle also gives every other one its gauges (no counts), so no
    API server's last gauge write is a stale busy state."""
    import queue

    from pagedllm.engine import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
    from pagedllm.engine.core_proc import EngineCoreProc

    proc = SimpleNamespace(
        engine_index=1,
        _out_sockets=[None, None, None],
        _request_clients={"a": 2},
        output_queue=queue.Queue(),
    )
    stats = SchedulerStats(num_running_reqs=1, kv_cache_usage=0.5, prefix_cache_hits=7)

    def sent(outputs, idle):
        EngineCoreProc._send_outputs(proc, outputs, idle=idle)
        items = []
        while not proc.output_queue.empty():
            items.append(proc.output_queue.get())
        return {index: part.scheduler_stats for index, part in items}

    busy = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="a", new_token_ids=[5])])
    busy.scheduler_stats = stats
    assert sent(busy, idle=False) == {2: stats}  # only the request's front end
    idle = EngineCoreOutputs(scheduler_stats=SchedulerStats(num_blocks_total=9))
    got = sent(idle, idle=True)
    assert got[0] == SchedulerStats(num_blocks_total=9)  # the counted copy
    assert got[1] == got[2] == SchedulerStats(num_blocks_total=9)
    stats_idle = SchedulerStats(num_waiting_reqs=2, prefix_cache_queries=4, num_preemptions=1)
    got = sent(EngineCoreOutputs(scheduler_stats=stats_idle), idle=True)
    assert got[0] == stats_idle
    assert got[1] == got[2] == SchedulerStats(num_waiting_reqs=2)  # gauges only
