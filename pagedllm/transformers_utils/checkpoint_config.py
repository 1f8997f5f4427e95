"""A checkpoint's `config.json` read without transformers, for the architectures pagedllm runs.

Importing a transformers config class costs 1-2 s of CPU (transformers 5 pulls in
torch._dynamo and torch.distributed.tensor through its type validators), in the front end and
again in the engine process, which unpickles the config. For the model types in `_DEFAULTS`
`get_hf_config` returns a `CheckpointConfig` instead: the file's fields as plain attributes,
completed with the defaults and derived values transformers' own config class would give
(`tests/transformers_utils/test_checkpoint_config.py` holds the two side by side for every
field pagedllm reads). Anything else (other model types, remote code) goes through
transformers' `AutoConfig`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# transformers' defaults for the fields pagedllm reads, per `model_type` (its config classes'
# constructor defaults). RoPE needs none: rope_parameters_from_config reads either shape of
# the file and defaults theta to 10000, as these classes do.
_COMMON: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _COMMON
    | {
        "intermediate_size": 11008,
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "mistral": _COMMON
    | {
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "qwen2": _COMMON
    | {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
    "qwen3": _COMMON
    | {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": 4096,
    },
}


class CheckpointConfig:
    """A model's `config.json` as attributes (a light stand-in for transformers'
    `PretrainedConfig`: same attribute names and values for the supported model types)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __repr__(self) -> str:
        return f"CheckpointConfig({json.dumps(self.__dict__, sort_keys=True, default=str)})"


def is_light_model_type(raw: dict[str, Any]) -> bool:
    """Whether `raw` (a parsed config.json) can be read without transformers."""
    return raw.get("model_type") in _DEFAULTS and "auto_map" not in raw


def checkpoint_config_from_dict(raw: dict[str, Any]) -> CheckpointConfig:
    """`raw` (config.json, `model_type` in `_DEFAULTS`) completed as transformers would."""
    model_type = raw["model_type"]
    fields = _DEFAULTS[model_type] | raw  # an explicit null is a None argument, as there
    if fields.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    if model_type in ("llama", "mistral") and fields.get("head_dim") is None:
        fields["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    if model_type in ("qwen2", "qwen3") and not fields["use_sliding_window"]:
        fields["sliding_window"] = None
    if "torch_dtype" in fields and "dtype" not in fields:  # transformers 5's name
        fields["dtype"] = fields.pop("torch_dtype")
    return CheckpointConfig(**fields)


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)
