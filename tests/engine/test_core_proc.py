"""EngineCoreProc's per-engine config and cores (the processes themselves run in
test_core_client.py)."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.config import KVTransferConfig
from pagedllm.engine.core_proc import engine_cpu_cores, set_data_parallel_rank
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
