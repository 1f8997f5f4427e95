"""Tensor parallelism: two gloo worker processes, each holding half of every layer, must
produce the logits of the single-process model."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from pagedllm.distributed import get_tp_rank, get_tp_world_size
from pagedllm.models.loader import get_model
from tests.models.test_models_vs_hf import PagedBatchRunner

PROMPTS = [[5, 17, 99, 230, 31, 8, 77], [400, 12, 12, 301, 9]]
TP = 2


def _engine_config(model_dir: str):
    from pagedllm.config import (
        CacheConfig,
        DeviceConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from pagedllm.transformers_utils.config import get_hf_config

    hf_config = get_hf_config(model_dir)
    return EngineConfig(
        model_config=ModelConfig(
            model=model_dir,
            tokenizer=model_dir,
            hf_config=hf_config,
            dtype=torch.float32,
            max_model_len=256,
        ),
        cache_config=CacheConfig(),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=256, max_num_seqs=4, max_model_len=256
        ),
        parallel_config=ParallelConfig(tensor_parallel_size=TP),
        device_config=DeviceConfig("cpu"),
    )


def _run(model_dir: str) -> list[torch.Tensor]:
    """Prefill then one decode step; each request's logits rows, concatenated."""
    torch.set_num_threads(1)
    model = get_model(_engine_config(model_dir))
    hf_config = model.config.model_config.hf_config
    tp = get_tp_world_size()
    # Each rank holds only its shard.
    assert model.model.embed_tokens.weight.shape[0] == hf_config.vocab_size // tp
    gate_up = model.model.layers[0].mlp.gate_up_proj
    rows = getattr(gate_up, "weight_out_features", gate_up.weight.shape[0])  # packed or plain
    assert rows == 2 * hf_config.intermediate_size // tp
    runner = PagedBatchRunner(model, len(PROMPTS))
    first = runner.step([list(p) for p in PROMPTS])
    second = runner.step([[7], [9]])
    if first is None:  # logits are gathered on tensor-parallel rank 0 only
        assert get_tp_rank() > 0 and second is None
        return []
    return [torch.cat([a, b]) for a, b in zip(first, second)]


def _worker(rank: int, model_dirs: list[str], init_file: str, out_file: str) -> None:
    from pagedllm.distributed import destroy_distributed, init_distributed

    init_distributed(TP, rank, distributed_init_method=f"file://{init_file}", backend="gloo")
    try:
        logits = [_run(d) for d in model_dirs]
        if rank == 0:
            torch.save(logits, out_file)
    finally:
        destroy_distributed()


@pytest.mark.distributed
def test_tp2_matches_single_process(tiny_model_dirs, tmp_path):
    # Llama: untied LM head, GQA with one kv head per rank; Qwen2: q/k/v biases, tied head;
    # Qwen3: per-head q/k norms over each rank's heads.
    model_dirs = [tiny_model_dirs[arch] for arch in ("llama", "qwen2", "qwen3")]
    references = [_run(d) for d in model_dirs]
    assert get_tp_world_size() == 1

    ctx = mp.get_context("spawn")
    out_file = str(tmp_path / "logits.pt")
    procs = [
        ctx.Process(target=_worker, args=(r, model_dirs, str(tmp_path / "init"), out_file))
        for r in range(TP)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * TP
    results = torch.load(out_file)
    for reference, sharded in zip(references, results):
        for ref, got in zip(reference, sharded):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
