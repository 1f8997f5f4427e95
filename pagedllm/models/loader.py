"""Build a model on its device in its dtype, then stream the checkpoint's tensors into it.

The model is constructed under a `torch.device` context with the target default dtype, so
each parameter is allocated once, where and how it will live (and only this tensor-parallel
rank's shard of it); checkpoint tensors are then read one at a time and copied into place by
the parameters' weight loaders. No full-precision CPU copy of the model is ever made.
`load_format` (vLLM's) picks the files read; "dummy" reads none and fills the parameters with
small seeded random values instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from pagedllm.config import EngineConfig, env_flag
from pagedllm.layers.cpu_memory import place_panels_on_huge_pages
from pagedllm.layers.quantization import quantize_model_
from pagedllm.models.registry import resolve_model_cls
from pagedllm.transformers_utils.gguf import is_gguf_checkpoint_dir

logger = logging.getLogger(__name__)

_SAFETENSORS_INDEX = "model.safetensors.index.json"
_BIN_INDEX = "pytorch_model.bin.index.json"
# *.bin / *.pt files a training run leaves next to the weights.
_NOT_WEIGHTS = {
    "training_args.bin",
    "optimizer.bin",
    "scheduler.bin",
    "scaler.bin",
    "optimizer.pt",
    "scheduler.pt",
    "scaler.pt",
}
# The files each load_format reads (`list_weight_files`); "dummy" reads none.
_WEIGHT_FILES = {
    "auto": "*.safetensors, *.bin or *.pt",
    "safetensors": "*.safetensors",
    "pt": "*.bin or *.pt",
}


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are `dtype` (so a model is built in its dtype directly)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _from_index(model_dir: Path, index_name: str) -> list[Path]:
    with open(model_dir / index_name) as f:
        weight_map = json.load(f)["weight_map"]
    return [model_dir / name for name in sorted(set(weight_map.values()))]


def list_weight_files(model_dir: str | Path, load_format: str = "auto") -> list[Path]:
    """The checkpoint's weight files for `load_format` (models read them in this order):
    "safetensors": sharded via model.safetensors.index.json, else every *.safetensors; "pt":
    sharded via pytorch_model.bin.index.json, else every *.bin, else every *.pt (files a
    training run leaves beside the weights skipped); "auto": the safetensors ones if there
    are any, else the PyTorch ones. None found: a ValueError naming the directory."""
    if load_format not in _WEIGHT_FILES:
        raise ValueError(f"load_format={load_format!r} reads no weight files")
    model_dir = Path(model_dir)
    files: list[Path] = []
    if load_format in ("auto", "safetensors"):
        files = _safetensors_files(model_dir)
    if not files and load_format in ("auto", "pt"):
        files = _pytorch_files(model_dir)
    if not files:
        raise ValueError(
            f"no weight files ({_WEIGHT_FILES[load_format]}) found in model directory "
            f"{str(model_dir)!r} for load_format={load_format!r}"
        )
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ValueError(f"weight files named by the checkpoint index are missing: {missing}")
    return files


def _safetensors_files(model_dir: Path) -> list[Path]:
    if (model_dir / _SAFETENSORS_INDEX).is_file():
        return _from_index(model_dir, _SAFETENSORS_INDEX)
    return sorted(model_dir.glob("*.safetensors"))


def _pytorch_files(model_dir: Path) -> list[Path]:
    if (model_dir / _BIN_INDEX).is_file():
        return _from_index(model_dir, _BIN_INDEX)
    for pattern in ("*.bin", "*.pt"):
        files = sorted(
            p
            for p in model_dir.glob(pattern)
            if p.name not in _NOT_WEIGHTS and not p.name.startswith("rng_state")
        )
        if files:
            return files
    return []


def iterate_weights(
    model_dir: str | Path, load_format: str = "auto"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, one file at a time (or,
    for a GGUF checkpoint, one dequantized tensor at a time)."""
    if is_gguf_checkpoint_dir(model_dir):
        if load_format != "auto":
            raise ValueError(
                f"load_format={load_format!r} cannot read the GGUF checkpoint {str(model_dir)!r} "
                "(its weights are in the .gguf file); use 'auto' or 'dummy'"
            )
        from pagedllm.models.gguf_loader import iterate_gguf_weights

        yield from iterate_gguf_weights(model_dir)
        return
    for path in list_weight_files(model_dir, load_format):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(state, dict):
                raise ValueError(f"{str(path)!r} holds a {type(state).__name__}, not a state dict")
            yield from state.items()
            del state


