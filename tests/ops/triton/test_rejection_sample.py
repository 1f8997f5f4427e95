"""The Triton accept / recover step draws what the rejection sampler's PyTorch path draws from
the same uniforms: with and without draft distributions, bonus rows, seeded rows, and a row
whose residual is empty."""

from __future__ import annotations

import pytest
import torch

from pagedllm.sample import ops
from pagedllm.spec_decode.rejection_sampler import accept_and_recover_torch
from tests.ops.triton.devices import TRITON_DEVICES


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("vocab_size", [40, 1500])
@pytest.mark.parametrize("with_q", [False, True])
def test_same_draws_as_torch_path(device, vocab_size, with_q):
    from pagedllm.ops.triton.rejection_sample import accept_and_recover

    gen = torch.Generator().manual_seed(vocab_size + with_q)
    num_rows = 8
    probs = (torch.randn(num_rows, vocab_size, generator=gen) * 2).softmax(-1)
    probs[3, vocab_size // 2 :] = 0.0  # a top-k/top-p-masked row
    probs[3] /= probs[3].sum()
    drafts = torch.randint(0, vocab_size, (num_rows,), generator=gen)
    is_draft = torch.tensor([True, True, False, True, True, True, True, False])
    # Drafts the target likes (rows 0-3) and ones it does not (4-6): both outcomes happen.
    drafts[:4] = probs[:4].argmax(-1)
    drafts[4:7] = probs[4:7].argmin(-1)
    q = None
    if with_q:
        q = (torch.randn(num_rows, vocab_size, generator=gen) * 2).softmax(-1)
        q[4:7] *= 0.5
        q[torch.arange(4, 7), drafts[4:7]] += 0.5
        q[5] = probs[5]  # p == q: empty residual, the draft is accepted

    def run(fn):
        torch.manual_seed(7)
        generators = {1: torch.Generator().manual_seed(3)}
        u = ops.uniform(num_rows, generators, "cpu")
        return fn(generators, u)

    ref_accept, ref_recovered = run(
        lambda g, u: accept_and_recover_torch(probs, drafts, is_draft, q, u, g)
    )

    def triton_path(generators, u):
        u_recover = ops.uniform(num_rows, generators, "cpu")

        def to(t):
            return None if t is None else t.to(device)

        out = accept_and_recover(to(probs), to(drafts), to(is_draft), to(q), to(u), to(u_recover))
        return [t.cpu() for t in out]

    accept, recovered = run(triton_path)
    assert torch.equal(accept, ref_accept)
    assert torch.equal(recovered, ref_recovered)
    assert not accept[~is_draft].any()
    assert ref_accept.any() and not ref_accept[is_draft].all()  # both outcomes exercised
    # A recovered token never has zero residual weight.
    residual = probs.scatter(1, drafts[:, None], 0.0) if q is None else (probs - q).clamp_min(0)
    residual = torch.where(is_draft[:, None], residual, probs)
    rows = torch.arange(num_rows)[~accept]
    assert (residual[rows, recovered[rows]] > 0).all()
    if with_q:
        assert accept[5]
