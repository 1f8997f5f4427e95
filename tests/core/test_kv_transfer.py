"""The scheduler with a KV connector (core/sched/kv_transfer.py): asynchronous loads park a
request while others run, failed loads are recomputed, blocks stay held while a transfer uses
them and are freed when it ends. A scripted connector (fake_kv_connector.py) plays the
connector; the runner is faked."""

from __future__ import annotations

import pytest

from pagedllm.config import KVTransferConfig
from pagedllm.core.request import RequestStatus
from pagedllm.outputs import KVConnectorOutput
from tests.core.utils import create_requests, create_scheduler, make_runner_output


def make_scheduler(**kwargs):
    kv = KVTransferConfig(
        kv_connector="FakeKVConnector", kv_connector_module_path="tests.core.fake_kv_connector"
    )
    scheduler = create_scheduler(kv_transfer_config=kv, **kwargs)
    return scheduler, scheduler.kv_transfer.connector


def run_step(scheduler, kv_output: KVConnectorOutput | None = None):
    so = scheduler.schedule()
    mro = make_runner_output(scheduler, so)
    mro.kv_connector_output = kv_output
    outputs = scheduler.update_from_output(so, mro)
    scheduler.check_integrity()
    return so, outputs


def test_async_load_parks_the_request_while_others_run():
    scheduler, connector = make_scheduler()
    req0, req1 = create_requests(2, prompt_len=48, max_tokens=2)
    connector.offer = {"req0": 32}
    scheduler.add_request(req0)
    scheduler.add_request(req1)

    so, _ = run_step(scheduler)
    assert req0.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.num_scheduled_tokens == {"req1": 48}  # req1 runs, req0 waits for its KV
    ((load_id, block_ids, num_tokens),) = so.kv_connector_metadata.loads
    assert (load_id, num_tokens) == ("req0", 32)
    assert block_ids == scheduler.kv_cache_manager.get_block_ids("req0")
    # Not cached before the load ends: nobody may hit blocks still being written.
    assert all(b.block_hash is None for b in scheduler.kv_cache_manager.req_to_blocks["req0"])

    so, _ = run_step(scheduler)  # still loading: req0 stays parked
    assert "req0" not in so.num_scheduled_tokens and req0.status.name == "WAITING_FOR_REMOTE_KVS"
    run_step(scheduler, KVConnectorOutput(finished_recving={"req0"}))
    so, _ = run_step(scheduler)
    assert so.num_scheduled_tokens["req0"] == 16  # only the tokens after the loaded ones
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    assert scheduler.kv_cache_manager.usage == 0.0
    assert [c for c in connector.calls if c[:2] == ("match", "req0")] == [("match", "req0", 0)]


def test_failed_load_is_computed_locally_and_never_retried():
    scheduler, connector = make_scheduler()
    (req,) = create_requests(1, prompt_len=48, max_tokens=1)
    connector.offer = {"req0": 32}
    scheduler.add_request(req)
    run_step(scheduler)
    block = scheduler.kv_cache_manager.get_block_ids("req0")[1]
    run_step(scheduler, KVConnectorOutput(finished_recving={"req0"}, invalid_block_ids={block}))
    so, outputs = run_step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 48}  # the whole prompt, computed here
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert outputs.outputs[0].finish_reason is not None
    assert [c[0] for c in connector.calls].count("match") == 1
    assert scheduler.kv_cache_manager.usage == 0.0


def test_abort_while_loading_holds_the_blocks_until_the_load_ends():
    scheduler, connector = make_scheduler()
    (req,) = create_requests(1, prompt_len=48)
    connector.offer = {"req0": 32}
    scheduler.add_request(req)
    run_step(scheduler)
    scheduler.finish_requests("req0", RequestStatus.FINISHED_ABORTED)
    scheduler.check_integrity()
    assert scheduler.kv_cache_manager.usage > 0  # the load still writes into them
    assert scheduler.has_requests() and scheduler.has_pending_kv_transfers()
    run_step(scheduler, KVConnectorOutput(finished_recving={"req0"}))
    assert scheduler.kv_cache_manager.usage == 0.0
    assert not scheduler.has_pending_kv_transfers()


def test_finished_request_is_held_until_sent():
    scheduler, connector = make_scheduler()
    (req,) = create_requests(1, prompt_len=40, max_tokens=1)
    connector.hold = {"req0"}
    scheduler.add_request(req)
    _, outputs = run_step(scheduler)
    assert outputs.outputs[0].kv_transfer_params == {"held": "req0"}
    assert scheduler.kv_cache_manager.usage > 0 and scheduler.has_pending_kv_transfers()
    with pytest.raises(ValueError, match="already in the scheduler"):
        scheduler.add_request(create_requests(1, prompt_len=40)[0])
    run_step(scheduler)  # not sent yet
    assert scheduler.kv_cache_manager.usage > 0
    run_step(scheduler, KVConnectorOutput(finished_sending={"req0"}))
    assert scheduler.kv_cache_manager.usage == 0.0 and not scheduler.has_requests()


def test_synchronous_external_tokens_run_in_the_same_step():
    scheduler, connector = make_scheduler()
    (req,) = create_requests(1, prompt_len=48, max_tokens=1)
    connector.offer, connector.load_async = {"req0": 32}, False
    scheduler.add_request(req)
    so, outputs = run_step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 16}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 32
    assert outputs.outputs[0].num_cached_tokens == 32


def test_prompt_logprobs_requests_get_no_external_tokens():
    scheduler, connector = make_scheduler()
    (req,) = create_requests(1, prompt_len=48, max_tokens=1, prompt_logprobs=1)
    connector.offer = {"req0": 32}
    scheduler.add_request(req)
    so, _ = run_step(scheduler)
    assert so.num_scheduled_tokens == {"req0": 48}
    assert not any(c[0] == "match" for c in connector.calls)


def test_loaded_requests_never_block_each_other():
    """Two loads fill the pool; the first loaded request needs one block more: the second
    gives its loaded blocks back (and loads again later) instead of both waiting forever."""
    scheduler, connector = make_scheduler(num_blocks=6, max_model_len=128)
    req0, req1 = create_requests(2, prompt_len=64, max_tokens=2)
    connector.offer = {"req0": 48, "req1": 48}
    scheduler.add_request(req0)
    scheduler.add_request(req1)
    run_step(scheduler)
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    loaded = KVConnectorOutput(finished_recving={"req0", "req1"})
    for _ in range(30):  # the fake worker finishes every load at once
        run_step(scheduler, loaded)
        if not scheduler.has_unfinished_requests():
            break
    assert not scheduler.has_unfinished_requests()
    assert scheduler.kv_cache_manager.usage == 0.0
    # req1 gave its blocks back to req0 and was loaded again.
    assert [c[0] for c in connector.calls if c[1:2] == ("req1",)].count("match") >= 2
