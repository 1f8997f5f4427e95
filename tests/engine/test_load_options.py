"""vLLM's load_format, hf_overrides and tokenizer_mode: every value pagedllm takes acts (as a
kwarg of `LLM` and as a flag), anything else is a ValueError naming the argument."""

from __future__ import annotations

import argparse
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.quantization import quantize_model_
from pagedllm.models.loader import default_dtype, get_model, initialize_dummy_weights
from pagedllm.models.registry import resolve_model_cls
from pagedllm.transformers_utils.checkpoint_config import CheckpointConfig
from pagedllm.transformers_utils.config import apply_hf_overrides
from pagedllm.transformers_utils.tokenizer import get_tokenizer

PROMPTS = [[5, 6, 7, 8, 9, 40, 41], [10, 30, 50], [200, 3, 77, 4, 99]]
MAX_NEW = 8


def _llm(model: str, **kwargs) -> LLM:
    return LLM(model=model, dtype="float32", kv_cache_memory=8 << 20, **kwargs)


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _config(model: str, **kwargs):
    return EngineArgs(model=model, dtype="float32", device="cpu", **kwargs).create_engine_config()


@pytest.fixture(scope="module")
def weightless_dir(llama_dir, tmp_path_factory) -> str:
    """The tiny Llama checkpoint without weight files: config, tokenizer, generation config."""
    path = tmp_path_factory.mktemp("weightless") / "ckpt"
    shutil.copytree(llama_dir, path, ignore=shutil.ignore_patterns("*.safetensors*"))
    return str(path)


# ---- load_format ----------------------------------------------------------------------------


def test_dummy_weights_need_no_files_and_follow_the_seed(weightless_dir):
    first, again, other = (
        _greedy(_llm(weightless_dir, load_format="dummy", seed=s)) for s in (0, 0, 1)
    )
    assert first == again
    assert first != other
    assert all(len(ids) == MAX_NEW for ids in first)


def test_dummy_weights_are_small_and_seeded(weightless_dir):
    def norms(seed: int) -> dict[str, torch.Tensor]:
        model = get_model(_config(weightless_dir, load_format="dummy", seed=seed))
        return {k: v.clone() for k, v in model.named_parameters() if "norm" in k}

    a, b, c = norms(3), norms(3), norms(4)
    for name, value in a.items():
        assert 0 < value.abs().max() <= 1e-3, name
        assert torch.equal(value, b[name]), name
        assert not torch.equal(value, c[name]), name


def test_dummy_int8_weights_are_the_quantized_draw(weightless_dir):
    """The int8 layers get the same draw as the float ones, quantized (scale per row); the
    engine then packs and runs them."""

    def build(quantization: str | None) -> torch.nn.Module:
        config = _config(weightless_dir, load_format="dummy", quantization=quantization)
        cls = resolve_model_cls(config.model_config.hf_config.architectures)
        with default_dtype(torch.float32):
            model = quantize_model_(cls(config=config), quantization)
        initialize_dummy_weights(model, seed=0)
        return model

    plain, int8 = dict(build(None).named_modules()), dict(build("int8").named_modules())
    quantized = [n for n, m in int8.items() if getattr(m, "weight", None) is not None]
    quantized = [n for n in quantized if int8[n].weight.dtype == torch.int8]
    assert "lm_head" in quantized and len(quantized) > 4
    for name in quantized:
        q, scale = int8[name].weight, int8[name].weight_scale
        assert q.abs().max() == 127, name
        restored = q.float() * scale[:, None]
        assert torch.allclose(restored, plain[name].weight, atol=float(scale.max()) / 2), name

    runs = [_greedy(_llm(weightless_dir, load_format="dummy", quantization="int8")) for _ in "ab"]
    assert runs[0] == runs[1] and all(len(ids) == MAX_NEW for ids in runs[0])


def test_load_format_picks_the_files(tmp_path, llama_dir):
    """A directory with both formats (the .bin weights doubled): each format reads its own
    files; "auto" prefers safetensors, and takes *.pt when that is all there is."""
    ckpt = tmp_path / "both"
    shutil.copytree(llama_dir, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    torch.save({k: 2 * v for k, v in tensors.items()}, ckpt / "pytorch_model.bin")
    name = "model.norm.weight"

    def loaded(load_format: str) -> torch.Tensor:
        model = get_model(_config(str(ckpt), load_format=load_format))
        return dict(model.named_parameters())[name]

    assert torch.equal(loaded("auto"), tensors[name])
    assert torch.equal(loaded("safetensors"), tensors[name])
    assert torch.equal(loaded("pt"), 2 * tensors[name])

    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").rename(ckpt / "model.pt")
    assert torch.equal(loaded("auto"), 2 * tensors[name])
    assert torch.equal(loaded("pt"), 2 * tensors[name])
    with pytest.raises(ValueError, match=rf"\*\.safetensors.*{ckpt}.*load_format='safetensors'"):
        loaded("safetensors")


def test_unknown_load_format_is_refused(llama_dir):
    with pytest.raises(ValueError, match=r"load_format='npcache'.*'auto', 'safetensors', 'pt'"):
        _config(llama_dir, load_format="npcache")


def test_cli_flags():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    argv = ["--load-format", "dummy", "--tokenizer-mode", "slow"]
    args = parser.parse_args([*argv, "--hf-overrides", '{"num_hidden_layers": 1}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.load_format == "dummy"
    assert engine_args.tokenizer_mode == "slow"
    assert engine_args.hf_overrides == {"num_hidden_layers": 1}
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "[1]"])


# ---- hf_overrides ---------------------------------------------------------------------------


def test_one_layer_override_matches_transformers(llama_dir):
    from transformers import AutoModelForCausalLM

    llm = _llm(llama_dir, hf_overrides={"num_hidden_layers": 1})
    assert llm.llm_engine.model_config.num_layers == 1
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, num_hidden_layers=1)
    assert len(hf.model.layers) == 1
    expected = []
    with torch.no_grad():
        for ids in PROMPTS:
            inp = torch.tensor([ids])
            out = hf.eval().generate(
                inp,
                attention_mask=torch.ones_like(inp),
                do_sample=False,
                max_new_tokens=MAX_NEW,
                pad_token_id=0,
                eos_token_id=None,
            )
            expected.append(out[0, len(ids) :].tolist())
    assert _greedy(llm) == expected


