"""`LLM.beam_search` end to end (tiny Llama, fp32) against a plain beam search over
transformers' logits with vLLM's rules (2 * beam_width candidates per beam by raw
log-softmax, EOS candidates finish, length-penalised final ranking)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, BeamSearchParams
from pagedllm.beam_search import get_beam_search_score

PROMPTS = [list(range(5, 5 + 21)), [11, 200, 37, 4, 90]]
MORE_PROMPTS = [list(range(300, 300 + 13)), [7, 8, 9, 400, 401, 402, 403, 404, 405]]


def hf_beam_search(model, prompt: list[int], params: BeamSearchParams, eos: int | None):
    """[(output tokens, cum logprob, finish reason)], best first."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    done: list[tuple[list[int], float, str]] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            batch = torch.tensor([prompt + out for out, _ in beams])
            logprobs = torch.log_softmax(model(batch).logits[:, -1].float(), dim=-1)
            top = logprobs.topk(params.num_candidates, dim=-1)
            candidates = []
            for (out, cum), ids, lps in zip(beams, top.indices.tolist(), top.values.tolist()):
                for t, lp in zip(ids, lps):
                    if t == eos and not params.ignore_eos:
                        done.append((out, cum + lp, "stop"))
                    else:
                        candidates.append((out + [t], cum + lp))
            candidates.sort(key=lambda c: -c[1])
            beams = candidates[: params.beam_width]
    done += [(out, cum, "length") for out, cum in beams]

    def score(h):
        return get_beam_search_score(prompt + h[0], h[1], eos, params.length_penalty)

    return sorted(done, key=score, reverse=True)[: params.beam_width]


@pytest.fixture(scope="module")
def eos_model_dir(llama_dir, tmp_path_factory) -> tuple[str, int]:
    """The tiny Llama with its EOS moved to its greedy second token after PROMPTS[1], so an
    EOS candidate (a finished hypothesis) shows up at the second step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        first = int(model(torch.tensor([PROMPTS[1]])).logits[0, -1].argmax())
        eos = int(model(torch.tensor([PROMPTS[1] + [first]])).logits[0, -1].argmax())
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    shutil.copytree(llama_dir, path, dirs_exist_ok=True)
    gen = json.loads((Path(path) / "generation_config.json").read_text())
    gen["eos_token_id"] = eos
    (Path(path) / "generation_config.json").write_text(json.dumps(gen))
    return str(path), eos


def _run(model_dir: str, prompts: list[list[int]], params: BeamSearchParams, **engine_kwargs):
    kwargs = {"max_model_len": 128, "block_size": 16, "kv_cache_memory": 4 << 20} | engine_kwargs
    llm = LLM(model_dir, dtype="float32", device="cpu", **kwargs)
    try:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        scheduler.check_integrity()
        assert scheduler.kv_cache_manager.usage == 0
        if "num_gpu_blocks_override" in engine_kwargs:
            assert scheduler.num_preemptions_total > 0
    finally:
        llm.shutdown()
    return outs


@pytest.mark.parametrize(
    "params,engine_kwargs",
    [
        (BeamSearchParams(beam_width=3, max_tokens=8), {}),
        # Chunked prefill (8-token chunks), no prefix caching, and a length penalty.
        (
            BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.6),
            {"max_num_batched_tokens": 8, "enable_prefix_caching": False},
        ),
        # A cache too small for all groups at once: groups are preempted and resumed.
        (
            BeamSearchParams(beam_width=3, max_tokens=12),
            {"num_gpu_blocks_override": 15, "block_size": 8, "max_model_len": 64},
        ),
    ],
)
def test_matches_transformers_reference(eos_model_dir, params, engine_kwargs):
    from transformers import AutoModelForCausalLM

    model_dir, eos = eos_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = PROMPTS + MORE_PROMPTS if "num_gpu_blocks_override" in engine_kwargs else PROMPTS
    outs = _run(model_dir, prompts, params, **engine_kwargs)
    saw_stop = False
    for prompt, out in zip(prompts, outs):
        expected = hf_beam_search(model, prompt, params, eos)
        got = out.sequences
        assert [s.tokens[len(prompt) :] for s in got] == [e[0] for e in expected]
        assert [s.finish_reason for s in got] == [e[2] for e in expected]
        for s, e in zip(got, expected):
            assert s.tokens[: len(prompt)] == prompt
            assert s.cum_logprob == pytest.approx(e[1], abs=1e-4)
            # Per step: the chosen token's logprob and the candidates scored there (as in
            # vLLM, a hypothesis ended by EOS keeps the EOS step's entry, not the token).
            chosen = s.tokens[len(prompt) :] + ([eos] if s.finish_reason == "stop" else [])
            assert len(s.logprobs) == len(chosen)
            assert len(s.logprobs[0]) == params.num_candidates
            lps = [lp[t].logprob for t, lp in zip(chosen, s.logprobs)]
            assert sum(lps) == pytest.approx(s.cum_logprob, abs=1e-4)
        saw_stop = saw_stop or any(s.finish_reason == "stop" for s in got)
    assert saw_stop, "the EOS model should finish some hypothesis with EOS"


def test_text_and_validation(llama_dir):
    llm = LLM(
        llama_dir, dtype="float32", device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
        max_num_seqs=4,
    )  # fmt: skip
    try:
        out = llm.beam_search(["hello there"], BeamSearchParams(beam_width=2, max_tokens=4))[0]
        tokenizer = llm.get_tokenizer()
        assert [s.text for s in out.sequences] == [
            tokenizer.decode(s.tokens) for s in out.sequences
        ]
        with pytest.raises(ValueError, match="beam_width=5 is more than max_num_seqs=4"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=5, max_tokens=2))
        with pytest.raises(ValueError, match="lora_request"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), lora_request=1)
        with pytest.raises(ValueError, match="beam_width must be"):
            BeamSearchParams(beam_width=0, max_tokens=2)
    finally:
        llm.shutdown()
