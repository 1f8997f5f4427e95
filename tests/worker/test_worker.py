"""worker/worker.py: KV-cache sizing."""

from __future__ import annotations

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.worker import Worker


def _worker(model_dir: str, **kwargs) -> Worker:
    config = EngineArgs(model=model_dir, device="cpu", **kwargs).create_engine_config()
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    return worker


def test_default_cpu_kv_cache_is_capped_at_what_the_scheduler_can_use(tiny_llama_dir):
    worker = _worker(tiny_llama_dir, max_num_seqs=3, max_model_len=64)
    # 3 requests of 64 tokens: 4 blocks of 16 each, plus one for speculative tokens.
    assert worker.determine_num_kv_blocks() == 3 * (4 + 1)
    # An explicit budget is taken as given.
    worker = _worker(tiny_llama_dir, max_num_seqs=3, max_model_len=64, kv_cache_memory=8 << 20)
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    assert worker.determine_num_kv_blocks() == (8 << 20) // per_block > 3 * 5
