"""Captured mode without CUDA: capture sizes, the eager-fallback decision, padding and
in-place buffer reuse, and the engine replaying "graphs" (the forward re-run on the
persistent buffers, which is all a CUDA graph's replay can see) with unchanged greedy output.
The real capture/replay identity runs on a GPU (marked `gpu`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.config import CompilationConfig, ParallelConfig
from pagedllm.ops.triton import triton_usable
from pagedllm.worker import model_runner
from pagedllm.worker.cuda_graph import (
    CUDAGraphRunner,
    capture_sizes,
    default_capture_sizes,
    use_cuda_graphs,
)


class EagerReplayRunner(CUDAGraphRunner):
    """Replays by running the forward again over the persistent buffers and the metadata
    built at capture: like a CUDA graph, a replay sees only what `prepare` wrote in place."""

    def _record(self, inputs, meta):
        out = self.forward(inputs, meta).clone()

        def replay():
            out.copy_(self.forward(inputs, meta))

        return replay, out


class CapturableBackend:
    name = "FAKE"
    supports_cuda_graph = True

    def build_metadata(self, common):
        return common


def test_default_sizes_are_vllms_capped_by_max_num_seqs():
    sizes = default_capture_sizes(512)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-3:] == [480, 496, 512]
    assert 248 in sizes and 256 in sizes and 264 not in sizes and 272 in sizes
    assert default_capture_sizes(100)[-2:] == [96, 104]  # the first size holding 100
    assert default_capture_sizes(3) == [1, 2, 4]
    assert default_capture_sizes(1000, max_size=16) == [1, 2, 4, 8, 16]


def test_capture_sizes_from_compilation_config(make_engine_config, tiny_llama_dir):
    config = make_engine_config(tiny_llama_dir)  # max_num_seqs=8
    assert capture_sizes(config) == [1, 2, 4, 8]
    config.compilation_config = CompilationConfig(cudagraph_capture_sizes=[8, 3, 3, 1])
    assert capture_sizes(config) == [1, 3, 8]
    config.compilation_config = CompilationConfig(max_cudagraph_capture_size=2)
    assert capture_sizes(config) == [1, 2]
    with pytest.raises(ValueError, match="cudagraph_capture_sizes"):
        CompilationConfig(cudagraph_capture_sizes=[0, 4])


def test_captured_mode_only_on_cuda_without_enforce_eager(make_engine_config, tiny_llama_dir):
    config = make_engine_config(tiny_llama_dir)
    cuda = torch.device("cuda", 0)
    assert use_cuda_graphs(config, cuda, CapturableBackend())
    assert not use_cuda_graphs(config, torch.device("cpu"), CapturableBackend())
    assert not use_cuda_graphs(config, cuda, TorchAttentionBackend())  # not capturable
    config.compilation_config = CompilationConfig(cudagraph_capture_sizes=[])
    assert not use_cuda_graphs(config, cuda, CapturableBackend())
    config.compilation_config = CompilationConfig()
    config.kv_transfer_config = object()  # a KV connector's hooks run per layer in Python
    assert not use_cuda_graphs(config, cuda, CapturableBackend())
    config.kv_transfer_config = None
    config.parallel_config = ParallelConfig(tensor_parallel_size=2)  # collectives between ranks
    assert not use_cuda_graphs(config, cuda, CapturableBackend())
    config.parallel_config = ParallelConfig()
    config.enforce_eager = True
    assert not use_cuda_graphs(config, cuda, CapturableBackend())


def _runner(sizes=(1, 2, 4, 8)):
    def forward(inputs, meta):
        # Per-row output built from every buffer the attention reads, so a test sees them.
        qsl = meta.query_start_loc
        rows = inputs["input_ids"] * 1000 + inputs["positions"]
        return torch.stack([rows, meta.seq_lens.long(), qsl[1:].long() - qsl[:-1].long()], 1)

    runner = EagerReplayRunner(
        forward,
        CapturableBackend(),
        list(sizes),
        {"input_ids": (torch.int64, ()), "positions": (torch.int64, ())},
        max_blocks_per_req=6,
        block_size=16,
        device=torch.device("cpu"),
    )
    runner.capture()
    return runner


def _decode_batch(seq_lens, block_size=16):
    n = len(seq_lens)
    table = np.arange(n * 5, dtype=np.int32).reshape(n, 5)
    common, positions = CommonAttentionMetadata.for_spans(
        table, np.array(seq_lens) - 1, np.ones(n, dtype=np.int64), block_size, torch.device("cpu")
    )
    return common, torch.arange(n) + 7, torch.from_numpy(positions)


def test_batches_pad_up_to_the_next_size_or_run_eagerly():
    runner = _runner()
    assert [runner.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    common, _, _ = _decode_batch([5, 17, 40])
    assert runner.size_for(common) == 4
    assert runner.size_for(_decode_batch([3] * 9)[0]) is None  # above the largest size
    mixed, _ = CommonAttentionMetadata.for_spans(
        np.zeros((2, 3), dtype=np.int32), np.array([0, 9]), np.array([5, 1]), 16, "cpu"
    )
    assert runner.size_for(mixed) is None  # a prefill chunk: eager


def test_replay_reads_the_batch_copied_in_place_with_padding():
    runner = _runner()
    buffers = [t.data_ptr() for t in (*runner.inputs.values(), runner.block_table)]
    for seq_lens in ([5, 17, 40], [9], [33, 2, 4, 70, 6]):
        common, input_ids, positions = _decode_batch(seq_lens)
        size = runner.size_for(common)
        out = runner.run(size, {"input_ids": input_ids, "positions": positions}, common)
        n = len(seq_lens)
        assert out.shape[0] == n
        assert out[:, 0].tolist() == (input_ids * 1000 + positions).tolist()
        assert out[:, 1].tolist() == seq_lens and out[:, 2].tolist() == [1] * n
        # Padding requests: no query row, empty context, slot -1 (K/V writes skipped).
        assert runner.query_start_loc[n : size + 1].tolist() == [n] * (size + 1 - n)
        assert runner.seq_lens[n:size].tolist() == [0] * (size - n)
        assert runner.slot_mapping[n:size].tolist() == [-1] * (size - n)
        assert torch.equal(runner.slot_mapping[:n], common.slot_mapping)
        assert torch.equal(runner.block_table[:n, :5], common.block_table)
    assert [t.data_ptr() for t in (*runner.inputs.values(), runner.block_table)] == buffers
    assert runner.num_replays == 3


def _captured_vs_eager(model_dir, monkeypatch, eager_kwargs, **kwargs):
    """Greedy tokens of an eager engine and of a captured-mode one on the same prompts (a
    decode batch of 3 pads to 4); returns them and the captured engine's graph runner."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    prompts = [{"prompt_token_ids": p} for p in ([7, 8, 9, 10, 11], list(range(40, 59)), [60])]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kwargs.update(
        model=model_dir,
        dtype="float32",
        num_gpu_blocks_override=16,
        max_model_len=64,
        max_num_seqs=4,
    )
    eager = LLM(**eager_kwargs, **kwargs).generate(prompts, params)
    llm = LLM(**kwargs)
    graphs = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.cuda_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4]
    captured = llm.generate(prompts, params)
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in (eager, captured)]
    return tokens, graphs


