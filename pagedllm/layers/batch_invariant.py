"""Batch-invariant mode (`batch_invariant=True`, `--batch-invariant`, `PAGEDLLM_BATCH_INVARIANT=1`):
a request's tokens and logprobs are bitwise the same whether it runs alone or batched with
any other requests (greedy, or seeded sampling).

Where the batch changes numerics on the default path, and what the mode does instead:

- GEMMs: oneDNN / MKL pick their kernel, blocking and thread split from the row count M (a
  GEMV for M = 1, other tiles for larger M; rows whose addresses differ in alignment may be
  peeled), so a row's K-reduction order depends on the batch. The mode multiplies row by row
  (M = 1, each row copied to a fresh, aligned buffer): every row takes the one kernel the
  M = 1 shape selects. (pagedllm's own panel GEMM, `ops/csrc/gemm.h`, has an M-independent
  order by design; it goes row by row too, which costs it nothing in numerics.)
- Attention: the default backends pad keys to the longest request of a group, group decodes
  by length, send decodes to one kernel and prefill chunks (with or without cached context)
  to others, each with its own split of the keys. The mode's backend
  (`attention/batch_invariant_backend.py`) computes every query row the same way, whatever
  its step holds: dot products and both softmax sums as sequential `cumsum`s read at the
  row's own last key, the max exactly, exp by `det_exp`. A row therefore gets the same bits
  in a prefill, a prefill chunk, a decode, after a prefix-cache hit or after a preemption's
  recompute, so chunked prefill and prefix caching stay on.
- exp: ATen's vectorized exp runs its SIMD code on whole vectors and scalar code on a
  tensor's tail (and on thread-chunk tails), so an element's result can depend on where it
  sits in the batch tensor. `det_exp` builds exp from IEEE +, *, round and exponent bits,
  which give the same bits in every lane.
- RMSNorm: its mean of squares becomes a sequential `cumsum` (ATen may split a lone row's
  reduction across threads, or vectorize it differently).
- Sampling: each seeded request draws from its own generator (always so); the weights of the
  inverse-CDF draw use `det_exp`. A preempted request restarts with a fresh generator (its
  stream would replay from the start), and preemption depends on the load: the mode seeds
  the generator before each token from (seed, token index) instead (`reseed_for_token`).
  Unseeded sampling draws from the engine's shared generator, so it depends on the batch by
  nature.

One residual: min_p's threshold uses `log(min_p)` over the batch's rows, whose last bit can
depend on the row's lane; it moves only tokens whose logit sits within an ulp of the
threshold.

Row kernels that stay as they are (already per row, fixed order): the native RoPE, SiLU x
mul and the embedding gather; log_softmax (ATen's last-dimension kernel reduces each row on
its own). The engine refuses what it cannot vouch for (arg_utils: CUDA, torch.compile,
speculative decoding, tensor / pipeline parallelism, another attention backend).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

BATCH_INVARIANT_ENV = "PAGEDLLM_BATCH_INVARIANT"

_LOG2E = 1.4426950408889634
# ln 2 split so that n * _LN2_HI is exact for |n| < 2^11 (Cody-Waite range reduction).
_LN2_HI = 0.693145751953125
_LN2_LO = 1.4286068203094173e-06
# 1 / k! for the Taylor polynomial of exp on |r| <= ln2 / 2 (error < 2e-14 relative).
_EXP_COEFFS = tuple(1.0 / math.factorial(k) for k in range(11, -1, -1))


def make_batch_invariant_(model: torch.nn.Module) -> None:
    """Mark the layers whose numerics depend on the batch (linears, the LM head, RMSNorm) to
    take their batch-invariant path (a transform applied to a loaded model)."""
    from pagedllm.layers.layernorm import RMSNorm
    from pagedllm.layers.linear import LinearBase
    from pagedllm.layers.vocab_embedding import VocabParallelEmbedding

    for module in model.modules():
        if isinstance(module, (LinearBase, VocabParallelEmbedding, RMSNorm)):
            module.batch_invariant = True


def linear_by_rows(
    linear: Callable[[torch.Tensor], torch.Tensor], flat: torch.Tensor
) -> torch.Tensor:
    """`linear(flat)` for `flat [M, K]`, computed one row at a time (M = 1 calls on aligned
    copies), so a row's result never depends on the others."""
    if flat.shape[0] <= 1:
        return linear(flat.clone())
    return torch.cat([linear(flat[i : i + 1].clone()) for i in range(flat.shape[0])])


def det_exp(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in x's dtype, with bits that depend on the element alone (not on its place in
    the tensor): range reduction and a Horner polynomial in float64, one exact IEEE op at a
    time, and 2^n from the exponent bits; accurate to float32's rounding of exp."""
    # Below -200, exp is 0 in float32 (and far above float64's denormals, which are slow).
    xd = x.to(torch.float64).clamp(-200.0, 709.0)
    n = torch.round(xd * _LOG2E)
    r = (xd - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_COEFFS[0])
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    scale = ((n.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2^n from its bits
    return (p * scale).to(x.dtype)


def reseed_for_token(generator: torch.Generator, seed: int, index: int) -> None:
    """Seed `generator` for a request's output token `index` from its `seed` alone, so the
    draw is the same after a preemption (which restarts the request's generator)."""
    generator.manual_seed((seed * 0x9E3779B97F4A7C15 + index + 1) % (1 << 64))


def mean_of_squares(xf: torch.Tensor) -> torch.Tensor:
    """`xf.pow(2).mean(-1, keepdim=True)` summed in a fixed sequential order per row."""
    return (xf * xf).cumsum(-1)[..., -1:] / xf.shape[-1]
