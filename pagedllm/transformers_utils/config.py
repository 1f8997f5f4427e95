"""Read a local checkpoint's `config.json` and `generation_config.json` (never the network)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
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


HfOverrides = dict[str, Any] | Callable[[Any], Any]


def get_hf_config(
    model: str,
    trust_remote_code: bool = False,
    hf_overrides: HfOverrides | None = None,
    **kwargs: Any,
) -> Any:
    """The config of the checkpoint directory `model`: a `CheckpointConfig` (config.json read
    without transformers) for the model types pagedllm runs, else transformers' `AutoConfig`
    (`kwargs` go to it, and force it); `hf_overrides` applied (`apply_hf_overrides`)."""
    path = resolve_local_dir(model)
    if not (path / "config.json").is_file():
        raise ValueError(f"model={str(model)!r} has no config.json; is it a checkpoint directory?")
    raw = read_config_json(path) if not kwargs else None
    if raw is not None and is_light_model_type(raw):
        config = checkpoint_config_from_dict(raw)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(
            str(path), trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    return apply_hf_overrides(config, hf_overrides) if hf_overrides else config


def apply_hf_overrides(config: Any, overrides: HfOverrides) -> Any:
    """vLLM's `hf_overrides` on a config just read: a callable returns the config to use; a
    dict sets each key as an attribute, except that a dict value updates a sub-config (a
    config-valued attribute, e.g. `text_config`) or a dict-valued attribute (e.g.
    `rope_scaling`) key by key, at any depth. Returns the config (updated in place)."""
    if callable(overrides):
        updated = overrides(config)
        if updated is None:
            raise ValueError("the hf_overrides callable returned None; it must return the config")
        return updated
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, dict):
            setattr(config, key, _merged(current, value))
        elif isinstance(value, dict) and hasattr(current, "to_dict"):  # a sub-config
            apply_hf_overrides(current, value)
        else:
            setattr(config, key, value)
    return config


def _merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        old = merged.get(key)
        both_dicts = isinstance(value, dict) and isinstance(old, dict)
        merged[key] = _merged(old, value) if both_dicts else value
    return merged


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
    tokenizer_mode: str = "auto",
) -> list[int]:
    """The checkpoint's end-of-sequence ids, first one the primary EOS.

    Taken from generation_config.json's `eos_token_id` (an int or a list), else config.json's,
    else the tokenizer's `eos_token_id` (the tokenizer is loaded from `model_dir` in
    `tokenizer_mode` if not given).
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
                tokenizer = get_tokenizer(model_dir, tokenizer_mode=tokenizer_mode)
            except (OSError, ValueError):
                tokenizer = None
        ids = _as_id_list(getattr(tokenizer, "eos_token_id", None))
    return list(dict.fromkeys(ids))  # de-duplicated, order kept
