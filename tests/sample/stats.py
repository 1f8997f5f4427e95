"""Goodness-of-fit helper shared by the sampling tests."""

import torch


def chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of `draws` against the expected `probs` (zero-probability bins
    must be empty)."""
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    assert counts[probs == 0].sum() == 0, "drew a token with probability 0"
    expected = probs.double() * draws.numel()
    mask = probs > 0
    return float(((counts[mask] - expected[mask]) ** 2 / expected[mask]).sum())


# Upper 0.1% points of chi-square with df = 1..7, so a correct sampler fails 1 in 1000 runs
# at most (and never here: the global RNG is seeded).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
