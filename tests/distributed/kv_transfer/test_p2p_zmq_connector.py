"""P2pZmqConnector: a prefill engine (its own process, as in serving) computes each prompt
with max_tokens=1; a decode engine pulls the KV with the returned kv_transfer_params and
generates output identical to one engine doing both. Also chained with offloading
(MultiConnector), and the front end's checks of kv_transfer_params."""

from __future__ import annotations

import pytest

from tests.distributed.kv_transfer.conftest import (
    check_idle,
    greedy,
    scheduler_of,
    token_ids,
)

PRODUCER = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer"}
CONSUMER = {"kv_connector": "P2pZmqConnector", "kv_role": "kv_consumer"}


@pytest.fixture(scope="module")
def prefill_llm(tiny_llama_dir):
    """The prefill engine, in its own process (it keeps stepping to serve its blocks), with
    room to hold every prompt's blocks until they are pulled."""
    from pagedllm import LLM
    from tests.distributed.kv_transfer.conftest import ENGINE_KWARGS

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "1")
        kwargs = {**ENGINE_KWARGS, "num_gpu_blocks_override": 64}
        llm = LLM(tiny_llama_dir, **kwargs, kv_transfer_config=PRODUCER)
    yield llm
    llm.shutdown()


def prefill(llm, prompts) -> list[dict]:
    outputs = llm.generate(prompts, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [o.kv_transfer_params for o in outputs]
    assert all(p["do_remote_prefill"] and p["remote_block_ids"] for p in params)
    return params


def decode(llm, prompts, params):
    sampling = [greedy(kv_transfer_params=p) for p in params]
    return llm.generate(prompts, sampling, use_tqdm=False)


def test_prefill_decode_pair(prefill_llm, make_llm, prompts, reference):
    params = prefill(prefill_llm, prompts)
    decoder = make_llm(kv_transfer_config=CONSUMER)
    outputs = decode(decoder, prompts, params)
    assert token_ids(outputs) == reference
    # Every prompt token but the last came over the wire or from the local prefix cache.
    for output in outputs:
        assert output.num_cached_tokens == len(output.prompt_token_ids) - 1
    assert scheduler_of(decoder).num_preemptions_total > 0
    check_idle(decoder)


def test_pull_failure_is_recomputed(prefill_llm, make_llm, prompts, reference):
    (params,) = prefill(prefill_llm, prompts[:1])
    decoder = make_llm(kv_transfer_config=CONSUMER)
    wrong = {**params, "remote_engine_id": "a-restarted-engine"}  # the sender refuses
    outputs = decode(decoder, prompts[:1], [wrong])
    assert token_ids(outputs) == reference[:1]
    assert outputs[0].num_cached_tokens == 0
    check_idle(decoder)


def test_chained_with_offloading(prefill_llm, make_llm, prompts, reference):
    multi = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {
            "connectors": [
                CONSUMER,
                {
                    "kv_connector": "OffloadingConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"num_cpu_blocks": 64},
                },
            ]
        },
    }
    params = prefill(prefill_llm, prompts)
    decoder = make_llm(kv_transfer_config=multi, enable_prefix_caching=False)
    assert token_ids(decode(decoder, prompts, params)) == reference
    # The pulled blocks were offloaded too: without params they come from CPU memory now.
    again = decoder.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(again) == reference
    assert all(o.num_cached_tokens >= 48 for o in again)
    check_idle(decoder)


@pytest.mark.parametrize(
    "kv_transfer_config, params, match",
    [
        (None, {"do_remote_decode": True}, "has no KV connector"),
        (CONSUMER, {"do_remote_decode": True}, "needs kv_role kv_producer"),
        (CONSUMER, {"do_remote_prefill": True, "remote_host": "h"}, "remote_engine_id"),
        (CONSUMER, {"bogus": 1}, "unknown key"),
        ({"kv_connector": "SharedStorageConnector"}, {"do_remote_decode": True}, "not used"),
    ],
)
def test_kv_transfer_params_are_checked(make_llm, kv_transfer_config, params, match):
    llm = make_llm(kv_transfer_config=kv_transfer_config)
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(kv_transfer_params=params))


@pytest.mark.parametrize(
    "kv_transfer_config, match",
    [
        ({"kv_connector": "NoSuchConnector"}, "not a known connector"),
        ({"kv_connector": "P2pZmqConnector", "kv_role": "kv_sideways"}, "kv_role"),
        ({"kv_connector": "P2pZmqConnector", "kv_buffer_size": 1}, "unknown key"),
        (
            {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"cpu": 1}},
            "not used by the OffloadingConnector",
        ),
        ({"kv_connector": "OffloadingConnector"}, "needs a tier"),
        ({"kv_connector": "MultiConnector"}, "needs kv_connector_extra_config.connectors"),
        ({"kv_connector": "P2pZmqConnector", "kv_load_failure_policy": "fail"}, "recompute"),
    ],
)
def test_bad_kv_transfer_configs(tiny_llama_dir, kv_transfer_config, match):
    from pagedllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=tiny_llama_dir, kv_transfer_config=kv_transfer_config)
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()
