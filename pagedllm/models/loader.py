"""Build a model on its device in its dtype, then stream the checkpoint's tensors into it.

The model is constructed under a `torch.device` context with the target default dtype, so
each parameter is allocated once, where and how it will live (and only this tensor-parallel
rank's shard of it); checkpoint tensors are then read one at a time and copied into place by
the parameters' weight loaders. No full-precision CPU copy of the model is ever made.
"""

from __future__ import annotations

import contextlib
import json
import logging
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
# *.bin files a training run leaves next to the weights.
_NOT_WEIGHTS = {"training_args.bin", "optimizer.bin", "scheduler.bin", "scaler.bin"}


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


def list_weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files: safetensors (sharded via its index, or all *.safetensors)
    first, else PyTorch *.bin files."""
    model_dir = Path(model_dir)
    if (model_dir / _SAFETENSORS_INDEX).is_file():
        files = _from_index(model_dir, _SAFETENSORS_INDEX)
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files and (model_dir / _BIN_INDEX).is_file():
            files = _from_index(model_dir, _BIN_INDEX)
        elif not files:
            files = sorted(
                p
                for p in model_dir.glob("*.bin")
                if p.name not in _NOT_WEIGHTS and not p.name.startswith("rng_state")
            )
    if not files:
        raise ValueError(
            f"no weight files (*.safetensors or *.bin) found in model directory {str(model_dir)!r}"
        )
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ValueError(f"weight files named by the checkpoint index are missing: {missing}")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor) for every tensor of the checkpoint, one file at a time (or,
    for a GGUF checkpoint, one dequantized tensor at a time)."""
    if is_gguf_checkpoint_dir(model_dir):
        from pagedllm.models.gguf_loader import iterate_gguf_weights

        yield from iterate_gguf_weights(model_dir)
        return
    for path in list_weight_files(model_dir):
        if path.suffix == ".safetensors":
            from safetensors import safe_open

            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            yield from state.items()
            del state


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
) -> nn.Module:
    """Build a module in `dtype` on `device` (parameters allocated in place), stream the
    checkpoint in `model_dir` into its `load_weights` (which returns the names of the
    parameters it filled), check that none is missing (ValueError naming `source`), run the
    layers' `process_weights_after_loading` hooks; returns it in eval mode, with
    `num_checkpoint_parameters` set to its parameter count before those hooks ran (they may
    repack weights into other shapes; this rank's shard only, with tensor parallelism).
    `huge_pages`: on the CPU, move the packed weights onto huge pages before returning
    (layers/cpu_memory.py; `PAGEDLLM_WEIGHT_HUGE_PAGES=0` never)."""
    with default_dtype(dtype), device:
        module = build()
    with torch.no_grad():
        loaded = module.load_weights(iterate_weights(model_dir))
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
