"""get_tokenizer loads transformers' generic fast tokenizer directly, or hands AutoTokenizer a
config read without transformers, only where that gives the very tokenizer transformers' own
path gives; the tokenizer loads while the engine starts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pagedllm.transformers_utils.tokenizer import (
    _light_model_config,
    _loads_as_generic,
    _read_configs,
    get_tokenizer,
    get_tokenizer_while,
)

TEXT = "Hello world, 12345 tokens\n  of\ttext!"


def _describe(tok) -> tuple:
    return (
        type(tok).__name__,
        len(tok),
        tok(TEXT)["input_ids"],
        tok.decode(tok(TEXT)["input_ids"]),
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
        tok.chat_template,
    )


@pytest.mark.parametrize(
    "tokenizer_class",
    [
        None,
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
        "LlamaTokenizerFast",
        "Qwen2TokenizerFast",
        "GPT2TokenizerFast",
    ],
)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_same_tokenizer_as_transformers(tiny_model_dirs, tmp_path, arch, tokenizer_class):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dirs[arch], model_dir)
    tok_config_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        tok_config["tokenizer_class"] = tokenizer_class
    tok_config_path.write_text(json.dumps(tok_config))
    configs = _read_configs(model_dir)
    light = _light_model_config(model_dir, *configs)
    assert (light is None) == (tokenizer_class is None)
    # Loaded directly (no `transformers.models`) for llama's generic classes only.
    generic = arch == "llama" and tokenizer_class in (
        "TokenizersBackend",
        "PreTrainedTokenizerFast",
    )
    assert _loads_as_generic(model_dir, *configs) == generic
    ours = get_tokenizer(str(model_dir))
    theirs = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert _describe(ours) == _describe(theirs)


def test_tokenizer_with_its_own_code_goes_to_transformers(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model_dir)
    path = model_dir / "tokenizer_config.json"
    path.write_text(
        json.dumps(json.loads(path.read_text()) | {"auto_map": {"AutoTokenizer": ["a.B", None]}})
    )
    configs = _read_configs(model_dir)
    assert _light_model_config(model_dir, *configs) is None
    assert not _loads_as_generic(model_dir, *configs)


class _Started:
    def __init__(self) -> None:
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True


def test_get_tokenizer_while(tiny_llama_dir, tmp_path):
    tokenizer, started = get_tokenizer_while(_Started, tiny_llama_dir)
    assert _describe(tokenizer) == _describe(get_tokenizer(tiny_llama_dir))
    assert not started.shut_down
    # A tokenizer that fails to load stops what was started, then raises.
    holder = []

    def start() -> _Started:
        holder.append(_Started())
        return holder[0]

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="could not load a tokenizer"):
        get_tokenizer_while(start, str(tmp_path))
    assert holder[0].shut_down


def test_front_end_start_skips_transformers_models(tiny_llama_dir):
    """`LLM(...)` on a checkpoint with the generic tokenizer never imports
    `transformers.models` in the front end (its import reads ~1,700 model files)."""
    code = (
        "import sys\n"
        "from pagedllm import LLM\n"
        f"llm = LLM(model={str(tiny_llama_dir)!r}, kv_cache_memory=1 << 24)\n"
        "print(llm.generate([{'prompt_token_ids': [5, 6, 7]}])[0].outputs[0].token_ids)\n"
        "print('imported' if 'transformers.models' in sys.modules else 'skipped')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[-1] == "skipped"
