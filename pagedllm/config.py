"""Engine configuration: one `EngineConfig` built once from `EngineArgs`, handed down whole.

Each sub-config owns one concern and validates its own fields; values derived from the
checkpoint (dtype, max_model_len, EOS ids) are resolved here, once, so no layer below has to
re-read `config.json`.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
}


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively or close to it (oneDNN's bf16 path: AVX-512,
    AVX-NE-CONVERT or AMX). On an AVX2-only CPU PyTorch emulates bf16 GEMMs: 2-6x slower
    than fp32 (BENCHMARKS.md)."""
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def dtype_from_name(name: str) -> torch.dtype | None:
    """The torch dtype a name such as "bfloat16", "half" or "fp32" stands for, or None."""
    return _DTYPES.get(name)


# kv_cache_dtype values (vLLM's names) that keep the KV cache in fp8, scale 1.0: their dtype.
FP8_KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_dtype_str_to_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV-cache tensors for vLLM's `kv_cache_dtype` (vLLM's helper of
    the same name): "auto" or the model dtype's own name keeps the model's dtype; "fp8" /
    "fp8_e4m3" is float8_e4m3fn, "fp8_e5m2" float8_e5m2. Anything else (another 16/32-bit
    dtype, vLLM's fp8_inc or fp8_ds_mla) is a ValueError naming the value."""
    if kv_cache_dtype == "auto" or dtype_from_name(kv_cache_dtype) == model_dtype:
        return model_dtype
    if kv_cache_dtype in FP8_KV_CACHE_DTYPES:
        return FP8_KV_CACHE_DTYPES[kv_cache_dtype]
    model_name = str(model_dtype).removeprefix("torch.")
    accepted = ["auto", model_name, *FP8_KV_CACHE_DTYPES]
    raise ValueError(
        f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose one of {accepted} "
        f"('auto' and {model_name!r}: the model's dtype; fp8 is e4m3, scale 1.0)"
    )


def cpu_has_bf16_kernels() -> bool:
    """Whether pagedllm's own GEMMs run bf16 weights on this CPU where oneDNN would emulate
    them (AVX2 + FMA: `layers/cpu_gemm.py`); then bf16 decodes faster than fp32 (half the
    bytes to stream) and batches as fast (BENCHMARKS.md). Builds the native ops if needed."""
    from pagedllm.layers.cpu_gemm import bf16_panels_available

    return bf16_panels_available()


def resolve_dtype(
    dtype: str | torch.dtype, hf_dtype: Any, device: str, pagedllm_kernels: bool = True
) -> torch.dtype:
    """`auto` on the CPU is bf16 wherever bf16 has a fast GEMM, whatever the checkpoint's
    dtype: fp32 and fp16 checkpoints are cast to bf16 (pagedllm's CPU kernels take bf16 and
    fp32 only, and PyTorch's fp16 ops are many times slower: an fp16 SmolLM2 ran 64 requests
    at 61 against ~640 tok/s in bf16, BENCHMARKS.md). A CPU without fast bf16
    (`cpu_has_fast_bf16`) runs every checkpoint in bf16 on pagedllm's AVX2 kernels
    (`cpu_has_bf16_kernels`), else in fp32: there PyTorch's 16-bit GEMMs are emulated, several
    times slower than fp32's (`pagedllm_kernels=False`: for a model that runs on PyTorch's
    GEMMs, as transformers does). Elsewhere (CUDA) `auto` keeps a 16-bit checkpoint's dtype.
    An explicit dtype is always honoured."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(
                f"dtype={dtype!r} is not supported; choose one of "
                f"'auto', 'bfloat16', 'float16', 'float32'"
            )
        return _DTYPES[dtype]
    if device == "cpu" and not cpu_has_fast_bf16():
        if not (pagedllm_kernels and cpu_has_bf16_kernels()):
            logger.info("dtype=auto: float32, this CPU has no fast bfloat16 (AVX2 only)")
            return torch.float32
        logger.info("dtype=auto: bfloat16 on pagedllm's AVX2 GEMM (bf16 weights, fp32 sums)")
        return torch.bfloat16
    if isinstance(hf_dtype, str):
        hf_dtype = _DTYPES.get(hf_dtype.removeprefix("torch."), None)
    if device == "cpu":
        if hf_dtype == torch.float16:
            logger.info(
                "dtype=auto: bfloat16 for this float16 checkpoint (the CPU kernels take bf16; "
                "dtype='float16' keeps it, on PyTorch's slower fp16 ops)"
            )
        return torch.bfloat16
    if hf_dtype in (torch.bfloat16, torch.float16):
        return hf_dtype
    return hf_dtype or torch.float32


@dataclass
class ModelConfig:
    """The checkpoint and how to run it."""

    model: str
    tokenizer: str
    hf_config: Any  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    quantization: str | None = None  # weight quantization method (layers/quantization.py)
    seed: int = 0
    # The names the server accepts as `model`; the first is the one it reports.
    served_model_name: str | list[str] | None = None
    trust_remote_code: bool = False
    # How the tokenizer is loaded (transformers_utils/tokenizer.py: TOKENIZER_MODES).
    tokenizer_mode: str = "auto"
    # Most logprobs a request may ask for (logprobs / prompt_logprobs); -1: no limit.
    max_logprobs: int = 20
    # From generation_config.json: default EOS ids and sampling defaults.
    eos_token_ids: list[int] = field(default_factory=list)
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        hd = getattr(self.hf_config, "head_dim", None)
        return hd or self.hidden_size // self.num_attention_heads

    @property
    def served_model_names(self) -> list[str]:
        """Every name the model is served under (default: the model path)."""
        names = self.served_model_name
        if isinstance(names, str):
            return [names]
        return list(names) if names else [self.model]

    @property
    def name(self) -> str:
        return self.served_model_names[0]

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """SamplingParams defaults from generation_config.json (vLLM's name): temperature,
        top_p, top_k, min_p, repetition_penalty, max_tokens (its max_new_tokens), and
        temperature 0 where it says do_sample = false."""
        gen = self.generation_config
        names = {k: k for k in _GENERATION_SAMPLING_KEYS} | {"max_new_tokens": "max_tokens"}
        params = {ours: gen[key] for key, ours in names.items() if gen.get(key) is not None}
        if gen.get("do_sample") is False:
            params.setdefault("temperature", 0.0)
        return params


# generation_config.json keys that are SamplingParams fields of the same name.
_GENERATION_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class CacheConfig:
    """The paged KV cache. `num_blocks` is filled in once the worker has sized the cache."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # vLLM's kv_cache_dtype as given ("auto", the model dtype's name, "fp8", "fp8_e4m3",
    # "fp8_e5m2"); `EngineConfig.kv_cache_torch_dtype` is the tensors' dtype it resolves to.
    cache_dtype: str = "auto"
    # An fp8 cache's per-layer K/V scales from a calibration forward at start-up (vLLM's
    # calculate_kv_scales; worker/kv_scales.py); False: scale 1.0.
    calculate_kv_scales: bool = False
    kv_cache_memory_bytes: int | None = None  # bytes; None -> CPU default / GPU profiling
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    num_blocks: int | None = None

    DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 8 != 0 and self.block_size not in (1, 2, 4):
            raise ValueError(f"block_size={self.block_size} must be a positive multiple of 8")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be positive (bytes)"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(
                f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be positive"
            )


@dataclass
class SchedulerConfig:
    """Batch limits and policy."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: no per-request cap below the token budget
    policy: str = "fcfs"
    # A streamed request's outputs go out every this many tokens (its first and last always).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={self.policy!r} must be 'fcfs' or 'priority'")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len}; with chunked prefill disabled a whole "
                "prompt must fit in one step"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold={self.long_prefill_token_threshold} must be >= 0"
            )
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"stream_interval={self.stream_interval!r} must be an integer >= 1")


# load_format values (vLLM's names; models/loader.py reads them).
LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy")


@dataclass
class LoadConfig:
    """How the model's weights are read (vLLM's `--load-format`): "auto" (the checkpoint's
    *.safetensors, else its PyTorch *.bin / *.pt files), "safetensors" or "pt" (only those),
    "dummy" (no weight file is read: small random values seeded by `ModelConfig.seed`)."""

    load_format: str = "auto"

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"load_format={self.load_format!r} is not supported; choose one of "
                f"{list(LOAD_FORMATS)}"
            )


# distributed_executor_backend values (vLLM's): one process, worker processes on this machine,
# Ray actors on a Ray cluster.
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
PP_LAYER_PARTITION_ENV = "PAGEDLLM_PP_LAYER_PARTITION"


@dataclass
class ParallelConfig:
    """How the model is spread. Inside one engine core: `tensor_parallel_size` ranks per
    pipeline stage, `pipeline_parallel_size` stages, run by the `distributed_executor_backend`
    executor (None until `resolve_executor_backend` picks the default). Across engine cores:
    data parallelism (each engine a full copy of the model with its own KV cache).

    Data parallelism (vLLM's flags): `data_parallel_size` engines in all, of which
    `data_parallel_size_local` run on this node with ranks from `data_parallel_start_rank`.
    Engines on other nodes (`pagedllm serve --headless`) reach the head's front end at
    `data_parallel_address:data_parallel_rpc_port`. `data_parallel_rank` is filled in per
    engine."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    # Decoder layers per pipeline stage (None: an even split), from PAGEDLLM_PP_LAYER_PARTITION.
    pp_layer_partition: list[int] | None = None
    data_parallel_size_local: int | None = None  # None: all of data_parallel_size
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None  # None: 127.0.0.1
    data_parallel_rpc_port: int | None = None  # None: DEFAULT_DP_RPC_PORT (multi-node only)
    data_parallel_backend: str = "mp"
    # Not vLLM's: whether the death of one engine stops the front end (True) or the others
    # keep serving (False, default).
    data_parallel_stop_on_engine_death: bool = False
    # Filled in per engine.
    data_parallel_rank: int = 0
    data_parallel_rank_local: int = 0

    DEFAULT_DP_ADDRESS = "127.0.0.1"
    DEFAULT_DP_RPC_PORT = 29550  # vLLM's default

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend={backend!r} is not supported; choose one of "
                f"{list(EXECUTOR_BACKENDS)}"
            )
        if backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one process, but tensor_parallel_size="
                f"{self.tensor_parallel_size} x pipeline_parallel_size="
                f"{self.pipeline_parallel_size} needs {self.world_size}; use 'mp' or 'ray'"
            )
        dp = self.data_parallel_size
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = dp
        local, start = self.data_parallel_size_local, self.data_parallel_start_rank
        if not 0 <= local <= dp:
            raise ValueError(
                f"data_parallel_size_local={local} must be between 0 and data_parallel_size={dp}"
            )
        if start < 0 or start + local > dp:
            raise ValueError(
                f"data_parallel_start_rank={start} with data_parallel_size_local={local} "
                f"runs ranks {start}..{start + local - 1}, outside data_parallel_size={dp}"
            )
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(
                f"data_parallel_backend={self.data_parallel_backend!r} must be 'mp' or 'ray'"
            )
        port = self.data_parallel_rpc_port
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"data_parallel_rpc_port={port} must be in 1..65535")
        if self.data_parallel_address is None:
            self.data_parallel_address = self.DEFAULT_DP_ADDRESS

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def data_parallel_multi_node(self) -> bool:
        """Whether some engines run on another node (they then connect over TCP)."""
        return self.data_parallel_size_local < self.data_parallel_size

    @property
    def data_parallel_handshake_port(self) -> int:
        return self.data_parallel_rpc_port or self.DEFAULT_DP_RPC_PORT

    def resolve_executor_backend(self, device: str) -> str:
        """The backend, picking vLLM's default when none was given: 'uni' for one process,
        'ray' when a Ray cluster is in use (RAY_ADDRESS set, or Ray already initialised in
        this process) or the world needs more GPUs than this machine has, else 'mp'."""
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = _default_backend(self.world_size, device)
        return self.distributed_executor_backend

    def verify_with_model(self, model_config: ModelConfig) -> None:
        """Check that the model splits as asked (before any worker starts): heads and MLP over
        the tensor-parallel ranks, layers over the stages."""
        from pagedllm.models.pipeline import pp_partition

        tp = self.tensor_parallel_size
        hf = model_config.hf_config
        kv = model_config.num_kv_heads
        checks = [
            ("num_attention_heads", model_config.num_attention_heads),
            ("intermediate_size", getattr(hf, "intermediate_size", tp)),
        ]
        for what, value in checks:
            if value % tp:
                raise ValueError(
                    f"the model's {what}={value} is not divisible by tensor_parallel_size={tp}"
                )
        if kv % tp and tp % kv:
            raise ValueError(
                f"the model's num_key_value_heads={kv} and tensor_parallel_size={tp} must "
                "divide one another (KV heads are split, or replicated over the ranks)"
            )
        pp_partition(model_config.num_layers, self.pipeline_parallel_size, self.pp_layer_partition)


