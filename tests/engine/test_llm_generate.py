"""End to end through `LLM.generate`: the transformers oracle, and every engine feature
(prefix caching, chunked prefill, preemption, priority scheduling) leaves greedy output
unchanged."""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

MAX_NEW = 12


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]], params=None) -> list[list[int]]:
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params or _greedy(), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_greedy_matches_transformers(model_dirs, arch):
    model_dir = model_dirs[arch]
    llm = LLM(model=model_dir, dtype="float32", kv_cache_memory=8 << 20)
    assert llm.llm_engine.model_config.dtype == torch.float32  # vLLM's place for it
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = _prompts(vocab, [5, 17, 33, 64])
    assert _run(llm, prompts) == hf_greedy(model_dir, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def shared_llm(llama_dir):
    return LLM(model=llama_dir, dtype="float32")


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Greedy outputs of a plain engine (no caching, whole prompts in one step)."""
    llm = LLM(model=llama_dir, dtype="float32", enable_prefix_caching=False)
    vocab = llm.llm_engine.config.model_config.vocab_size
    # Prompts sharing a 40-token prefix, so prefix caching has something to hit.
    shared = _prompts(vocab, [40], seed=1)[0]
    prompts = [shared + p for p in _prompts(vocab, [3, 20, 37, 50], seed=2)]
    prompts += _prompts(vocab, [7, 90], seed=3)
    return prompts, _run(llm, prompts, _greedy(20))


def test_prefix_caching_keeps_output(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(model=llama_dir, dtype="float32", enable_prefix_caching=True)
    assert _run(llm, prompts[:1], _greedy(20)) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # Every prompt after the first shares 2 full blocks (32 tokens) with it.
    assert all(o.num_cached_tokens >= 32 for o in outs[1:4])


def test_chunked_prefill_keeps_output(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        enable_prefix_caching=False,
        max_num_batched_tokens=16,
        long_prefill_token_threshold=8,
    )
    assert _run(llm, prompts, _greedy(20)) == expected


def test_preemption_keeps_output(llama_dir, reference):
    prompts, expected = reference
    # 10 blocks of 16 tokens: the batch cannot all fit, so requests get preempted.
    llm = LLM(
        model=llama_dir,
        dtype="float32",
        num_gpu_blocks_override=10,
        max_model_len=160,
        enable_prefix_caching=True,
    )
    assert _run(llm, prompts, _greedy(20)) == expected
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    assert scheduler.num_preemptions_total > 0


def test_priority_scheduling_keeps_output(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(model=llama_dir, dtype="float32", scheduling_policy="priority", max_num_seqs=2)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        _greedy(20),
        use_tqdm=False,
        priority=list(range(len(prompts), 0, -1)),
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_batch_equals_single(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(model=llama_dir, dtype="float32")
    for p, e in zip(prompts[:3], expected[:3]):
        assert _run(llm, [p], _greedy(20)) == [e]


def test_text_prompts_stop_strings_and_n(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32")
    out = llm.generate("Hello world", _greedy(16), use_tqdm=False)[0]
    assert out.prompt == "Hello world"
    text = out.outputs[0].text
    assert len(out.outputs[0].token_ids) == 16
    assert text == llm.get_tokenizer().decode(out.outputs[0].token_ids, skip_special_tokens=True)
    # A stop string taken from the middle of that text: output is cut just before it.
    if len(text) >= 6:
        stop = text[3:6]
        cut = llm.generate(
            "Hello world",
            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop]),
            use_tqdm=False,
        )[0]
        assert cut.outputs[0].finish_reason == "stop"
        assert cut.outputs[0].stop_reason == stop
        assert cut.outputs[0].text == text[: text.find(stop)]
    many = llm.generate(
        "Hello world", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8), use_tqdm=False
    )[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert all(1 <= len(c.token_ids) <= 8 for c in many.outputs)


def test_seeded_sampling_is_reproducible(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32")
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=123, max_tokens=10, ignore_eos=True)
    a = llm.generate(["abc", "de"], params, use_tqdm=False)
    b = llm.generate(["de", "abc"], params, use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[1].outputs[0].token_ids
    assert a[1].outputs[0].token_ids == b[0].outputs[0].token_ids


def test_stop_token_ids_and_max_tokens(llama_dir, reference):
    prompts, expected = reference
    llm = LLM(model=llama_dir, dtype="float32")
    target = expected[0][5]
    first = expected[0].index(target)
    out = llm.generate(
        {"prompt_token_ids": prompts[0]},
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[target]),
        use_tqdm=False,
    )
    c = out[0].outputs[0]
    assert c.token_ids == expected[0][: first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == target
    c = _run(llm, [prompts[0]], _greedy(3))[0]
    assert c == expected[0][:3]


def test_logprobs(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32")
    out = llm.generate(
        "Hello",
        SamplingParams(
            temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=2, ignore_eos=True
        ),
        use_tqdm=False,
    )[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for tok, lp in zip(c.token_ids, c.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(lp) <= 4
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs))
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp


def test_chat(llama_dir):
    llm = LLM(model=llama_dir, dtype="float32")
    out = llm.chat([{"role": "user", "content": "Hi there"}], _greedy(5), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], add_generation_prompt=True, tokenize=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)

    # tools and chat_template_kwargs reach the template, as the server passes them; content
    # given as text parts renders like the plain string.
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}]
    with_tools = llm.chat(parts, _greedy(1), use_tqdm=False, tools=tools)[0]
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}], tools=tools, add_generation_prompt=True
    )
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert with_tools.prompt_token_ids == list(expected) != out.prompt_token_ids
    assert "get_weather" in tok.decode(with_tools.prompt_token_ids)
    with pytest.raises(ValueError, match="image_url"):
        llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], use_tqdm=False)
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], use_tqdm=False)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [10**7]}, SamplingParams(), "vocabulary"),
        ({"prompt_token_ids": [5] * 600}, SamplingParams(), "max_model_len"),
        ("hi", SamplingParams(logprobs=50), "logprobs"),
    ],
)
def test_bad_input_raises_before_scheduling(shared_llm, prompt, params, match):
    llm = shared_llm
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    # The engine still serves.
    assert len(llm.generate("ok", _greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_unknown_engine_argument(llama_dir):
    with pytest.raises(ValueError, match="max_num_seq"):
        LLM(model=llama_dir, max_num_seq=4)


def test_text_after_prompt_ending_mid_character(shared_llm):
    """A token-id prompt may end inside a multi-byte character: its dangling bytes must not
    leak into the output text, which is exactly the decode of the output tokens."""
    tok = shared_llm.get_tokenizer()
    # Byte-level BPE: the first byte of a 3-byte character alone is an incomplete sequence.
    lead_byte = [t for t in tok.encode("\u20ac", add_special_tokens=False)][:1]
    assert tok.decode(lead_byte).endswith("\ufffd")
    prompt = tok.encode("Hello world", add_special_tokens=False) + lead_byte
    out = shared_llm.generate({"prompt_token_ids": prompt}, _greedy(8), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("gen", "expected"),
    [
        ({}, {}),
        ({"do_sample": False}, {"temperature": 0.0}),
        ({"do_sample": None, "top_p": 0.9}, {"top_p": 0.9}),
        (
            {"do_sample": False, "temperature": 0.6, "max_new_tokens": 32, "bos_token_id": 1},
            {"temperature": 0.6, "max_tokens": 32},
        ),
    ],
)
def test_generation_config_defaults(gen, expected):
    """One reading of generation_config.json for `LLM` and the server."""
    from types import SimpleNamespace

    from pagedllm.config import ModelConfig

    assert ModelConfig.get_diff_sampling_param(SimpleNamespace(generation_config=gen)) == expected
