"""Read a local checkpoint's `config.json` and `generation_config.json` (never the network)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pagedllm.transformers_utils.checkpoint_config import (
    checkpoint_config_from_dict,
    is_light_model_type,
    read_config_json,
)


def resolve_local_dir(name: str, what: str = "model") -> Path:
    """`name` as an existing local directory, or a ValueError that explains there is no hub."""
    path = Path(os.path.expanduser(str(name)))
    if not path.is_dir():
        raise ValueError(
            f"{what}={str(name)!r} is not an existing local directory or .gguf file. pagedllm "
            "has no network or Hugging Face Hub access here: pass the path of a local "
            "checkpoint directory (config.json, *.safetensors, tokenizer files) or of a GGUF "
            "file, e.g. the demo model `pagedllm fetch-demo-model` writes."
        )
    return path


def get_hf_config(model: str, trust_remote_code: bool = False, **kwargs: Any) -> Any:
    """The config of the checkpoint directory `model`: a `CheckpointConfig` (config.json read
    without transformers) for the model types pagedllm runs, else transformers' `AutoConfig`
    (`kwargs` go to it, and force it)."""
    path = resolve_local_dir(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model={str(model)!r} has no config.json; is it a checkpoint directory?")
    if not kwargs:
        raw = read_config_json(path)
        if is_light_model_type(raw):
            return checkpoint_config_from_dict(raw)
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        str(path), trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
    )


def get_generation_config(model_dir: str) -> dict[str, Any]:
    """`generation_config.json` as a dict ({} when the checkpoint has none)."""
    path = Path(os.path.expanduser(str(model_dir))) / "generation_config.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if v is not None]
    return [int(value)]


def get_eos_token_ids(
    model_dir: str,
    hf_config: Any = None,
    generation_config: dict[str, Any] | None = None,
    tokenizer: Any = None,
) -> list[int]:
    """The checkpoint's end-of-sequence ids, first one the primary EOS.

    Taken from generation_config.json's `eos_token_id` (an int or a list), else config.json's,
    else the tokenizer's `eos_token_id` (the tokenizer is loaded from `model_dir` if not given).
    """
    if generation_config is None:
        generation_config = get_generation_config(model_dir)
    ids = _as_id_list(generation_config.get("eos_token_id"))
    if not ids and hf_config is not None:
        ids = _as_id_list(getattr(hf_config, "eos_token_id", None))
    if not ids:
        if tokenizer is None:
            from pagedllm.transformers_utils.tokenizer import get_tokenizer

            try:
                tokenizer = get_tokenizer(model_dir)
            except (OSError, ValueError):
                tokenizer = None
        ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
    return list(dict.fromkeys(ids))  # de-duplicated, order kept
