"""Checkpoint discovery and loading: sharded / .bin checkpoints, dtype, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm.models.loader import get_model, iterate_weights, list_weight_files
from pagedllm.models.registry import ModelRegistry, resolve_model_cls
from pagedllm.testing import make_demo_model
from pagedllm.testing.demo_model import TINY_ARCH_OVERRIDES
from pagedllm.transformers_utils.config import (
    get_eos_token_ids,
    get_generation_config,
    get_hf_config,
)
from pagedllm.transformers_utils.tokenizer import get_tokenizer


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _copy_checkpoint(src: str, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_safetensors_load_like_single_file(tmp_path, tiny_llama_dir, make_engine_config):
    sharded = make_demo_model(
        tmp_path / "sharded",
        preset="tiny",
        seed=0,
        max_shard_size="100KB",
        **TINY_ARCH_OVERRIDES["llama"],
    )
    files = list_weight_files(sharded)
    assert len(files) > 1
    assert (Path(sharded) / "model.safetensors.index.json").is_file()
    whole = _state(get_model(make_engine_config(tiny_llama_dir)))
    parts = _state(get_model(make_engine_config(sharded)))
    assert whole.keys() == parts.keys()
    for name in whole:
        assert torch.equal(whole[name], parts[name]), name


def test_bin_checkpoint_fallback(tmp_path, tiny_llama_dir, make_engine_config):
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "bin")
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(tensors, ckpt / "pytorch_model.bin")
    assert [p.name for p in list_weight_files(ckpt)] == ["pytorch_model.bin"]
    loaded = _state(get_model(make_engine_config(str(ckpt))))
    reference = _state(get_model(make_engine_config(tiny_llama_dir)))
    for name in reference:
        assert torch.equal(loaded[name], reference[name]), name


def test_missing_weight_is_named(tmp_path, tiny_llama_dir, make_engine_config):
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "missing")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.post_attention_layernorm\.weight"):
        get_model(make_engine_config(str(ckpt)))


def test_unexpected_weight_is_named(tmp_path, tiny_llama_dir, make_engine_config):
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "extra")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mystery\.weight"):
        get_model(make_engine_config(str(ckpt)))


def test_no_weight_files(tmp_path, tiny_llama_dir, make_engine_config):
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "empty")
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weight files"):
        get_model(make_engine_config(str(ckpt)))


def test_bfloat16_model(tiny_llama_dir, make_engine_config):
    model = get_model(make_engine_config(tiny_llama_dir, dtype=torch.bfloat16))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training
    # RoPE tables stay float32 whatever the model dtype.
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_tied_embeddings_share_one_parameter(tiny_model_dirs, make_engine_config):
    model = get_model(make_engine_config(tiny_model_dirs["qwen2"]))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())


def test_unsupported_architecture(tmp_path, tiny_llama_dir, make_engine_config):
    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        resolve_model_cls(["GPTNeoXForCausalLM"])
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "unsupported")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FancyForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyForCausalLM.*Qwen3ForCausalLM"):
        get_model(make_engine_config(str(ckpt)))


def test_registry_lists_supported_archs():
    assert ModelRegistry.get_supported_archs() == [
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ]
    cls = resolve_model_cls(["SomethingElse", "Qwen2ForCausalLM"])
    assert cls.__name__ == "Qwen2ForCausalLM"


@pytest.mark.parametrize("name", ["meta-llama/Llama-3-8B", "/no/such/dir"])
def test_hub_id_or_missing_dir_is_a_clear_error(name):
    with pytest.raises(ValueError, match="no network"):
        get_hf_config(name)
    with pytest.raises(ValueError, match="local checkpoint directory"):
        get_tokenizer(name)


def test_generation_config_and_eos_ids(tmp_path, tiny_llama_dir):
    gen = get_generation_config(tiny_llama_dir)
    hf_config = get_hf_config(tiny_llama_dir)
    assert get_eos_token_ids(tiny_llama_dir, hf_config, gen) == [2, 7]
    # Without generation_config.json: config.json's single id.
    ckpt = _copy_checkpoint(tiny_llama_dir, tmp_path / "nogen")
    (ckpt / "generation_config.json").unlink()
    assert get_generation_config(str(ckpt)) == {}
    assert get_eos_token_ids(str(ckpt), hf_config) == [2]
    # Nothing in either config: the tokenizer's EOS.
    hf_config.eos_token_id = None
    assert get_eos_token_ids(str(ckpt), hf_config, {}) == [2]


def test_iterate_weights_yields_checkpoint_names(tiny_llama_dir):
    names = {name for name, _ in iterate_weights(tiny_llama_dir)}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "lm_head.weight" in names
