"""pagedllm's model code against transformers on the same tiny fp32 checkpoints.

Several requests run as one flattened sequence through the real paged attention backend: a
full prefill, a decode step reusing the KV cache, then a multi-token step over cached context;
every token's logits must match transformers run on each request alone.
"""

from __future__ import annotations

import pytest
import torch

from pagedllm.attention.backend import CommonAttentionMetadata
from pagedllm.attention.layer import allocate_kv_caches
from pagedllm.attention.torch_backend import TorchAttentionBackend
from pagedllm.models.loader import get_model
from pagedllm.testing.demo_model import TINY_ARCH_OVERRIDES

BLOCK_SIZE = 16
NUM_BLOCKS = 16
ATOL = 1e-4


class PagedBatchRunner:
    """A minimal model runner: per-request block lists and context lengths; `step` runs the
    given new tokens of every request as one flattened batch and returns per-request logits."""

    def __init__(self, model: torch.nn.Module, num_reqs: int) -> None:
        self.model = model
        self.backend = TorchAttentionBackend()
        allocate_kv_caches(
            model, self.backend, NUM_BLOCKS, BLOCK_SIZE, torch.float32, torch.device("cpu")
        )
        # Hand blocks out from the top of the pool so block ids differ from request order.
        self.free_blocks = list(range(NUM_BLOCKS))
        self.blocks: list[list[int]] = [[] for _ in range(num_reqs)]
        self.lens = [0] * num_reqs

    def step(self, new_tokens: list[list[int]]) -> list[torch.Tensor] | None:
        input_ids, positions, slots, qsl = [], [], [], [0]
        for r, toks in enumerate(new_tokens):
            start = self.lens[r]
            self.lens[r] += len(toks)
            while len(self.blocks[r]) * BLOCK_SIZE < self.lens[r]:
                self.blocks[r].append(self.free_blocks.pop())
            for p in range(start, self.lens[r]):
                slots.append(self.blocks[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            positions += range(start, self.lens[r])
            input_ids += toks
            qsl.append(len(input_ids))
        width = max(len(b) for b in self.blocks)
        table = torch.tensor([b + [0] * (width - len(b)) for b in self.blocks], dtype=torch.int32)
        common = CommonAttentionMetadata(
            num_reqs=len(new_tokens),
            num_actual_tokens=len(input_ids),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            query_start_loc_cpu=qsl,
            seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            seq_lens_cpu=list(self.lens),
            block_table=table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            max_query_len=max(len(t) for t in new_tokens),
            max_seq_len=max(self.lens),
            block_size=BLOCK_SIZE,
        )
        meta = self.backend.build_metadata(common)
        with torch.no_grad():
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.int64),
                torch.tensor(positions, dtype=torch.int64),
                meta,
            )  # [T, hidden]
            logits = self.model.compute_logits(hidden)  # [T, vocab]
        if logits is None:  # a tensor-parallel rank other than the first gets none
            return None
        assert logits.dtype == torch.float32
        return [logits[qsl[r] : qsl[r + 1]] for r in range(len(new_tokens))]


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [len, vocab]


@pytest.mark.parametrize("arch", sorted(TINY_ARCH_OVERRIDES))
def test_prefill_and_decode_match_transformers(arch, tiny_model_dirs, make_engine_config):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_dirs[arch]
    config = make_engine_config(model_dir)
    model = get_model(config)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = config.model_config.vocab_size

    gen = torch.Generator().manual_seed(1)
    prompt_lens = [5, 37, 16]  # shorter than, longer than and exactly one block
    seqs = [torch.randint(8, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
    runner = PagedBatchRunner(model, len(seqs))

    # 1) Prefill of all prompts in one flattened batch: every position's logits.
    outs = runner.step(seqs)
    for ids, out in zip(seqs, outs):
        ref = _hf_logits(hf_model, ids)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert outs[0][-1].std() > 1.0, "demo model logits should not be nearly uniform"

    # 2) One decode step per request (greedy next token), attending over the paged cache.
    new = [[int(out[-1].argmax())] for out in outs]
    outs = runner.step(new)
    for r in range(len(seqs)):
        seqs[r] = seqs[r] + new[r]
        torch.testing.assert_close(
            outs[r][-1], _hf_logits(hf_model, seqs[r])[-1], atol=ATOL, rtol=0
        )

    # 3) Several new tokens per request over cached context (chunked-prefill / spec shape).
    new = [torch.randint(8, vocab, (k,), generator=gen).tolist() for k in (3, 1, 20)]
    outs = runner.step(new)
    for r in range(len(seqs)):
        seqs[r] = seqs[r] + new[r]
        ref = _hf_logits(hf_model, seqs[r])[-len(new[r]) :]
        torch.testing.assert_close(outs[r], ref, atol=ATOL, rtol=0)
