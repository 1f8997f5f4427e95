"""Model-based proposers keep their own KV right: the drafts proposed for a sequence after many
incremental steps (chunked prefill, rejected drafts rolled back, other requests in the batch)
equal those proposed for the same sequence computed from scratch in one prefill. Also the
checkpoint formats load, and `DraftSampler` draws drafts from q where it must."""

from __future__ import annotations

import types

import pytest
import torch

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.spec_decode.proposer import DraftSampler
from pagedllm.spec_decode.testing import make_medusa_heads
from pagedllm.worker import model_runner

K = 3
KV_BYTES = 16 << 20


def _record_proposals(monkeypatch) -> list[tuple[tuple[int, ...], list[int]]]:
    """(request's tokens, drafts proposed for it) for every proposal from now on."""
    records: list[tuple[tuple[int, ...], list[int]]] = []
    run = model_runner.run_proposer

    def recording(proposer, batch):
        out = run(proposer, batch)
        for i in batch.sample_idx.tolist():
            records.append((tuple(batch.states[i].token_ids), out.token_ids[i]))
        return out

    monkeypatch.setattr(model_runner, "run_proposer", recording)
    return records


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("method", ["draft_model", "eagle", "medusa"])
def test_incremental_drafts_equal_drafts_from_scratch(
    method, target_dir, spec_configs, monkeypatch
):
    records = _record_proposals(monkeypatch)
    llm = LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        max_num_batched_tokens=16,  # 30-token prompts prefill over two steps
        speculative_config=spec_configs[method],
    )
    prompts = [list(range(40, 70)), list(range(300, 330))]
    llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(20), use_tqdm=False)
    # Sequences whose drafts were not capped by max_tokens, every third step.
    checks = [(tokens, drafts) for tokens, drafts in records if len(drafts) == K][::3]
    assert len(checks) >= 4
    records.clear()
    fresh = LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        speculative_config=spec_configs[method],
    )
    # Prompt = the sequence minus its last token: the prefill samples that token again
    # (greedy) and proposes from a KV cache filled in one go.
    fresh.generate(
        [{"prompt_token_ids": list(tokens[:-1])} for tokens, _ in checks],
        _greedy(K + 2),
        use_tqdm=False,
    )
    from_scratch = {}
    for tokens, drafts in records:
        from_scratch.setdefault(tokens, drafts)
    assert [from_scratch[tokens] for tokens, _ in checks] == [d for _, d in checks]


def test_medusa_original_checkpoint_layout(tmp_path, target_dir):
    heads = make_medusa_heads(
        tmp_path / "m", target_dir, num_heads=2, num_layers=2, layout="original"
    )
    llm = LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        speculative_config={"model": heads, "num_speculative_tokens": 2},  # method inferred
    )
    proposer = llm.llm_engine.engine_core.engine_core.executor.worker.model_runner.drafter
    assert type(proposer).__name__ == "MedusaProposer"
    assert len(proposer.model.blocks) == 2 and len(proposer.model.blocks[0].layers) == 2
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], _greedy(6), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


# ---- the heads' math against plain transformers / torch references ---------------------------


def _target_features(target_dir: str, tokens: list[int]):
    """(transformers model, its final-norm hidden states [M, H] for `tokens`)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        feats = model.model(input_ids=torch.tensor([tokens])).last_hidden_state[0]
    return model, feats


def _eagle_reference(target_dir: str, eagle_dir: str, tokens: list[int], k: int) -> list[int]:
    """EAGLE-1 drafting written densely: rows (e(t_{p+1}), f_p) for p < M - 1, then each
    draft appends the row (e(d), predicted feature) and reruns the whole sequence."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    target, feats = _target_features(target_dir, tokens)
    config = AutoConfig.from_pretrained(eagle_dir)
    config._attn_implementation = "sdpa"
    weights = load_file(f"{eagle_dir}/model.safetensors")
    layer = LlamaDecoderLayer(config, layer_idx=0).eval()
    layer.input_layernorm = torch.nn.Identity()
    state = {
        n.removeprefix("layers.0."): w for n, w in weights.items() if n.startswith("layers.0.")
    }
    layer.load_state_dict(state, strict=True)
    rotary = LlamaRotaryEmbedding(config=config)
    embed = target.model.embed_tokens
    with torch.no_grad():
        row_embeds = embed(torch.tensor(tokens[1:]))
        row_feats = feats[:-1]
        drafts = []
        for _ in range(k):
            x = torch.cat([row_embeds, row_feats], dim=-1) @ weights["fc.weight"].T
            pos = torch.arange(x.shape[0])[None]
            out = layer(x[None], position_ids=pos, position_embeddings=rotary(x[None], pos))[0]
            token = int(target.lm_head(out[-1]).argmax())
            drafts.append(token)
            row_embeds = torch.cat([row_embeds, embed(torch.tensor([token]))])
            row_feats = torch.cat([row_feats, out[-1:]])
    return drafts


