"""Random EAGLE and Medusa checkpoints for a given target, built offline (tests, benchmarks).

Both are written in the formats the proposers load (see eagle.py / medusa.py): a config.json
and one model.safetensors, seeded, scaled like `make_demo_model`'s weights (linear layers
N(0, 1/fan_in), norms near 1, LM heads giving logits of a few units).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch


def _target_config(target_dir: str) -> dict[str, Any]:
    with open(os.path.join(target_dir, "config.json")) as f:
        return json.load(f)


def eagle_config(target_dir: str, architecture: str = "EagleLlamaForCausalLM") -> dict[str, Any]:
    """An EAGLE head's config.json: the target's, with one layer and `architecture`."""
    config = _target_config(target_dir)
    config.update(num_hidden_layers=1, architectures=[architecture])
    return config


def medusa_config(target_dir: str, num_heads: int, num_layers: int) -> dict[str, Any]:
    """config.json of vLLM's `MedusaModel` layout (own LM heads, biased residual blocks)."""
    target = _target_config(target_dir)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_heads": num_heads,
        "num_hidden_layers": num_layers,
        "medusa_fc_bias": True,
        "truncated_vocab_size": vocab,
        "original_lm_head": False,
    }


def _linear(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)


def save_head(path: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    """Write `config` as config.json and `tensors` as model.safetensors under `path`."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors")
    )
    return path


def make_eagle_head(
    path: str | os.PathLike,
    target_dir: str,
    *,
    seed: int = 0,
    architecture: str = "EagleLlamaForCausalLM",
    with_embed: bool = False,
    fc_bias: bool = False,
) -> str:
    """Write a random one-layer EAGLE head for the Llama-family checkpoint `target_dir`:
    config.json (the target's, with num_hidden_layers 1 and `architecture`) and the tensors
    `fc.weight` [H, 2H] (+ `fc.bias`), `layers.0.*` without an input norm, and optionally its
    own `embed_tokens.weight`. Returns the directory."""
    config = eagle_config(target_dir, architecture)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)
    t: dict[str, torch.Tensor] = {"fc.weight": _linear(gen, hidden, 2 * hidden)}
    if fc_bias:
        t["fc.bias"] = torch.randn(hidden, generator=gen) * 0.05
    layer = "layers.0."
    t[layer + "self_attn.q_proj.weight"] = _linear(gen, heads * head_dim, hidden)
    t[layer + "self_attn.k_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
    t[layer + "self_attn.v_proj.weight"] = _linear(gen, kv_heads * head_dim, hidden)
    t[layer + "self_attn.o_proj.weight"] = _linear(gen, hidden, heads * head_dim)
    t[layer + "mlp.gate_proj.weight"] = _linear(gen, inter, hidden)
    t[layer + "mlp.up_proj.weight"] = _linear(gen, inter, hidden)
    t[layer + "mlp.down_proj.weight"] = _linear(gen, hidden, inter)
    t[layer + "post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=gen)
    if config.get("attention_bias"):
        t[layer + "self_attn.q_proj.bias"] = torch.zeros(heads * head_dim)
        t[layer + "self_attn.k_proj.bias"] = torch.zeros(kv_heads * head_dim)
        t[layer + "self_attn.v_proj.bias"] = torch.zeros(kv_heads * head_dim)
        t[layer + "self_attn.o_proj.bias"] = torch.zeros(hidden)
    if with_embed:
        t["embed_tokens.weight"] = torch.randn(config["vocab_size"], hidden, generator=gen)
    return save_head(os.fspath(path), config, t)


def make_medusa_heads(
    path: str | os.PathLike,
    target_dir: str,
    *,
    num_heads: int = 3,
    num_layers: int = 1,
    seed: int = 0,
    layout: str = "vllm",
) -> str:
    """Write random Medusa heads for `target_dir`: vLLM's `MedusaModel` layout
    (`layout="vllm"`: `blocks.{i}.layers.{j}.weight/bias`, `lm_heads.{i}.weight`) or the
    original release's (`layout="original"`: `{i}.{j}.linear.weight/bias`, `{i}.{L}.weight`
    and `medusa_num_heads` / `medusa_num_layers` in config.json). Returns the directory."""
    if layout not in ("vllm", "original"):
        raise ValueError(f"layout={layout!r} must be 'vllm' or 'original'")
    target = _target_config(target_dir)
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    gen = torch.Generator().manual_seed(seed)
    head_std = 2.5 / math.sqrt(hidden)
    t: dict[str, torch.Tensor] = {}
    for i in range(num_heads):
        for j in range(num_layers):
            w, b = _linear(gen, hidden, hidden), torch.randn(hidden, generator=gen) * 0.05
            if layout == "vllm":
                t[f"blocks.{i}.layers.{j}.weight"], t[f"blocks.{i}.layers.{j}.bias"] = w, b
            else:
                t[f"{i}.{j}.linear.weight"], t[f"{i}.{j}.linear.bias"] = w, b
        head = torch.randn(vocab, hidden, generator=gen) * head_std
        t[f"lm_heads.{i}.weight" if layout == "vllm" else f"{i}.{num_layers}.weight"] = head
    if layout == "vllm":
        config = medusa_config(target_dir, num_heads, num_layers)
    else:
        config = {
            "architectures": ["MedusaModel"],
            "hidden_size": hidden,
            "vocab_size": vocab,
            "medusa_num_heads": num_heads,
            "medusa_num_layers": num_layers,
        }
    return save_head(os.fspath(path), config, t)
