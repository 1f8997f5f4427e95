"""config.json read without transformers gives pagedllm what transformers' config would, and
the engine process then never imports transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from transformers import AutoConfig

from pagedllm.models.llama import check_sliding_window, get_head_dim
from pagedllm.models.registry import resolve_model_cls
from pagedllm.transformers_utils.checkpoint_config import CheckpointConfig
from pagedllm.transformers_utils.config import get_hf_config

FIELDS = (
    "architectures vocab_size hidden_size intermediate_size num_hidden_layers "
    "num_attention_heads num_key_value_heads hidden_act max_position_embeddings rms_norm_eps "
    "tie_word_embeddings attention_bias mlp_bias bos_token_id eos_token_id sliding_window "
    "use_sliding_window partial_rotary_factor"
).split()

ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# Files as checkpoints write them: everything default, sizes only, older spellings (rope_scaling
# + rope_theta, torch_dtype), explicit nulls, sliding windows on and off.
VARIANTS = {
    "bare": {},
    "sizes": {"hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 512},
    "gqa_old_rope": {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "torch_dtype": "float16",
        "tie_word_embeddings": True,
        "eos_token_id": [5, 6],
    },
    "new_rope_nulls": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "dtype": "bfloat16",
        "max_position_embeddings": 512,
        "eos_token_id": None,
    },
    "window": {"use_sliding_window": True, "sliding_window": 128, "head_dim": 32},
    "window_off": {"use_sliding_window": False, "sliding_window": 128, "attention_bias": True},
}


def pagedllm_view(cfg, arch: str) -> dict:
    """Everything pagedllm derives from a config."""
    from pagedllm.layers.rotary_embedding import rope_parameters_from_config

    view = {name: getattr(cfg, name, None) for name in FIELDS}
    view["head_dim"] = get_head_dim(cfg)
    view["rope"] = rope_parameters_from_config(cfg)
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    view["dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
    view["layer_spec"] = resolve_model_cls([arch]).layer_spec(cfg)
    try:
        check_sliding_window(cfg, 4096)
        view["sliding_window_check"] = "ok"
    except ValueError as e:
        view["sliding_window_check"] = str(e)
    return view


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_light_config_matches_transformers(tmp_path, model_type, variant):
    raw = {"model_type": model_type, "architectures": [ARCHS[model_type]]} | VARIANTS[variant]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = get_hf_config(str(tmp_path))
    assert isinstance(ours, CheckpointConfig)
    theirs = AutoConfig.from_pretrained(str(tmp_path), local_files_only=True)
    assert pagedllm_view(ours, ARCHS[model_type]) == pagedllm_view(theirs, ARCHS[model_type])


def test_other_model_types_and_remote_code_go_to_transformers(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64})
    )
    cfg = get_hf_config(str(tmp_path))
    assert not isinstance(cfg, CheckpointConfig) and cfg.n_embd == 64
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "auto_map": {"AutoConfig": "x.Y"}})
    )
    assert not isinstance(get_hf_config(str(tmp_path), trust_remote_code=False), CheckpointConfig)


def test_engine_process_does_not_import_transformers(tiny_model_dirs):
    """What the engine process does (unpickle the config, build the core, run a step) pulls in
    neither transformers nor torch._dynamo: both cost seconds of start-up."""
    code = textwrap.dedent(
        f"""
        import pickle, sys
        from pagedllm.engine.arg_utils import EngineArgs
        blob = pickle.dumps(EngineArgs(model={tiny_model_dirs["mistral"]!r}, dtype="bfloat16",
                                       kv_cache_memory=1 << 22).create_engine_config())
        assert "transformers" not in sys.modules, "front end config"
        from pagedllm.engine.core import EngineCore
        core = EngineCore(pickle.loads(blob))
        heavy = [m for m in ("transformers", "torch._dynamo") if m in sys.modules]
        assert not heavy, heavy
        print("ok", core.num_blocks)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