def test_engine_replays_decode_batches_with_unchanged_output(tiny_llama_dir, monkeypatch):
    """The engine in captured mode (TRITON_ATTN in the interpreter, replays re-running the
    forward over the persistent buffers) emits the eager engine's greedy tokens."""
    if not triton_usable("cpu"):
        pytest.skip("Triton's interpreter is off (TRITON_INTERPRET)")
    # Captured mode on the CPU, for every engine not built with enforce_eager.
    monkeypatch.setattr(
        model_runner, "use_cuda_graphs", lambda config, *a: not config.enforce_eager
    )
    monkeypatch.setattr(model_runner, "CUDAGraphRunner", EagerReplayRunner)
    (eager, captured), graphs = _captured_vs_eager(
        tiny_llama_dir, monkeypatch, {"enforce_eager": True}, attention_backend="TRITON_ATTN"
    )
    assert captured == eager
    assert graphs.num_replays >= 4  # every decode step of the three requests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager_forward(tiny_llama_dir, monkeypatch):
    """On a GPU: the engine with real CUDA graphs emits the --enforce-eager engine's tokens,
    and replays happened."""
    (eager, captured), graphs = _captured_vs_eager(
        tiny_llama_dir, monkeypatch, {"enforce_eager": True}, device="cuda"
    )
    assert captured == eager
    assert graphs.num_replays >= 4
