"""The demo/test checkpoint maker: files, sizes, tokenizer, determinism, CLI."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedllm.testing import PRESETS, make_demo_model
from pagedllm.testing.demo_model import (
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    add_cli_args,
    build_hf_config,
    run_from_args,
)
from pagedllm.transformers_utils.tokenizer import get_tokenizer


def test_tiny_checkpoint_files_and_config(tiny_llama_dir):
    files = {p.name for p in Path(tiny_llama_dir).iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    cfg = json.loads((Path(tiny_llama_dir) / "config.json").read_text())
    for key, value in PRESETS["tiny"].items():
        assert cfg[key] == value, key
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    gen = json.loads((Path(tiny_llama_dir) / "generation_config.json").read_text())
    assert gen["bos_token_id"] == BOS_ID
    assert gen["eos_token_id"] == [EOS_ID, END_OF_TURN_ID]


def test_tokenizer_vocab_roundtrip_and_chat_template(tiny_llama_dir):
    tok = get_tokenizer(tiny_llama_dir)
    assert len(tok) == PRESETS["tiny"]["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID)
    text = "The quick river ran past 42 old houses, didn't it?"
    ids = tok(text).input_ids
    assert ids[0] == BOS_ID
    assert max(ids) < len(tok)
    assert tok.decode(ids, skip_special_tokens=True) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<s><|system|>\nBe brief.<|end|>\n<|user|>\nHi!<|end|>\n<|assistant|>\n"
    chat_ids = tok(prompt, add_special_tokens=False).input_ids
    assert chat_ids[0] == BOS_ID
    assert tok.convert_tokens_to_ids("<|end|>") == END_OF_TURN_ID
    assert END_OF_TURN_ID in chat_ids


def test_tiny_build_is_fast_and_seeded(tmp_path, tiny_llama_dir):
    start = time.perf_counter()
    path = make_demo_model(tmp_path / "a", preset="tiny", seed=0)
    elapsed = time.perf_counter() - start
    assert elapsed < 10.0, f"tiny checkpoint took {elapsed:.1f}s"  # ~0.1 s when warm
    again = load_file(Path(path) / "model.safetensors")
    other = load_file(Path(make_demo_model(tmp_path / "b", seed=1)) / "model.safetensors")
    first = load_file(Path(make_demo_model(tmp_path / "c", seed=0)) / "model.safetensors")
    assert again.keys() == first.keys()
    assert all(torch.equal(again[k], first[k]) for k in again)
    assert not torch.equal(again["lm_head.weight"], other["lm_head.weight"])
    # Biases and norm weights are not left at their trivial init (a skipped load would show).
    assert not torch.equal(again["model.norm.weight"], torch.ones_like(again["model.norm.weight"]))


@pytest.mark.parametrize(
    "arch,overrides,expect",
    [
        ("Qwen2ForCausalLM", {}, {"tie_word_embeddings": True, "model_type": "qwen2"}),
        ("Qwen3ForCausalLM", {"head_dim": 32}, {"head_dim": 32, "model_type": "qwen3"}),
        ("MistralForCausalLM", {}, {"sliding_window": None, "model_type": "mistral"}),
        ("LlamaForCausalLM", {"num_key_value_heads": 1}, {"num_key_value_heads": 1}),
    ],
)
def test_architectures_and_overrides(arch, overrides, expect):
    cfg = build_hf_config(arch, "tiny", "float32", **overrides)
    assert cfg.architectures == [arch]
    for key, value in expect.items():
        assert getattr(cfg, key) == value, key


def test_rope_scaling_override_reaches_config():
    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = build_hf_config("LlamaForCausalLM", "tiny", "float32", rope_scaling=scaling)
    params = getattr(cfg, "rope_parameters", None) or cfg.rope_scaling
    assert params["rope_type"] == "linear" and params["factor"] == 2.0


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_hf_config("GPT2LMHeadModel", "tiny", "float32")
    with pytest.raises(ValueError, match="huge"):
        build_hf_config("LlamaForCausalLM", "huge", "float32")
    with pytest.raises(ValueError, match="vocab_size=100"):
        make_demo_model(tmp_path / "small", vocab_size=100)
    assert not (tmp_path / "small").exists()


@pytest.mark.parametrize("preset,low,high", [("demo", 3e6, 8e6), ("llama-125m", 115e6, 135e6)])
def test_preset_sizes(preset, low, high):
    from transformers import AutoModelForCausalLM

    cfg = build_hf_config("LlamaForCausalLM", preset, "float32")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert low < n < high, n


def test_cli_verb(tmp_path, capsys):
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        [
            str(tmp_path / "cli"),
            "--preset",
            "tiny",
            "--architecture",
            "Qwen3ForCausalLM",
            "--override",
            "head_dim=8",
            "--override",
            "num_hidden_layers=1",
        ]
    )
    assert run_from_args(args) == 0
    cfg = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert (cfg["head_dim"], cfg["num_hidden_layers"]) == (8, 1)
    assert "Qwen3ForCausalLM" in capsys.readouterr().out


def test_tied_checkpoint_stores_one_matrix(tiny_model_dirs):
    tensors = load_file(Path(tiny_model_dirs["qwen2"]) / "model.safetensors")
    assert "model.embed_tokens.weight" in tensors
    assert "lm_head.weight" not in tensors
    assert "model.layers.0.self_attn.q_proj.bias" in tensors