def initialize_dummy_weights(module: nn.Module, seed: int) -> set[str]:
    """load_format="dummy": fill every parameter of `module` with uniform values in
    [-1e-3, 1e-3] (vLLM's range), each drawn from a generator seeded by `seed` and the
    parameter's name, so the same seed gives the same weights whatever the device or the
    order of the modules. An int8 weight (quantization="int8") receives the quantized draw
    and its scales; vocabulary padding rows stay zero. Returns the names filled."""
    from pagedllm.layers.quantization import set_int8_weight_
    from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

    filled: set[str] = set()
    for name, param in module.named_parameters():  # a tied parameter once, by its first name
        owner_name, _, param_name = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        # The CPU generator keeps 32 bits of its seed: both inputs go into them.
        generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
        values = torch.empty(param.shape, dtype=torch.float32)
        values.uniform_(-1e-3, 1e-3, generator=generator)
        if isinstance(owner, VocabParallelEmbedding):
            values[owner.vocab_end - owner.vocab_start :] = 0.0
        if param.dtype.is_floating_point:
            param.data.copy_(values)
        elif param_name == "weight" and param.dtype == torch.int8:
            set_int8_weight_(owner, values)
        else:
            raise TypeError(f"no dummy values for {name} of dtype {param.dtype}")
        filled.add(name)
    return filled


def get_model(config: EngineConfig) -> nn.Module:
    """Build `config.model_config`'s architecture on the configured device and dtype, load its
    checkpoint, and return it in eval mode. Every parameter must receive a checkpoint tensor."""
    model_config = config.model_config
    archs = getattr(model_config.hf_config, "architectures", None) or []
    model_cls = resolve_model_cls(archs)
    device = config.device_config.torch_device
    model = load_module(
        lambda: quantize_model_(model_cls(config=config), model_config.quantization),
        model_config.model,
        model_config.dtype,
        device,
        f"checkpoint {model_config.model!r}",
        huge_pages=False,  # the model runner moves them while the engine is idle
        load_format=config.load_config.load_format,
        seed=model_config.seed,
    )
    logger.info(
        "loaded %s (%s%s, %.1fM parameters) on %s",
        model_cls.__name__,
        model_config.dtype,
        f", {model_config.quantization} weights" if model_config.quantization else "",
        model.num_checkpoint_parameters / 1e6,
        device,
    )
    return model


def weight_huge_pages(device: torch.device) -> bool:
    """Whether packed weights on `device` move onto huge pages (the CPU, unless
    `PAGEDLLM_WEIGHT_HUGE_PAGES=0`)."""
    return device.type == "cpu" and env_flag("PAGEDLLM_WEIGHT_HUGE_PAGES", True)


def load_module(
    build: Callable[[], nn.Module],
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    huge_pages: bool = True,
    load_format: str = "auto",
    seed: int = 0,
) -> nn.Module:
    """Build a module in `dtype` on `device` (parameters allocated in place), stream the
    checkpoint in `model_dir` into its `load_weights` (which returns the names of the
    parameters it filled), check that none is missing (ValueError naming `source`), run the
    layers' `process_weights_after_loading` hooks; returns it in eval mode, with
    `num_checkpoint_parameters` set to its parameter count before those hooks ran (they may
    repack weights into other shapes; this rank's shard only, with tensor parallelism).
    `huge_pages`: on the CPU, move the packed weights onto huge pages before returning
    (layers/cpu_memory.py; `PAGEDLLM_WEIGHT_HUGE_PAGES=0` never). `load_format`: which
    files are read (`list_weight_files`); "dummy" reads none and fills the parameters with
    values seeded by `seed` (`initialize_dummy_weights`)."""
    with default_dtype(dtype), device:
        module = build()
    with torch.no_grad():
        if load_format == "dummy":
            loaded = initialize_dummy_weights(module, seed)
        else:
            loaded = module.load_weights(iterate_weights(model_dir, load_format))
    missing = sorted(name for name, _ in module.named_parameters() if name not in loaded)
    if missing:
        shown = ", ".join(missing[:10]) + (
            f", ... ({len(missing)} in all)" if len(missing) > 10 else ""
        )
        raise ValueError(
            f"{source} has no weights for these parameters of {type(module).__name__}: {shown}"
        )
    module.num_checkpoint_parameters = sum(p.numel() for p in module.parameters())
    for sub in module.modules():
        hook = getattr(sub, "process_weights_after_loading", None)
        if hook is not None:
            hook()
    if huge_pages and weight_huge_pages(device):
        place_panels_on_huge_pages(module)
    return module.eval()
