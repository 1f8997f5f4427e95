"""ParallelConfig: the executor backend acts or is a clear error, vLLM's default choice, and
the model is checked to split as asked before any worker starts."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.config import ParallelConfig, parse_pp_layer_partition
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc_executor import MultiProcExecutor
from pagedllm.executor.uniproc_executor import UniProcExecutor


def test_unknown_backend_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="distributed_executor_backend='threads'"):
        ParallelConfig(distributed_executor_backend="threads")


def test_uni_backend_cannot_run_several_ranks():
    with pytest.raises(ValueError, match="'uni' runs one process"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize(
    "kwargs, env, expected",
    [
        ({}, {}, "uni"),
        ({"tensor_parallel_size": 2}, {}, "mp"),
        ({"pipeline_parallel_size": 2}, {"RAY_ADDRESS": "127.0.0.1:6379"}, "ray"),
        ({"tensor_parallel_size": 2, "distributed_executor_backend": "ray"}, {}, "ray"),
        ({"distributed_executor_backend": "mp"}, {}, "mp"),  # one worker process
    ],
)
def test_default_backend(kwargs, env, expected, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert ParallelConfig(**kwargs).resolve_executor_backend("cpu") == expected


def test_backend_picks_the_executor(tiny_llama_dir):
    def cls(**kw):
        return Executor.get_class(EngineArgs(model=tiny_llama_dir, **kw).create_engine_config())

    assert cls() is UniProcExecutor
    assert cls(tensor_parallel_size=2) is MultiProcExecutor
    assert cls(distributed_executor_backend="mp") is MultiProcExecutor


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({"tensor_parallel_size": 3}, None, "num_attention_heads=4 is not divisible"),
        ({"tensor_parallel_size": 8}, None, "num_attention_heads=4"),
        ({"pipeline_parallel_size": 3}, None, "larger than the model's num_hidden_layers=2"),
        ({"pipeline_parallel_size": 2}, "2,1", "PAGEDLLM_PP_LAYER_PARTITION=2,1 must give"),
        ({}, "1,1", "pipeline_parallel_size=1"),  # a partition that would be ignored
        ({"pipeline_parallel_size": 2}, "one,two", "comma-separated layer counts"),
    ],
)
def test_model_must_split_as_asked(tiny_llama_dir, kwargs, env, match, monkeypatch):
    if env is not None:
        monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", env)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=tiny_llama_dir, **kwargs).create_engine_config()


def test_layer_partition_reaches_the_config(tiny_llama_dir, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PP_LAYER_PARTITION", "1,1")
    config = EngineArgs(model=tiny_llama_dir, pipeline_parallel_size=2).create_engine_config()
    assert config.parallel_config.pp_layer_partition == [1, 1]
    assert parse_pp_layer_partition("") is None


def test_cli_flags_and_short_forms():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["-tp", "2", "-pp", "3", "--distributed-executor-backend", "ray"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.tensor_parallel_size, engine_args.pipeline_parallel_size) == (2, 3)
    assert engine_args.distributed_executor_backend == "ray"


_CONNECTOR = {
    "kv_connector": "SharedStorageConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/nonexistent/kv"},
}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kv_transfer_config": _CONNECTOR}, "kv_transfer_config cannot be combined"),
        ({"compilation_config": {"level": 3}}, "level=3 cannot be combined"),
    ],
)
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_features_that_need_one_rank_are_refused(tiny_llama_dir, kwargs, layout, match):
    """A KV connector moves one rank's whole KV cache and torch.compile does not trace the
    collectives: with several ranks each is a clear error, not a wrong result."""
    args = EngineArgs(model=tiny_llama_dir, dtype="float32", **layout, **kwargs)
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()
    args.tensor_parallel_size = args.pipeline_parallel_size = 1
    assert args.create_engine_config().parallel_config.world_size == 1  # alone it is fine


def test_auto_dtype_follows_the_cpu(monkeypatch):
    """`auto` on the CPU: bf16 where it is fast (a bf16 checkpoint keeps it, an fp32 or fp16
    one gets it), natively or on pagedllm's AVX2 kernels, fp32 for every checkpoint where bf16
    would be emulated; an explicit dtype always wins; CUDA keeps a 16-bit checkpoint's."""
    import torch

    from pagedllm import config

    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: True)
    assert config.resolve_dtype("auto", "bfloat16", "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", "float16", "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", None, "cpu") == torch.bfloat16
    assert config.resolve_dtype("float16", "float16", "cpu") == torch.float16
    monkeypatch.setattr(config, "cpu_has_fast_bf16", lambda: False)
    monkeypatch.setattr(config, "cpu_has_bf16_kernels", lambda: True)  # AVX2: pagedllm's GEMM
    assert config.resolve_dtype("auto", torch.float32, "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", torch.float16, "cpu") == torch.bfloat16
    # transformers' GEMMs (the hf benchmark backend): emulated bf16, so fp32
    assert config.resolve_dtype("auto", "bfloat16", "cpu", pagedllm_kernels=False) == torch.float32
    monkeypatch.setattr(config, "cpu_has_bf16_kernels", lambda: False)
    assert config.resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert config.resolve_dtype("auto", torch.float16, "cpu") == torch.float32
    assert config.resolve_dtype("bfloat16", "bfloat16", "cpu") == torch.bfloat16
    assert config.resolve_dtype("auto", "bfloat16", "cuda") == torch.bfloat16
    assert config.resolve_dtype("auto", torch.float16, "cuda") == torch.float16
    assert config.resolve_dtype("auto", torch.float32, "cuda") == torch.float32


def test_an_fp16_checkpoint_runs_in_bf16_on_a_cpu_with_fast_bf16(tmp_path):
    """A checkpoint saved in float16 (its config says so) runs in bf16 under `auto` on the CPU
    wherever bf16 is fast; `dtype="float16"` keeps it."""
    import torch

    from pagedllm import config
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.testing import make_demo_model

    if not (config.cpu_has_fast_bf16() or config.cpu_has_bf16_kernels()):
        pytest.skip("bf16 is emulated on this CPU: auto picks fp32")
    model = make_demo_model(tmp_path / "fp16", preset="tiny", dtype="float16")
    engine_config = EngineArgs(model=model, device="cpu").create_engine_config()
    assert engine_config.model_config.dtype == torch.bfloat16
    kept = EngineArgs(model=model, device="cpu", dtype="float16").create_engine_config()
    assert kept.model_config.dtype == torch.float16


def test_structured_outputs_config_takes_vllms_keys_and_refuses_the_rest():
    from pagedllm.config import StructuredOutputsConfig

    config = StructuredOutputsConfig.from_dict(
        {"backend": "xgrammar", "disable_any_whitespace": True, "enable_in_reasoning": True},
        "qwen3",
    )
    assert (config.backend, config.disable_any_whitespace, config.enable_in_reasoning) == (
        "xgrammar", True, True,
    )  # fmt: skip
    assert config.reasoning_parser == "qwen3"
    assert StructuredOutputsConfig.from_dict({"reasoning_parser": "qwen3"}).reasoning_parser == (
        "qwen3"
    )
    for values, message in [
        ({"backend": "guidance"}, "backend='guidance' is not supported"),
        ({"disable_additional_properties": True}, "disable_additional_properties"),
        ({"disable_any_whitespace": "yes"}, "must be a boolean"),
        ({"bogus": 1}, "unknown structured_outputs_config keys: \\['bogus'\\]"),
        ({"reasoning_parser": "deepseek_r1"}, "contradicts reasoning_parser='qwen3'"),
    ]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputsConfig.from_dict(values, "qwen3")