def test_overrides_come_before_derived_values(llama_dir):
    config = _config(llama_dir, hf_overrides={"max_position_embeddings": 64})
    assert config.model_config.max_model_len == config.scheduler_config.max_model_len == 64
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        _config(llama_dir, hf_overrides={"max_position_embeddings": 64}, max_model_len=100)
    # A dict value updates a dict-valued attribute key by key.
    hf = _config(llama_dir).model_config.hf_config
    key = "rope_parameters" if getattr(hf, "rope_parameters", None) else "rope_scaling"
    rope = getattr(hf, key)
    merged = _config(llama_dir, hf_overrides={key: {"factor": 2.0}}).model_config.hf_config
    assert getattr(merged, key) == {**rope, "factor": 2.0} != rope
    # A callable returns the config to use.
    config = _config(llama_dir, hf_overrides=lambda c: apply_hf_overrides(c, {"vocab_size": 7}))
    assert config.model_config.vocab_size == 7
    with pytest.raises(ValueError, match=r"hf_overrides=\[1\]"):
        _config(llama_dir, hf_overrides=[1])


def test_nested_override_updates_a_sub_config():
    config = CheckpointConfig(text_config=CheckpointConfig(a=1, b=2), extra={"x": {"y": 1}})
    apply_hf_overrides(config, {"text_config": {"a": 3}, "extra": {"x": {"z": 2}}, "c": 4})
    assert (config.text_config.a, config.text_config.b, config.c) == (3, 2, 4)
    assert config.extra == {"x": {"y": 1, "z": 2}}


# ---- tokenizer_mode -------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["mistral", "fast"])
def test_unknown_tokenizer_mode_is_refused(llama_dir, mode):
    with pytest.raises(ValueError, match=rf"tokenizer_mode='{mode}'.*'auto', 'hf', 'slow'"):
        _config(llama_dir, tokenizer_mode=mode)


def test_hf_mode_is_the_auto_tokenizer(llama_dir):
    llm = _llm(llama_dir, tokenizer_mode="hf")
    assert llm.llm_engine.model_config.tokenizer_mode == "hf"
    text = "def add(a, b): return a + b"
    assert llm.get_tokenizer().encode(text) == get_tokenizer(llama_dir).encode(text)


def test_slow_mode_refuses_a_fast_only_tokenizer(llama_dir, monkeypatch):
    """The tiny checkpoint has a fast tokenizer only: LLM, the async engine (its front end)
    and the structured-output manager (the engine core) each refuse it by name."""
    import pagedllm.transformers_utils.tokenizer as tokenizer_module
    from pagedllm.engine.async_llm import AsyncLLM
    from pagedllm.structured_output.manager import StructuredOutputManager

    with pytest.raises(ValueError, match="tokenizer_mode='slow'"):
        _llm(llama_dir, tokenizer_mode="slow")
    config = _config(llama_dir, tokenizer_mode="slow")
    with pytest.raises(ValueError, match="tokenizer_mode='slow'"):
        _ = StructuredOutputManager(config).backend

    class Stop(Exception):
        pass

    def no_engine(start, name, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(tokenizer_module, "get_tokenizer_while", no_engine)
    with pytest.raises(Stop, match="'tokenizer_mode': 'slow'"):
        AsyncLLM(config)


def test_slow_mode_loads_a_slow_tokenizer(llama_dir, tmp_path, monkeypatch):
    """A byte-level tokenizer transformers only has as a slow (Python) class: "slow" asks
    for it with use_fast=False and gets it."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    ByT5Tokenizer().save_pretrained(tmp_path)
    calls = []
    original = AutoTokenizer.from_pretrained

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy)
    llm = _llm(llama_dir, tokenizer=str(tmp_path), tokenizer_mode="slow")
    assert calls and calls[-1]["use_fast"] is False
    tokenizer = llm.get_tokenizer()
    assert not tokenizer.is_fast
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate(["hello"], params, use_tqdm=False)
    assert out.prompt_token_ids == tokenizer("hello").input_ids
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "quantization_config, method",
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
        (
            {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8}},
            "compressed-tensors",
        ),
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
    ],
)
def test_a_quantized_checkpoint_is_refused_by_its_method(
    tmp_path, llama_dir, quantization_config, method
):
    """A checkpoint another tool quantized (its tensors fp8 or packed, with scales pagedllm
    would not read) is refused by name at start-up, before any weight is loaded, not after
    the first unknown tensor; the same checkpoint without quantization_config loads."""
    import json

    model = tmp_path / "quantized"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config})
    )
    with pytest.raises(ValueError, match=f"quantization_config, quant_method='{method}'"):
        _config(str(model))
    assert _config(llama_dir).model_config.quantization is None
