"""SharedStorageConnector: a producer's prompts saved under a path are loaded by another
engine, with output identical to one engine computing everything."""

from __future__ import annotations

import os

from tests.distributed.kv_transfer.conftest import (
    check_idle,
    greedy,
    scheduler_of,
    token_ids,
)


def kv_config(path, role: str) -> dict:
    return {
        "kv_connector": "SharedStorageConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(path)},
    }


def test_producer_then_consumer(make_llm, prompts, reference, tmp_path):
    producer = make_llm(kv_transfer_config=kv_config(tmp_path, "kv_producer"))
    assert token_ids(producer.generate(prompts, greedy(), use_tqdm=False)) == reference
    check_idle(producer)
    (fingerprint,) = os.listdir(tmp_path / "pagedllm-kv")
    stored = [n for n in os.listdir(tmp_path / "pagedllm-kv" / fingerprint) if len(n) == 64]
    assert len(stored) == len(prompts)  # one prefix directory per prompt

    consumer = make_llm(kv_transfer_config=kv_config(tmp_path, "kv_consumer"))
    outputs = consumer.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outputs) == reference
    # A fresh engine: the first prompt's hit can only come from the files.
    assert outputs[0].num_cached_tokens == (len(prompts[0]["prompt_token_ids"]) - 1) // 16 * 16
    assert scheduler_of(consumer).num_preemptions_total > 0
    check_idle(consumer)


def test_unreadable_files_are_recomputed(make_llm, prompts, reference, tmp_path):
    producer = make_llm(kv_transfer_config=kv_config(tmp_path, "kv_producer"))
    producer.generate(prompts[:1], greedy(), use_tqdm=False)
    root = tmp_path / "pagedllm-kv"
    for directory, _, files in os.walk(root):
        for name in files:
            if name.endswith(".safetensors"):
                (root / directory / name).write_bytes(b"garbage")
    consumer = make_llm(kv_transfer_config=kv_config(tmp_path, "kv_consumer"))
    outputs = consumer.generate(prompts[:1], greedy(), use_tqdm=False)
    assert token_ids(outputs) == reference[:1]
    assert outputs[0].num_cached_tokens == 0
    check_idle(consumer)
