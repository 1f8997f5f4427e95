"""Piecewise torch.compile: attention stays out of the graphs, one compiled code serves every
decoder block, greedy output is unchanged, and Inductor's cache goes where the config says.
(Dynamo's "eager" backend here: the wiring is the same as Inductor's, without minutes of C++
compilation on a CPU.)"""

from __future__ import annotations

import os

import pytest
import torch
from torch._dynamo.utils import counters

from pagedllm.compilation.compile import compile_model, configure_compile_cache, decoder_blocks
from pagedllm.config import CompilationConfig
from pagedllm.testing import make_demo_model
from pagedllm.testing.demo_model import TINY_ARCH_OVERRIDES


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_compiled_engine_keeps_greedy_output(quantization, tmp_path, monkeypatch, dynamo_reset):
    """fp32, and int8 weights in an fp32 model (the native GEMMs are opaque calls with fakes)."""
    from pagedllm import LLM, SamplingParams

    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    model_dir = make_demo_model(
        tmp_path / "m", preset="tiny", seed=0, **TINY_ARCH_OVERRIDES["llama"], num_hidden_layers=4
    )
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41)), [3]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    kwargs = dict(
        model=model_dir,
        dtype="float32",
        num_gpu_blocks_override=32,
        max_model_len=64,
        quantization=quantization,
    )
    eager = LLM(**kwargs).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = LLM(
        compilation_config={"level": 3, "backend": "eager", "cache_dir": str(tmp_path / "c")},
        **kwargs,
    )
    model = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    assert len(decoder_blocks(model)) == 4
    compiled = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    graphs = counters["stats"]["unique_graphs"]
    # A few pieces (first block, later blocks; before / after attention; a batch of one
    # token), the same with 4 blocks as with 2: no compile per layer.
    assert 0 < graphs <= 8, graphs
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "c" / "inductor")


def test_inductor_compiles_oneDNN_packed_fp32_layers(tmp_path, monkeypatch, dynamo_reset):
    """With Inductor itself (not the eager backend): fp32 weights prepacked for oneDNN are
    buffers, which Inductor's lowering of mkldnn._linear_pointwise refused (an engine that
    died on its first step); they go through one opaque op, and the output is eager's."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers.cpu_gemm import can_pack

    if not can_pack(torch.zeros(8, 8)):
        pytest.skip("no oneDNN weight packing here")
    monkeypatch.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    model_dir = make_demo_model(
        tmp_path / "m", preset="tiny", seed=1, **TINY_ARCH_OVERRIDES["llama"], num_hidden_layers=2
    )
    prompts = [[5, 6, 7, 8, 9], list(range(20, 41))]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    kwargs = dict(model=model_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=64)
    eager = LLM(**kwargs).generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = LLM(compilation_config={"level": 3, "cache_dir": str(tmp_path / "c")}, **kwargs)
    layer = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.model
    assert "onednn" in {getattr(m, "cpu_gemm", None) for m in layer.modules()}
    compiled = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]


def test_level_0_leaves_the_model_alone(tiny_llama_dir, make_engine_config):
    from pagedllm.models.loader import get_model

    model = get_model(make_engine_config(tiny_llama_dir))
    compile_model(model, CompilationConfig())
    assert all(getattr(b, "_compiled_call_impl", None) is None for b in decoder_blocks(model))


def test_native_cpu_kernels_are_not_compiled(tiny_llama_dir, make_engine_config, monkeypatch):
    from pagedllm.compilation import compile as compile_module
    from pagedllm.models.loader import get_model

    monkeypatch.setattr(compile_module, "cpu_ops", lambda: object())  # native ops available
    model = get_model(make_engine_config(tiny_llama_dir, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="level=3.*PAGEDLLM_CPU_KERNELS=0"):
        compile_model(model, CompilationConfig(level=3, backend="eager"))


def test_cache_dir_default_and_environment(monkeypatch, tmp_path):
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    expected = str(tmp_path / "pagedllm" / "torch_compile" / "inductor")
    assert configure_compile_cache(CompilationConfig(level=3)) == expected
    assert cache_dir() == expected and inductor_config.fx_graph_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert configure_compile_cache(CompilationConfig(level=3)) == str(tmp_path / "mine")


def test_compilation_config_errors_name_the_value():
    assert CompilationConfig.from_dict(3).level == 3
    assert CompilationConfig.from_dict({"mode": 3}).level == 3
    with pytest.raises(ValueError, match="level=1"):
        CompilationConfig.from_dict({"level": 1})
    with pytest.raises(ValueError, match="level 3 only"):
        CompilationConfig.from_dict({"cache_dir": "/tmp/x"})
    with pytest.raises(ValueError, match="unknown key.*'splitting_ops'"):
        CompilationConfig.from_dict({"splitting_ops": []})