def _medusa_reference(target_dir: str, medusa_dir: str, tokens: list[int], k: int) -> list[int]:
    import torch
    from safetensors.torch import load_file

    _, feats = _target_features(target_dir, tokens)
    w = load_file(f"{medusa_dir}/model.safetensors")
    h = feats[-2]  # the position whose logits produced the last token
    drafts = []
    for i in range(k):
        x = h
        x = x + torch.nn.functional.silu(
            w[f"blocks.{i}.layers.0.weight"] @ x + w[f"blocks.{i}.layers.0.bias"]
        )
        drafts.append(int((w[f"lm_heads.{i}.weight"] @ x).argmax()))
    return drafts


@pytest.mark.parametrize("method", ["eagle", "medusa"])
def test_heads_match_a_dense_reference(
    method, target_dir, eagle_dir, medusa_dir, spec_configs, monkeypatch
):
    records = _record_proposals(monkeypatch)
    llm = LLM(
        model=target_dir,
        dtype="float32",
        kv_cache_memory=KV_BYTES,
        speculative_config=spec_configs[method],
    )
    llm.generate([{"prompt_token_ids": list(range(40, 61))}], _greedy(12), use_tqdm=False)
    checks = [(tokens, drafts) for tokens, drafts in records if len(drafts) == K][:3]
    assert checks
    for tokens, drafts in checks:
        if method == "eagle":
            assert drafts == _eagle_reference(target_dir, eagle_dir, list(tokens), K)
        else:
            assert drafts == _medusa_reference(target_dir, medusa_dir, list(tokens), K)


def _state(seed: int | None = None, **params) -> types.SimpleNamespace:
    generator = None
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
    return types.SimpleNamespace(sampling_params=SamplingParams(**params), generator=generator)


def test_draft_sampler_samples_q_only_for_sampling_unstructured_requests():
    """Greedy and structured requests get argmax drafts and no q; a sampling request draws
    from q = its temperature / top-k applied to the draft logits, and gets q back."""
    torch.manual_seed(0)
    vocab = 50
    states = [
        _state(temperature=0.0),
        _state(seed=1, temperature=0.5, top_k=3),
        _state(temperature=1.0, structured_outputs=StructuredOutputsParams(choice=["a"])),
    ]
    draw = DraftSampler(states, [2, 2, 2], torch.device("cpu"))
    logits = [torch.randn(3, vocab) for _ in range(2)]
    tokens = [draw(x.clone()) for x in logits]
    proposal = draw.proposal(tokens)
    assert proposal.probs[0] is None and proposal.probs[2] is None
    for row in (0, 2):
        assert proposal.token_ids[row] == [int(x[row].argmax()) for x in logits]
    q = proposal.probs[1]  # [2, V]
    for j, x in enumerate(logits):
        top3 = x[1].topk(3).indices
        expected = torch.zeros(vocab)
        expected[top3] = torch.softmax(x[1][top3] / 0.5, dim=0)
        torch.testing.assert_close(q[j], expected)
        assert proposal.token_ids[1][j] in top3.tolist()


def test_draft_sampler_seeded_draws_depend_only_on_the_request():
    """A seeded request draws once per draft it may keep, from its own generator: the same
    drafts whatever the batch around it and however many drafts the others get."""
    vocab = 40
    logits = torch.randn(3, 2, vocab)  # [steps, requests, V]

    def drafts(states, limits, rows):
        draw = DraftSampler(states, limits, torch.device("cpu"))
        return draw.proposal([draw(x[rows].clone()) for x in logits]).token_ids

    alone = drafts([_state(seed=7, temperature=1.0)], [2], [0])[0]
    crowded = drafts([_state(temperature=1.0), _state(seed=7, temperature=1.0)], [3, 2], [1, 0])[1]
    assert alone == crowded and len(alone) == 2
    # Two draws taken from the generator, not three.
    generator = torch.Generator().manual_seed(7)
    torch.rand(2, generator=generator)
    state = _state(seed=7, temperature=1.0)
    drafts([state], [2], [0])
    assert torch.equal(state.generator.get_state(), generator.get_state())
