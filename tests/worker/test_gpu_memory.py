"""GPU memory sizing with a fake memory reader, on the CPU: the arithmetic, the start-up
check, and the worker's flow (a real profiling forward at the largest batch, the log line,
overrides that win)."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.worker.gpu_memory import MemoryProfile, check_free_at_start
from pagedllm.worker.worker import Worker

GIB = 1 << 30
MIB = 1 << 20


class FakeReader:
    """A device of `total` bytes. `allocated` moves as the test says; during a profiling run
    the allocator peaks `peak` above where it started; the process holds `non_torch` bytes
    outside PyTorch once the profile has run."""

    def __init__(self, total=80 * GIB, used_by_others=GIB, peak=3 * GIB, non_torch=512 * MIB):
        self.total, self.used_by_others = total, used_by_others
        self.peak, self.non_torch = peak, non_torch
        self.allocated = 0
        self.profiled = False
        self.calls: list[str] = []

    def mem_get_info(self):
        used = self.used_by_others + self.memory_reserved()
        used += self.non_torch if self.profiled else 0
        return self.total - used, self.total

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        self.profiled = True
        return self.allocated + self.peak

    def memory_reserved(self):
        return self.allocated + 64 * MIB  # the caching allocator keeps a little spare

    def reset_peak_memory_stats(self):
        self.calls.append("reset_peak")

    def empty_cache(self):
        self.calls.append("empty_cache")


def test_kv_cache_gets_what_utilization_leaves():
    profile = MemoryProfile(
        total=80 * GIB, utilization=0.9, weights=2 * GIB, activation_peak=GIB, non_torch=GIB // 2
    )
    assert profile.requested == int(72 * GIB)
    assert profile.kv_cache_bytes == int(72 * GIB) - 2 * GIB - GIB - GIB // 2


def test_too_little_free_memory_at_start_names_the_flag():
    reader = FakeReader(total=80 * GIB, used_by_others=10 * GIB)
    at_start = check_free_at_start(reader, 0.85)
    assert (at_start.free, at_start.reserved) == (70 * GIB - 64 * MIB, 64 * MIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9"):
        check_free_at_start(reader, 0.9)


def _worker(make_engine_config, model_dir, reader, **cache):
    config = make_engine_config(model_dir)
    config.scheduler_config.max_num_batched_tokens = 48
    config.scheduler_config.max_num_seqs = 5
    for name, value in cache.items():
        setattr(config.cache_config, name, value)
    worker = Worker(config, memory_reader=reader)
    worker.init_device()

    load = worker.model_runner.load_model

    def load_weights():  # the weights "allocate" 2 GiB on the device
        load()
        reader.allocated += 2 * GIB

    worker.model_runner.load_model = load_weights
    worker.load_model()
    return worker


def test_worker_profiles_the_largest_batch(make_engine_config, tiny_llama_dir, caplog):
    reader = FakeReader()
    worker = _worker(make_engine_config, tiny_llama_dir, reader, gpu_memory_utilization=0.9)
    assert worker.weights_memory == 2 * GIB
    seen = []
    model = worker.model_runner.model
    hook = model.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.worker"):
        num_blocks = worker.determine_num_kv_blocks()
    hook.remove()
    assert seen == [48]  # one forward of max_num_batched_tokens tokens
    assert "reset_peak" in reader.calls
    kv_bytes = int(0.9 * 80 * GIB) - 2 * GIB - 3 * GIB - 512 * MIB
    assert num_blocks == kv_bytes // worker.model_runner.kv_cache_bytes_per_block()
    assert f"({num_blocks} blocks)" in caplog.text and "activation peak 3.00 GiB" in caplog.text
    # The scratch cache is gone; the real one binds and the model runs on it.
    worker.initialize_kv_cache(8)
    assert all(c.shape[1] == 8 for c in worker.model_runner.kv_caches)


@pytest.mark.parametrize(
    "cache,expected",
    [({"num_gpu_blocks_override": 7}, 7), ({"kv_cache_memory_bytes": 4 * MIB}, None)],
)
def test_explicit_sizes_win_over_profiling(make_engine_config, tiny_llama_dir, cache, expected):
    reader = FakeReader()
    worker = _worker(make_engine_config, tiny_llama_dir, reader, **cache)
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    assert worker.determine_num_kv_blocks() == (expected or 4 * MIB // per_block)
    assert "reset_peak" not in reader.calls


def test_cpu_without_reader_keeps_the_cpu_default(make_engine_config, tiny_llama_dir):
    config = make_engine_config(tiny_llama_dir)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    assert worker.memory_reader is None and worker.device == torch.device("cpu")
    sched, cache = config.scheduler_config, config.cache_config
    usable = sched.max_num_seqs * (-(-sched.max_model_len // cache.block_size) + 1)
    per_block = worker.model_runner.kv_cache_bytes_per_block()
    assert worker.determine_num_kv_blocks() == min(
        cache.DEFAULT_CPU_KV_CACHE_BYTES // per_block, usable
    )


def _sizing_rank(rank: int, model_dir: str, layout: dict, init_file: str, out_file: str) -> None:
    """One rank of a parallel world sizing its KV cache from a fake device; writes
    (tokens its model forward saw, its blocks, its bytes per block)."""
    from pagedllm.engine.arg_utils import EngineArgs

    torch.set_num_threads(1)
    args = EngineArgs(model=model_dir, dtype="float32", max_num_batched_tokens=48, max_num_seqs=5,
                      gpu_memory_utilization=0.9, device="cpu", **layout)  # fmt: skip
    worker = Worker(args.create_engine_config(), rank, rank, f"file://{init_file}",
                    memory_reader=FakeReader())  # fmt: skip
    worker.init_device()
    worker.load_model()
    seen: list[int] = []
    worker.model_runner.model.register_forward_hook(
        lambda m, args, out: seen.append(args[0].shape[0])
    )
    try:
        num_blocks = worker.determine_num_kv_blocks()
        torch.save((seen, num_blocks, worker.model_runner.kv_cache_bytes_per_block()), out_file)
        # Leave together: a stage that closed its connections while the other still read
        # the profile's activations failed it ("Connection closed by peer").
        torch.distributed.barrier()
    finally:
        worker.shutdown()


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_every_rank_profiles_together(tiny_llama_dir, tmp_path, layout):
    """With several ranks each profiles its own device in one collective forward: a later
    stage receives the earlier one's activations, and only the driver samples."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    outs = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    procs = [
        ctx.Process(
            target=_sizing_rank, args=(r, tiny_llama_dir, layout, str(tmp_path / "init"), outs[r])
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    kv_bytes = int(0.9 * 80 * GIB) - 3 * GIB - 512 * MIB  # no weights "allocated" here
    for out in outs:
        seen, num_blocks, per_block = torch.load(out)
        assert seen == [48]
        assert num_blocks == kv_bytes // per_block