def _default_backend(world_size: int, device: str) -> str:
    if world_size == 1:
        return "uni"
    ray = sys.modules.get("ray")  # never imported here: Ray is optional
    if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return "ray"
    if device == "cuda" and world_size > torch.cuda.device_count():
        return "ray"
    return "mp"


def parse_pp_layer_partition(text: str | None) -> list[int] | None:
    """PAGEDLLM_PP_LAYER_PARTITION ("5,7": layers of stage 0, stage 1, ...) -> counts."""
    if not text:
        return None
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{PP_LAYER_PARTITION_ENV}={text!r} must be comma-separated layer counts, e.g. '5,7'"
        ) from None


@dataclass
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r} must be 'auto', 'cpu' or 'cuda'")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was requested but no CUDA device is available")

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class KVTransferConfig:
    """Where KV blocks go beyond this engine (vLLM's `--kv-transfer-config`): the connector
    named `kv_connector` (see `pagedllm.distributed.kv_transfer.factory`), this engine's role,
    and the connector's own options in `kv_connector_extra_config`.

    `kv_role`: kv_producer (saves / serves KV), kv_consumer (loads KV), kv_both. `engine_id`
    names this engine to its peers (a fresh uuid by default, so a restarted peer is never
    mistaken for the old one). `kv_ip` / `kv_port` is where a network connector listens
    (port 0: a free one). `kv_connector_module_path` imports `kv_connector` from that module
    instead of the built-in ones. `kv_load_failure_policy`: what a failed load does;
    "recompute" (the only policy) computes the missing tokens locally.
    """

    kv_connector: str | None = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_connector_module_path: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if not self.kv_connector or not isinstance(self.kv_connector, str):
            raise ValueError(
                f"kv_transfer_config.kv_connector={self.kv_connector!r} must name a connector"
            )
        if self.kv_role not in KV_ROLES:
            raise ValueError(
                f"kv_transfer_config.kv_role={self.kv_role!r} must be one of {list(KV_ROLES)}"
            )
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError(
                "kv_transfer_config.kv_connector_extra_config must be a JSON object, got "
                f"{self.kv_connector_extra_config!r}"
            )
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port={self.kv_port!r} must be in 0..65535")
        if self.kv_load_failure_policy != "recompute":
            raise ValueError(
                f"kv_transfer_config.kv_load_failure_policy={self.kv_load_failure_policy!r} "
                "is not supported; only 'recompute' (compute the missing tokens locally) is"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> KVTransferConfig:
        """Build from vLLM's JSON shape; an unknown key is a ValueError naming it."""
        if not isinstance(values, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {values!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"kv_transfer_config has unknown key(s) {unknown}; valid keys are {sorted(known)}"
            )
        return cls(**{k: v for k, v in values.items() if v is not None or k == "kv_connector"})

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


@dataclass
class CompilationConfig:
    """vLLM's `compilation_config` (`--compilation-config '{"level": 3}'`).

    `level` ("mode" in recent vLLM): 0 eager, 3 piecewise torch.compile of the model
    (compilation/compile.py) with Inductor (`backend`) and its cache under `cache_dir`.
    `cudagraph_capture_sizes`: the decode batch sizes captured in CUDA graphs
    (worker/cuda_graph.py); None: vLLM's default list (1, 2, 4, 8, 16, ... 256, 272, ...)
    up to `max_cudagraph_capture_size` (512), cut at the first size holding max_num_seqs.
    """

    level: int = 0
    backend: str = "inductor"
    cache_dir: str | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None

    LEVELS = (0, 3)

    def __post_init__(self) -> None:
        if self.level not in self.LEVELS:
            raise ValueError(
                f"compilation_config level={self.level!r} is not supported; use 0 (eager) "
                "or 3 (piecewise torch.compile)"
            )
        if self.level == 0 and (self.cache_dir is not None or self.backend != "inductor"):
            raise ValueError(
                "compilation_config backend / cache_dir apply to level 3 only (level is 0)"
            )
        sizes = self.cudagraph_capture_sizes
        if sizes is not None and (
            not isinstance(sizes, list) or not all(isinstance(s, int) and s > 0 for s in sizes)
        ):
            raise ValueError(f"cudagraph_capture_sizes={sizes!r} must be a list of positive ints")
        size = self.max_cudagraph_capture_size
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(f"max_cudagraph_capture_size={size!r} must be a positive int")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | int | None) -> CompilationConfig:
        """From `--compilation-config` JSON (a bare int is the level); `mode` is read as
        `level`; an unknown key is a ValueError naming it."""
        if isinstance(values, int):
            values = {"level": values}
        values = dict(values or {})
        if "mode" in values:
            if "level" in values and values["level"] != values["mode"]:
                raise ValueError(f"compilation_config: mode and level differ: {values}")
            values["level"] = values.pop("mode")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"compilation_config: unknown key(s) {unknown}; supported: {sorted(known)}"
            )
        return cls(**values)


