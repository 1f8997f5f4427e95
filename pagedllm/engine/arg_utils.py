"""`EngineArgs`: the flat, user-facing engine arguments (vLLM's names) and their CLI flags.

`create_engine_config()` validates everything once and builds the nested `EngineConfig` that
is handed down whole to every layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from pagedllm.config import (
    FP8_KV_CACHE_DTYPES,
    PP_LAYER_PARTITION_ENV,
    CacheConfig,
    CompilationConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoadConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    env_flag,
    kv_cache_dtype_str_to_dtype,
    parse_pp_layer_partition,
    resolve_dtype,
)
from pagedllm.layers.batch_invariant import BATCH_INVARIANT_ENV

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
DEFAULT_MAX_NUM_SEQS = 256


@dataclass
class EngineArgs:
    """Arguments of `LLM(...)`, `LLMEngine` and `pagedllm serve` (flags: `--max-num-seqs` ...)."""

    model: str = ""
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"
    served_model_name: str | list[str] | None = None
    trust_remote_code: bool = False
    hf_overrides: dict[str, Any] | Callable[[Any], Any] | None = None
    load_format: str = "auto"
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    max_logprobs: int = 20
    dtype: str = "auto"
    quantization: str | None = None
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    long_prefill_token_threshold: int = 0
    stream_interval: int = 1
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    scheduling_policy: str = "fcfs"
    device: str = "auto"
    enforce_eager: bool = False
    attention_backend: str | None = None
    compilation_config: dict[str, Any] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"
    data_parallel_stop_on_engine_death: bool = False
    distributed_executor_backend: str | None = None
    speculative_config: dict[str, Any] | None = None
    reasoning_parser: str | None = None
    structured_outputs_config: dict[str, Any] | None = None
    kv_transfer_config: dict[str, Any] | None = None
    disable_log_stats: bool = False
    # Bitwise-identical outputs whatever the batch; also $PAGEDLLM_BATCH_INVARIANT=1.
    batch_invariant: bool = False
    stall_timeout_s: float = 60.0
    # The old name of kv_cache_memory_bytes, still accepted (see ALIASES).
    kv_cache_memory: dataclasses.InitVar[int | None] = None

    def __post_init__(self, kv_cache_memory: int | None) -> None:
        if kv_cache_memory is not None:
            if self.kv_cache_memory_bytes is not None:
                raise ValueError(
                    "kv_cache_memory and kv_cache_memory_bytes are the same argument; pass one"
                )
            self.kv_cache_memory_bytes = kv_cache_memory

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments (vLLM's names, or an alias in `ALIASES`); an unknown
        keyword is a ValueError naming it."""
        known = {f.name for f in fields(cls)} | set(ALIASES)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; valid arguments are {sorted(known)}"
            )
        return cls(**kwargs)

    def create_engine_config(self) -> EngineConfig:
        # Imported here: loading transformers is slow and only needed when an engine is built.
        from pagedllm.layers.quantization import check_quantization
        from pagedllm.transformers_utils.config import (
            get_eos_token_ids,
            get_generation_config,
            get_hf_config,
        )
        from pagedllm.transformers_utils.tokenizer import check_tokenizer_mode

        if not self.model:
            raise ValueError("model must be a local checkpoint directory, got an empty value")
        device_config = DeviceConfig(self.device)
        load_config = LoadConfig(self.load_format)
        check_tokenizer_mode(self.tokenizer_mode)
        model_dir, tokenizer = _checkpoint_dirs(self.model, self.tokenizer)
        hf_config = get_hf_config(
            model_dir,
            trust_remote_code=self.trust_remote_code,
            hf_overrides=_check_hf_overrides(self.hf_overrides),
        )
        _check_unquantized(self.model, hf_config)
        max_model_len = self._resolve_max_model_len(hf_config)
        generation_config = self._generation_config(get_generation_config, model_dir)
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs={self.max_logprobs} must be -1 (no limit) or >= 0")
        model_config = ModelConfig(
            model=model_dir,
            tokenizer=tokenizer,
            hf_config=hf_config,
            dtype=resolve_dtype(
                self.dtype,
                getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None),
                device_config.device,
            ),
            max_model_len=max_model_len,
            quantization=check_quantization(self.quantization),
            seed=self.seed,
            # A GGUF file is served under the path given, not its cached directory's.
            served_model_name=self.served_model_name
            or (None if model_dir == self.model else self.model),
            trust_remote_code=self.trust_remote_code,
            tokenizer_mode=self.tokenizer_mode,
            max_logprobs=self.max_logprobs,
            eos_token_ids=get_eos_token_ids(
                model_dir, hf_config, generation_config, tokenizer_mode=self.tokenizer_mode
            ),
            generation_config=generation_config,
        )
        # A kv_cache_dtype it cannot take is a ValueError naming it, before anything starts.
        kv_cache_dtype_str_to_dtype(self.kv_cache_dtype, model_config.dtype)
        if self.calculate_kv_scales and self.kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
            raise ValueError(
                "calculate_kv_scales=True scales an fp8 KV cache: it needs kv_cache_dtype "
                f"{sorted(FP8_KV_CACHE_DTYPES)}, got kv_cache_dtype={self.kv_cache_dtype!r}"
            )
        max_num_batched_tokens = self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        scheduler_config = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            stream_interval=self.stream_interval,
            policy=self.scheduling_policy,
        )
        cache_config = CacheConfig(
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            calculate_kv_scales=self.calculate_kv_scales,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
        )
        parallel_config = ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            data_parallel_size_local=self.data_parallel_size_local,
            data_parallel_start_rank=self.data_parallel_start_rank,
            data_parallel_address=self.data_parallel_address,
            data_parallel_rpc_port=self.data_parallel_rpc_port,
            data_parallel_backend=self.data_parallel_backend,
            data_parallel_stop_on_engine_death=self.data_parallel_stop_on_engine_death,
            distributed_executor_backend=self.distributed_executor_backend,
            pp_layer_partition=parse_pp_layer_partition(os.environ.get(PP_LAYER_PARTITION_ENV)),
        )
        parallel_config.verify_with_model(model_config)
        parallel_config.resolve_executor_backend(device_config.device)
        extra: dict[str, Any] = {}
        if self.speculative_config:
            from pagedllm.spec_decode.config import SpeculativeConfig

            extra["speculative_config"] = SpeculativeConfig.from_dict(
                self.speculative_config, model_config
            )
            _check_load_format_compatible(load_config, extra["speculative_config"])
            method = extra["speculative_config"].method
            if self.calculate_kv_scales and method in ("draft_model", "eagle"):
                raise ValueError(
                    f"calculate_kv_scales=True calibrates the target model's attention layers; "
                    f"speculative_config method {method!r} keeps a KV cache of its own, which "
                    "it does not calibrate: use one of them, or n-gram / Medusa speculation"
                )
        if self.attention_backend is not None:
            from pagedllm.attention.selector import check_attention_backend_name

            check_attention_backend_name(self.attention_backend)
        structured_outputs_config = StructuredOutputsConfig.from_dict(
            self.structured_outputs_config, self.reasoning_parser
        )
        if structured_outputs_config.reasoning_parser is not None:
            from pagedllm.reasoning import ReasoningParserManager

            # A known name.
            ReasoningParserManager.get_reasoning_parser(structured_outputs_config.reasoning_parser)
        kv_transfer_config = None
        if self.kv_transfer_config is not None:
            from pagedllm.distributed.kv_transfer.factory import KVConnectorFactory

            kv_transfer_config = KVTransferConfig.from_dict(self.kv_transfer_config)
            KVConnectorFactory.validate(kv_transfer_config)
            _check_kv_transfer_compatible(extra.get("speculative_config"), parallel_config)
        compilation_config = CompilationConfig.from_dict(self.compilation_config)
        _check_compilation_compatible(compilation_config, parallel_config)
        batch_invariant = self.batch_invariant or env_flag(BATCH_INVARIANT_ENV)
        if batch_invariant:
            self._check_batch_invariant(device_config, parallel_config, compilation_config)
        return EngineConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            parallel_config=parallel_config,
            device_config=device_config,
            load_config=load_config,
            enforce_eager=self.enforce_eager,
            attention_backend=self.attention_backend,
            compilation_config=compilation_config,
            structured_outputs_config=structured_outputs_config,
            kv_transfer_config=kv_transfer_config,
            batch_invariant=batch_invariant,
            stall_timeout_s=_check_stall_timeout(self.stall_timeout_s),
            extra=extra,
        )

    def _check_batch_invariant(
        self, device: DeviceConfig, parallel: ParallelConfig, compilation: CompilationConfig
    ) -> None:
        """What batch-invariant mode cannot vouch for is refused, naming it."""
        refused = {
            "device": device.device != "cpu" and f"{device.device!r} (verified on the CPU only)",
            "speculative_config": bool(self.speculative_config)
            and "speculative decoding verifies drafts in batches of their own",
            "compilation_config": compilation.level != 0
            and f"level={compilation.level} (torch.compile may fuse and reorder reductions)",
            "tensor_parallel_size": parallel.tensor_parallel_size > 1
            and f"{parallel.tensor_parallel_size} (all-reduces across ranks)",
            "pipeline_parallel_size": parallel.pipeline_parallel_size > 1
            and f"{parallel.pipeline_parallel_size} (not verified)",
            "attention_backend": self.attention_backend is not None
            and f"{self.attention_backend!r} (the mode runs its own, BATCH_INVARIANT)",
        }
        for name, why in refused.items():
            if why:
                raise ValueError(f"batch_invariant=True cannot be combined with {name}: {why}")

    def _generation_config(self, load: Any, model_dir: str) -> dict[str, Any]:
        """vLLM's `generation_config`: "auto" reads the model's generation_config.json,
        "vllm" none (built-in defaults), anything else is a folder holding one."""
        override = self.override_generation_config
        if override is not None and not isinstance(override, dict):
            raise ValueError(
                f"override_generation_config={override!r} must be a dict (e.g. "
                '{"temperature": 0.5})'
            )
        if self.generation_config == "auto":
            config = load(model_dir)
        elif self.generation_config == "vllm":
            config = {}
        else:
            from pagedllm.transformers_utils.config import resolve_local_dir

            folder = resolve_local_dir(self.generation_config, what="generation_config")
            if not (folder / "generation_config.json").is_file():
                raise ValueError(
                    f"generation_config={self.generation_config!r} has no "
                    "generation_config.json (pass 'auto', 'vllm' or a folder holding one)"
                )
            config = load(str(folder))
        return {**config, **(override or {})}

    def _resolve_max_model_len(self, hf_config: Any) -> int:
        derived = getattr(hf_config, "max_position_embeddings", None) or 2048
        if self.max_model_len is None:
            return derived
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be positive")
        if self.max_model_len > derived:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={derived}"
            )
        return self.max_model_len

    # ---- command line -------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag-name` per field (vLLM's spelling); booleans get `--no-...` too."""
        group = parser.add_argument_group("engine arguments")
        aliases = {name: "--" + alias.replace("_", "-") for alias, name in ALIASES.items()}
        for f in fields(EngineArgs):
            if f.name == "model":
                continue
            flags = ["--" + f.name.replace("_", "-")] + (
                [aliases[f.name]] if f.name in aliases else []
            )
            flags += _SHORT_FLAGS.get(f.name, ())
            default = f.default
            help_text = _HELP.get(f.name, "")
            if f.type in ("bool", bool):
                group.add_argument(
                    *flags,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=help_text,
                )
            elif f.name == "quantization":
                group.add_argument(*flags, "-q", choices=["int8"], default=None, help=help_text)
            elif f.name in (
                "override_generation_config",
                "hf_overrides",
                "structured_outputs_config",
            ):
                group.add_argument(*flags, type=json_object_arg, default=None, help=help_text)
            elif f.name in ("speculative_config", "kv_transfer_config", "compilation_config"):
                group.add_argument(*flags, type=json.loads, default=None, help=help_text)
            elif f.name == "served_model_name":
                group.add_argument(*flags, nargs="+", default=None, help=help_text)
            elif f.name == "kv_cache_memory_bytes":
                group.add_argument(*flags, type=human_readable_int, default=None, help=help_text)
            else:
                group.add_argument(*flags, type=_cli_type(f), default=default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**values)

    def as_kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments (`LLM(**engine_args.as_kwargs())`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# Other names an engine argument is also known by (kwarg and flag): the field it sets.
ALIASES = {"kv_cache_memory": "kv_cache_memory_bytes"}


def _check_hf_overrides(overrides: Any) -> Any:
    """vLLM's hf_overrides: a dict (its keys config attributes) or a callable taking and
    returning the config; None or {} for none."""
    if overrides is None or callable(overrides):
        return overrides
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ValueError(
            f"hf_overrides={overrides!r} must be a dict of config attributes (e.g. "
            '{"max_position_embeddings": 4096}) or a callable that updates the config'
        )
    return overrides


def _check_unquantized(model: str, hf_config: Any) -> None:
    """A checkpoint quantized by another tool (config.json's `quantization_config`: FP8,
    GPTQ, AWQ, compressed-tensors, a `kv_cache_scheme`'s scales...) is a ValueError naming its
    method: its tensors (fp8 / packed weights, scales) are not loaded."""
    qc = getattr(hf_config, "quantization_config", None)
    if not qc:
        return
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    raise ValueError(
        f"model={model!r} is a quantized checkpoint (config.json quantization_config, "
        f"quant_method={method!r}), which pagedllm does not load: pass the unquantized "
        "checkpoint (quantization='int8' quantizes it here) or a GGUF file"
    )


def _check_load_format_compatible(load: LoadConfig, speculative_config: Any) -> None:
    """An EAGLE or Medusa head's layout is read from its checkpoint's tensor names, which
    dummy weights have none of."""
    method = getattr(speculative_config, "method", None)
    if load.load_format == "dummy" and method in ("eagle", "medusa"):
        raise ValueError(
            f"load_format='dummy' cannot be combined with speculative_config.method="
            f"{method!r}: the head's layout is read from its checkpoint's tensor names; use "
            "'ngram' or 'draft_model', or load real weights"
        )


def json_object_arg(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object (argparse reports anything else under the flag)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def human_readable_int(value: str) -> int:
    """vLLM's size syntax: an integer, or a number with a suffix, decimal in lower case
    (`25.6k` = 25600) and binary in upper case (`4G` = 4 << 30)."""
    value = value.strip()
    units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    units |= {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a size (an integer, or e.g. 512M, 4G, 25.6k)"
        ) from None


def _checkpoint_dirs(model: str, tokenizer: str | None) -> tuple[str, str]:
    """(model directory, tokenizer directory) for `model` and `--tokenizer`: a GGUF file (or
    a directory holding one) stands for its cached checkpoint directory
    (transformers_utils/gguf.py); the tokenizer defaults to the model's."""
    from pagedllm.transformers_utils.gguf import find_gguf_file, gguf_checkpoint_dir

    def resolve(name: str) -> str:
        gguf_file = find_gguf_file(name)
        return str(gguf_checkpoint_dir(gguf_file)) if gguf_file is not None else name

    model_dir = resolve(model)
    return model_dir, resolve(tokenizer) if tokenizer else model_dir


def _check_kv_transfer_compatible(speculative_config: Any, parallel: ParallelConfig) -> None:
    """KV connectors move the target model's KV only; a drafter with a KV cache of its own
    (draft model, EAGLE) would attend over positions it never computed. They also move one
    process's whole KV: with several ranks each holds a shard (heads or layers), which the
    connectors neither key nor gather per rank."""
    if parallel.world_size > 1:
        raise ValueError(
            "kv_transfer_config cannot be combined with tensor_parallel_size="
            f"{parallel.tensor_parallel_size} / pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}: KV connectors move a single rank's KV cache; "
            "use tensor_parallel_size=1 and pipeline_parallel_size=1"
        )
    method = getattr(speculative_config, "method", None)
    if method in ("draft_model", "eagle"):
        raise ValueError(
            f"kv_transfer_config cannot be combined with speculative_config.method={method!r}: "
            "connectors move the target model's KV only, not the drafter's; use 'ngram' or "
            "'medusa'"
        )


def _check_compilation_compatible(compilation: CompilationConfig, parallel: ParallelConfig) -> None:
    """torch.compile does not trace the tensor-parallel collectives (the shared-memory
    all-reduce is Python over a mapped segment) nor the stage-to-stage sends."""
    if compilation.level != 0 and parallel.world_size > 1:
        raise ValueError(
            f"compilation_config level={compilation.level} cannot be combined with "
            f"tensor_parallel_size={parallel.tensor_parallel_size} / pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}: the collectives between ranks are not "
            "compiled; use level 0"
        )


def _cli_type(f: dataclasses.Field) -> Any:
    text = str(f.type)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


# vLLM's short spellings.
_SHORT_FLAGS = {
    "tensor_parallel_size": ("-tp",),
    "pipeline_parallel_size": ("-pp",),
    "quantization": ("-q",),
}

_HELP = {
    "stall_timeout_s": "Seconds without a finished engine step, while requests wait or run, "
    "after which the engine counts as stalled (/health answers 503, the stall is logged with "
    "what was in flight); 0 turns stall detection off.",
    "tokenizer": "Tokenizer directory (default: the model directory).",
    "stream_interval": "A streamed request's output goes out every this many tokens (its "
    "first and last at once); above 1, fewer, larger chunks for less front-end work.",
    "tokenizer_mode": "auto or hf (the fast tokenizer where there is one), slow (transformers' "
    "slow Python tokenizer; refused where the checkpoint or transformers has none).",
    "hf_overrides": "A JSON object over the model's config.json, applied as it is read (before "
    "max_model_len and the model's shapes derive from it), e.g. "
    "'{\"max_position_embeddings\": 4096}'; an object value updates a sub-config or a dict "
    "key by key.",
    "load_format": "auto (*.safetensors, else PyTorch *.bin / *.pt), safetensors, pt (only "
    "those files) or dummy (no weights read: small random values seeded by --seed).",
    "dtype": "auto, bfloat16, float16 or float32 (auto: bf16 on the CPU).",
    "quantization": "Quantization: int8 (W8A16: int8 weights with a scale per output channel, "
    "activations quantized per token to int16 at run time).",
    "max_model_len": "Longest prompt + output (default: the model's max_position_embeddings).",
    "block_size": "Tokens per KV-cache block.",
    "kv_cache_dtype": "auto (the model's dtype), fp8 / fp8_e4m3 (float8_e4m3fn) or fp8_e5m2: "
    "the KV cache's dtype; fp8 holds twice the tokens of bf16 in the same memory (stored with "
    "scale 1.0 unless --calculate-kv-scales, saturated at the format's largest value).",
    "calculate_kv_scales": "With an fp8 --kv-cache-dtype: each attention layer's K and V "
    "scales from one calibration forward at start-up (max |K| / 200, max |V| / 100 over seeded "
    "random tokens, as vLLM) instead of 1.0.",
    "override_generation_config": "A JSON object over the generation config's sampling "
    "defaults, e.g. '{\"temperature\": 0.5}' (merged with --generation-config's).",
    "enable_prefix_caching": "Reuse KV blocks of shared prompt prefixes.",
    "enable_chunked_prefill": "Split long prompts over several steps.",
    "batch_invariant": "A request's tokens and logprobs are bitwise the same whatever the batch "
    "(row-by-row GEMMs, fixed-order attention; slower). Also PAGEDLLM_BATCH_INVARIANT=1.",
    "max_num_batched_tokens": "Token budget of one step.",
    "max_num_seqs": "Most requests running at once.",
    "served_model_name": "Name(s) the model is served under (all accepted as `model`; the "
    "first is reported). Default: the model path.",
    "generation_config": "'auto' (the model's generation_config.json), 'vllm' (none: built-in "
    "defaults) or a folder holding a generation_config.json.",
    "max_logprobs": "Most logprobs / prompt_logprobs a request may ask for (-1: no limit).",
    "kv_cache_memory_bytes": "KV-cache size in bytes, e.g. 4G (alias: --kv-cache-memory); on a "
    "GPU it replaces the profiling of --gpu-memory-utilization.",
    "gpu_memory_utilization": "Fraction of the GPU's memory this engine may use (weights, "
    "activations and KV cache); the KV cache gets what a profiling forward pass leaves.",
    "num_gpu_blocks_override": "Number of KV blocks, overriding the computed one.",
    "scheduling_policy": "fcfs or priority (lower value first).",
    "device": "auto, cpu or cuda.",
    "enforce_eager": "Run decode steps eagerly: no CUDA graphs (CUDA only).",
    "attention_backend": "TORCH_SDPA or TRITON_ATTN (default: TRITON_ATTN on CUDA, TORCH_SDPA "
    "on the CPU; also $PAGEDLLM_ATTENTION_BACKEND).",
    "structured_outputs_config": "A JSON object of vLLM's structured-output settings: backend "
    "(auto or xgrammar), disable_any_whitespace (every JSON constraint compact), "
    "enable_in_reasoning (constrain the reasoning too), reasoning_parser.",
    "reasoning_parser": "Split reasoning from content (deepseek_r1, qwen3); structured "
    "outputs apply after the reasoning.",
    "compilation_config": 'JSON, e.g. \'{"level": 3, "cudagraph_capture_sizes": [1, 2, 4]}\' '
    "(level 3: piecewise torch.compile; the decode batch sizes captured in CUDA graphs).",
    "tensor_parallel_size": "Ranks each layer is split over (heads, MLP, vocabulary).",
    "pipeline_parallel_size": "Stages the layers are split over (env "
    "PAGEDLLM_PP_LAYER_PARTITION, e.g. '5,7', sets layers per stage; default: even).",
    "distributed_executor_backend": "uni (one process), mp (a worker process per rank on this "
    "machine) or ray (Ray actors; attaches to RAY_ADDRESS or starts a local cluster). Default: "
    "uni for one rank, ray when a Ray cluster is in use, else mp.",
    "data_parallel_size": "Engine cores in all, each a full model copy with its own KV cache.",
    "data_parallel_size_local": "Engine cores on this node (default: data_parallel_size).",
    "data_parallel_start_rank": "Rank of the first engine core on this node (headless nodes).",
    "data_parallel_address": "Address of the head node that engines connect to (127.0.0.1).",
    "data_parallel_rpc_port": "Head node port for the engines' start-up handshake (29550).",
    "data_parallel_backend": "mp (processes) or ray (Ray actors; needs pagedllm[ray]).",
    "data_parallel_stop_on_engine_death": (
        "Stop serving when one engine core dies (default: the others keep serving)."
    ),
    "speculative_config": 'JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\'.',
    "kv_transfer_config": (
        'JSON, e.g. \'{"kv_connector": "OffloadingConnector", "kv_role": "kv_both", '
        '"kv_connector_extra_config": {"disk_path": "/var/cache/kv"}}\'.'
    ),
}


def _check_stall_timeout(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"stall_timeout_s={value!r} must be a number of seconds >= 0 (0: off)")
    return float(value)
