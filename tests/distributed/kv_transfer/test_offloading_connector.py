"""OffloadingConnector: blocks evicted from the device come back from CPU memory or disk with
output identical to one engine computing everything; the disk tier survives a restart; an
unreadable block file is recomputed."""

from __future__ import annotations

import os

import pytest

from tests.distributed.kv_transfer.conftest import (
    check_idle,
    greedy,
    scheduler_of,
    token_ids,
)


def kv_config(**extra) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}


def block_files(root) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".kv")]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_cpu_tier(make_llm, prompts, reference, prefix_caching):
    llm = make_llm(
        kv_transfer_config=kv_config(num_cpu_blocks=64), enable_prefix_caching=prefix_caching
    )
    assert token_ids(llm.generate(prompts, greedy(), use_tqdm=False)) == reference
    second = llm.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(second) == reference
    assert scheduler_of(llm).num_preemptions_total > 0
    if not prefix_caching:  # every hit is the connector's (synchronous, from CPU memory)
        assert all(o.num_cached_tokens >= 48 for o in second)
    check_idle(llm)


def test_disk_tier_survives_a_restart(make_llm, prompts, reference, tmp_path):
    config = kv_config(num_cpu_blocks=4, disk_path=str(tmp_path))
    first = make_llm(kv_transfer_config=config)
    assert token_ids(first.generate(prompts, greedy(), use_tqdm=False)) == reference
    num_blocks = scheduler_of(first).kv_cache_manager.num_blocks
    first.shutdown()
    assert len(block_files(tmp_path)) > num_blocks  # more than the device tier holds

    restarted = make_llm(kv_transfer_config=config)
    outputs = restarted.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outputs) == reference
    # A fresh engine: its first hit comes from disk (the CPU tier is only 4 blocks).
    assert outputs[0].num_cached_tokens == (len(prompts[0]["prompt_token_ids"]) - 1) // 16 * 16
    check_idle(restarted)


def test_disk_size_limit_and_unreadable_blocks(make_llm, prompts, reference, tmp_path):
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # layers * K/V * tokens * kv heads * head dim * fp32
    config = kv_config(disk_path=str(tmp_path), disk_bytes_to_use=5 * block_bytes)
    first = make_llm(kv_transfer_config=config)
    first.generate(prompts[:2], greedy(), use_tqdm=False)
    first.shutdown()
    files = block_files(tmp_path)
    assert len(files) == 5  # 8 distinct blocks, LRU-evicted down to the limit
    restarted = make_llm(kv_transfer_config=config, enable_prefix_caching=False)
    for path in files:  # damaged after the restart scanned them: loads must fail
        with open(path, "r+b") as f:
            f.truncate(100)
    outputs = restarted.generate(prompts[:2], greedy(), use_tqdm=False)
    assert token_ids(outputs) == reference[:2]
    assert outputs[0].num_cached_tokens == 0  # its loads failed: computed here
    check_idle(restarted)
    # The damaged files were dropped (recomputed blocks may have been stored anew).
    assert all(os.path.getsize(path) == block_bytes for path in block_files(tmp_path))