@dataclass
class StructuredOutputsConfig:
    """Structured outputs in the engine core (vLLM's `--structured-outputs-config`). With a
    `reasoning_parser` (vLLM's `--reasoning-parser`), a request's grammar applies only after
    its reasoning ends, unless `enable_in_reasoning`. `backend`: "auto" or "xgrammar" (the
    one pagedllm has); `disable_any_whitespace`: every JSON constraint compact."""

    reasoning_parser: str | None = None
    backend: str = "auto"
    disable_any_whitespace: bool = False
    enable_in_reasoning: bool = False

    @classmethod
    def from_dict(
        cls, values: dict[str, Any] | None, reasoning_parser: str | None = None
    ) -> StructuredOutputsConfig:
        """From vLLM's JSON (its keys; the ones asking for what pagedllm lacks are a
        ValueError naming them) and `--reasoning-parser`."""
        values = dict(values or {})
        given = values.pop("reasoning_parser", None) or None
        if given and reasoning_parser and given != reasoning_parser:
            raise ValueError(
                f"structured_outputs_config.reasoning_parser={given!r} contradicts "
                f"reasoning_parser={reasoning_parser!r}"
            )
        backend = values.pop("backend", "auto")
        if backend not in ("auto", "xgrammar"):
            raise ValueError(
                f"structured_outputs_config.backend={backend!r} is not supported: pagedllm's "
                "structured outputs run on xgrammar ('auto' or 'xgrammar')"
            )
        for name in ("disable_additional_properties", "reasoning_parser_plugin"):
            if values.pop(name, None):
                raise ValueError(f"structured_outputs_config.{name} is not supported by pagedllm")
        flags = {}
        for name in ("disable_any_whitespace", "enable_in_reasoning"):
            value = values.pop(name, False)
            if not isinstance(value, bool):
                raise ValueError(f"structured_outputs_config.{name}={value!r} must be a boolean")
            flags[name] = value
        if values:
            raise ValueError(f"unknown structured_outputs_config keys: {sorted(values)}")
        return cls(given or reasoning_parser, backend, **flags)


@dataclass
class EngineConfig:
    """Everything the engine needs, built once by `EngineArgs.create_engine_config()`."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig
    load_config: LoadConfig = field(default_factory=LoadConfig)
    enforce_eager: bool = False
    attention_backend: str | None = None  # None: the device's default (attention/selector.py)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig
    )
    kv_transfer_config: KVTransferConfig | None = None
    # Bitwise-identical outputs whatever the batch (layers/batch_invariant.py).
    batch_invariant: bool = False
    # No finished step for this long while requests wait or run: the engine is stalled
    # (engine/stall.py); 0 turns the watchdog off.
    stall_timeout_s: float = 60.0
    # Later features hang their own sub-config here (speculative, structured outputs, kv transfer).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The dtype of the KV-cache tensors: what sizes, allocates, moves and hashes blocks
        (the model's dtype unless `cache_config.cache_dtype` asks for fp8)."""
        return kv_cache_dtype_str_to_dtype(self.cache_config.cache_dtype, self.model_config.dtype)


def env_flag(name: str, default: bool = False) -> bool:
    val = os.environ.get(name)
    if val is None:
        return default
    return val.strip().lower() in ("1", "true", "yes", "on")
