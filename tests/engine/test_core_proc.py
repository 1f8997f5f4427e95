"""EngineCoreProc's per-engine config (the processes themselves run in test_core_client.py)."""

from __future__ import annotations

from pagedllm.config import KVTransferConfig
from pagedllm.engine.core_proc import set_data_parallel_rank
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
