"""Logits-processing and sampling ops used by the `Sampler`: small stateless functions over a
batch.

Every logits op takes float32 `logits [B, V]` (one row per request that samples) plus per-row
parameters as tensors and returns the processed logits, working in place where it can (the
sampler owns its copy), so callers must use the returned tensor. Masked tokens are set to
`-inf`. The draws (`random_sample`, `random_sample_top_p`) and `argmax` return token ids. No op
reads a tensor back to the host, so a step never waits on the device here; the exceptions,
`apply_top_k_top_p_partial` and `random_sample_top_p`, are used on the CPU only, where that
costs nothing. Nothing here sorts a whole row on the CPU path.
"""

from __future__ import annotations

import torch

from pagedllm.ops import row_ops
from pagedllm.ops.triton import triton_usable

_NEG_INF = float("-inf")


def apply_allowed_token_ids(
    logits: torch.Tensor, restricted_rows: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Restrict each row in `restricted_rows [R]` to its allowed tokens: `mask [R, V]` is 0
    where row `restricted_rows[r]` may go and -inf elsewhere (an add leaves the allowed
    logits exactly as they were). Other rows are left alone."""
    if restricted_rows.shape[0] == logits.shape[0]:  # every row (rows are listed in order)
        return logits.add_(mask)
    logits[restricted_rows] = logits[restricted_rows].add_(mask)
    return logits


def apply_banned_tokens(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Set the (row, token) pairs `rows [N]`, `token_ids [N]` to -inf (min_tokens, bad words)."""
    logits[rows, token_ids] = _NEG_INF
    return logits


def apply_logit_bias(
    logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Add `bias [N]` to the (row, token) pairs `rows [N]`, `token_ids [N]`."""
    return logits.index_put_((rows, token_ids), bias, accumulate=True)


def apply_repetition_penalty(
    logits: torch.Tensor, token_ids: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """Repetition penalty on the tokens each row has seen (prompt and output): a positive
    logit is divided by the row's penalty `[B]`, a negative one multiplied by it, so a penalty
    above 1 always makes a repeat less likely.

    `token_ids [B, R]` lists each row's distinct seen tokens, padded by repeating one of them:
    a token listed twice gets the same new value twice, so the scatter stays exact. Touches
    only B x R entries, never all B x V.
    """
    values = logits.gather(1, token_ids)  # [B, R]
    scale = penalties[:, None]  # [B, 1]
    values = torch.where(values > 0, values / scale, values * scale)
    return logits.scatter_(1, token_ids, values)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    counts: torch.Tensor,
    frequency_penalties: torch.Tensor,
    presence_penalties: torch.Tensor,
) -> torch.Tensor:
    """OpenAI's penalties on the tokens each row has generated: subtract
    `frequency * count + presence` from each of them.

    `token_ids [B, U]` lists each row's distinct output tokens and `counts [B, U]` (float) how
    often each occurred; padding has count 0 and so adds nothing. Penalties are [B].
    """
    penalty = frequency_penalties[:, None] * counts + presence_penalties[:, None] * (counts > 0)
    return logits.scatter_add_(1, token_ids, penalty.neg_())


def apply_temperature(
    logits: torch.Tensor, temperature: torch.Tensor, in_place: bool = True
) -> torch.Tensor:
    """Divide each row by its temperature `[B]`; a 0 (a greedy row in a mixed batch) acts as 1.
    With `in_place=False` the result is a new tensor (the sampler's copy, made for free)."""
    temperature = torch.where(temperature > 0, temperature, 1.0)[:, None]  # [B, 1]
    return logits.div_(temperature) if in_place else logits / temperature


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p [B]` times the row's top probability.

    Done on logits, with no softmax: p_i < min_p * p_max  <=>  l_i < l_max + log(min_p).
    """
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log()[:, None]  # [B, 1]
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's `top_k [B]` largest logits, and every token tied with the k-th.

    `max_top_k` is the largest k < V in the batch: one partial `topk` of that size finds every
    row's threshold; rows whose k exceeds it (k = V: disabled) keep everything.
    """
    return logits.masked_fill_(logits < top_k_floor(logits, top_k, max_top_k), _NEG_INF)


def top_k_floor(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """`apply_top_k`'s threshold [B, 1]: each row's k-th largest logit (a logit below it is
    dropped), -inf where k exceeds `max_top_k` (top-k off). fp32 CPU rows: the native
    `top_k_floors`, one filtering pass a row (64 rows of 49k logits, k = 20: 0.5 ms against
    `torch.topk`'s 2-3 ms), the same values but where a row holds NaNs."""
    native = native_sampling(logits)
    if native is not None:
        return native.top_k_floors(logits, top_k.contiguous())[:, None]
    top_vals = logits.topk(max_top_k, dim=-1).values  # [B, max_top_k], descending
    kth = top_vals.gather(1, (top_k.clamp(max=max_top_k) - 1)[:, None])  # [B, 1]
    return kth.masked_fill_(top_k[:, None] > max_top_k, _NEG_INF)


def _nucleus_limit(top_p: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1]; p = 1 becomes inf so that float rounding in a cumsum that reaches 1 early
    can never drop a token of a row that disabled top-p."""
    return torch.where(top_p < 1.0, top_p, float("inf"))[:, None]


def apply_top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the fewest most-probable tokens whose mass reaches `top_p [B]`.

    A token is kept when the probability mass strictly ahead of it is < p, so the best token
    always survives; p = 1 disables it. Sorts whole rows: no host sync, but O(V log V) per row.
    """
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # [B, V] each
    probs = sorted_logits.softmax(dim=-1)
    mass_ahead = probs.cumsum(dim=-1) - probs  # [B, V]; exactly 0 for the best token
    sorted_logits.masked_fill_(mass_ahead >= _nucleus_limit(top_p), _NEG_INF)
    return logits.scatter_(1, sorted_idx, sorted_logits)


def apply_top_k_top_p_partial(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
    num_candidates: int = 1024,
) -> torch.Tensor | None:
    """`apply_top_k` then `apply_top_p_sorted`, computed from each row's best C tokens only
    (C = `max_top_k` when every row has top-k on, else max(`num_candidates`, `max_top_k`));
    None (logits untouched) when some row's nucleus may reach beyond them.

    One partial `topk` and one masking pass instead of a full sort: much cheaper where sorting
    is slow (the CPU), but it reads a flag back to the host, so it is not for the device path.
    Tokens tied with the last kept one are kept.
    """
    num_rows, vocab_size = logits.shape
    if top_k is not None and bool((top_k <= max_top_k).all()):
        num_candidates = max_top_k  # every row keeps at most its top-k anyway
    num_candidates = min(vocab_size, max(num_candidates, max_top_k))
    candidates = logits.topk(num_candidates, dim=-1).values  # [B, C], descending
    threshold = logits.new_full((num_rows, 1), _NEG_INF)  # keep logits >= threshold
    k_enabled = None
    if top_k is not None:
        k_enabled = top_k[:, None] <= max_top_k  # [B, 1]
        kth = candidates.gather(1, (top_k.clamp(max=num_candidates) - 1)[:, None])  # [B, 1]
        threshold = torch.where(k_enabled, kth, _NEG_INF)
        candidates = candidates.masked_fill(candidates < threshold, _NEG_INF)
    if top_p is not None:
        # Log of the mass left after top-k: within the candidates where top-k is on.
        log_total = torch.logsumexp(candidates, dim=-1, keepdim=True)  # [B, 1]
        if k_enabled is None or not bool(k_enabled.all()):
            full = torch.logsumexp(logits, dim=-1, keepdim=True)
            log_total = full if k_enabled is None else torch.where(k_enabled, log_total, full)
        probs = (candidates - log_total).exp_()  # [B, C]
        mass = probs.cumsum(dim=-1)
        limit = _nucleus_limit(top_p)  # [B, 1]
        disabled = limit.isinf()
        if not bool(((mass[:, -1:] >= limit) | disabled).all()):
            return None
        num_kept = (mass - probs < limit).sum(dim=-1, keepdim=True)  # [B, 1], >= 1
        p_threshold = candidates.gather(1, num_kept - 1).masked_fill_(disabled, _NEG_INF)
        threshold = torch.maximum(threshold, p_threshold)
    return logits.masked_fill_(logits < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int = 0,
) -> torch.Tensor:
    """top-k (`apply_top_k`), then top-p on what is left (`apply_top_p_sorted`); either may be
    None. On the CPU, where a full-vocabulary sort costs seconds for a large batch and reading
    a flag back is free, top-p first tries `apply_top_k_top_p_partial`; on CUDA one Triton
    kernel masks both without sorting (`ops/triton/top_k_top_p.py`)."""
    if logits.device.type == "cuda" and triton_usable(logits.device):
        from pagedllm.ops.triton.top_k_top_p import apply_top_k_top_p_triton

        return apply_top_k_top_p_triton(logits, top_k, top_p)
    if top_p is not None and logits.device.type == "cpu":
        partial = apply_top_k_top_p_partial(logits, top_k, top_p, max_top_k)
        if partial is not None:
            return partial
    if top_k is not None:
        logits = apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        logits = apply_top_p_sorted(logits, top_p)
    return logits


def random_sample(weights: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row of `weights [B, V]` (probabilities, or any non-negative multiple
    of them) -> [B] int64, with no host sync. `weights` is not modified.

    Inverse CDF: with c = cumsum(w) and u ~ Uniform[0, c_V), the first token whose c_i > u is
    token i with probability w_i / sum(w); a masked token (w_i = 0) has an empty interval and is
    never drawn. One uniform per row instead of one per token (the exponential race): about 12x
    cheaper on the CPU at a 32k vocabulary; the cumsum is two-level (`_inverse_cdf_draw`). Rows
    in `generators` (row -> torch.Generator) draw their uniform from it, so a seeded request's
    tokens do not depend on which other rows share the batch; the other rows use the global
    RNG.
    """
    return _inverse_cdf_draw(weights, generators)[0]


# Tokens per chunk in the two-level ops (`argmax`, the inverse-CDF draw): each reads the
# whole row once in a cheap chunked reduction, then works inside one chunk per row.
_CHUNK = 256


def _chunk_reduce(x: torch.Tensor, reduce: str) -> torch.Tensor:
    """`x [B, V]` -> `[B, ceil(V / _CHUNK)]`: the "sum" or "amax" of each chunk of columns (the
    last one may be shorter)."""
    num_rows, vocab_size = x.shape
    num_full = vocab_size // _CHUNK
    parts = []
    if num_full:
        full = x[:, : num_full * _CHUNK].reshape(num_rows, num_full, _CHUNK)
        parts.append(getattr(full, reduce)(dim=-1))
    if num_full * _CHUNK < vocab_size:
        parts.append(getattr(x[:, num_full * _CHUNK :], reduce)(dim=-1, keepdim=True))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]


def _chunk_values(x: torch.Tensor, chunk: torch.Tensor, fill: float) -> tuple[torch.Tensor, ...]:
    """Each row's chunk `chunk [B, 1]` of `x [B, V]` -> (first column [B, 1], values
    [B, _CHUNK]); columns past the end of a short last chunk read `fill`."""
    vocab_size = x.shape[1]
    first = chunk * _CHUNK
    columns = first + torch.arange(_CHUNK, device=x.device)  # [B, _CHUNK]
    values = x.gather(1, columns.clamp(max=vocab_size - 1))
    if vocab_size % _CHUNK:
        values.masked_fill_(columns >= vocab_size, fill)
    return first, values


def native_rows(logits: torch.Tensor):
    """The native sampling ops (ops/csrc/sampling.h) when they can take `logits`: fp32 [B, V]
    CPU rows, V > 0, each row contiguous, on an AVX-512 or AVX2 CPU, outside torch.compile;
    else None."""
    native = row_ops(logits) if logits.dtype == torch.float32 and logits.shape[1] else None
    if native is None or logits.stride(1) != 1:
        return None
    return native if native.cpu_has_avx2_fma() else None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits [B, V]` -> the first index of each row's maximum [B] int64 (greedy sampling),
    a NaN counting above every number (as `Tensor.argmax`). fp32 CPU rows on an AVX-512 or
    AVX2 CPU: the native `argmax_rows`, one pass a row (ops/csrc/sampling.h; at a 49k
    vocabulary ~5x cheaper than the two levels below, which in an engine step took 0.2 ms).
    Otherwise two levels: chunk maxima, then the argmax inside the first chunk holding the
    row's maximum; about 5x cheaper than `Tensor.argmax` on the CPU at a 32k vocabulary."""
    native = native_rows(logits)
    if native is not None:
        return native.argmax_rows(logits)
    if logits.shape[1] < 2 * _CHUNK:
        return logits.argmax(dim=-1)
    best = _chunk_reduce(logits, "amax").argmax(dim=-1, keepdim=True)  # [B, 1]
    first, values = _chunk_values(logits, best, _NEG_INF)
    return (first + values.argmax(dim=-1, keepdim=True)).squeeze_(1)


def native_sampling(logits: torch.Tensor):
    """The native ops when `sample_rows` can draw from `logits` (fp32 [B, V] CPU rows with a
    vocabulary of two chunks or more, on an AVX-512 or AVX2 CPU, outside torch.compile), else
    None. It is `random_sample` after temperature and the max-subtracted exp, fused: the same
    chunked inverse CDF, each row read twice and never written (ops/csrc/sampling.h)."""
    return native_rows(logits) if logits.shape[1] >= 2 * _CHUNK else None


def uniform(
    num_rows: int, generators: dict[int, torch.Generator], device: torch.device | str
) -> torch.Tensor:
    """U[0, 1) float32 per row [num_rows]; rows in `generators` draw from their own generator
    (one number each), the others from the global RNG."""
    u = torch.empty(num_rows, dtype=torch.float32, device=device)
    if len(generators) < num_rows:
        u.uniform_()
    for row, generator in generators.items():
        u[row : row + 1].uniform_(generator=generator)
    return u


def _search_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [B, 1] of the first entry of each row of `cdf [B, K]` that exceeds `u [B, 1]`,
    capped at the row's last entry with weight (where the cdf first reaches its total): float
    rounding can leave u at or past the end, and a zero-weight entry must never be picked."""
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous())
    return torch.searchsorted(cdf, u, right=True).clamp_(max=last)


def _inverse_cdf_draw(
    weights: torch.Tensor, generators: dict[int, torch.Generator], two_level: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`random_sample`, also returning each row's total weight [B, 1].

    Two levels, so that only one cheap pass (a sum) reads the whole row: u picks a chunk by
    the cumsum of the chunk sums, then a token inside that chunk by the cumsum of its weights.
    `two_level=False`: one whole-row cumsum, fewer ops for a handful of rows.
    """
    cdf = _chunk_reduce(weights, "sum").cumsum(dim=-1) if two_level else weights.cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()  # [B, 1]
    u = uniform(weights.shape[0], generators, weights.device)[:, None].mul_(total)  # [B, 1]
    picked = _search_cdf(cdf, u)  # [B, 1]: the token, or with two levels its chunk
    if not two_level:
        return picked.squeeze_(1), total
    before = cdf.gather(1, (picked - 1).clamp_(min=0)).masked_fill_(picked == 0, 0.0)
    first, values = _chunk_values(weights, picked, 0.0)
    return (first + _search_cdf(values.cumsum(dim=-1), u - before)).squeeze_(1), total


def _rejected_generators(
    generators: dict[int, torch.Generator], rejected: torch.Tensor
) -> dict[int, torch.Generator]:
    """The generators of the `rejected [R]` rows (indices into the current rows), renumbered by
    their position among them."""
    position = {row: i for i, row in enumerate(rejected.tolist())}
    return {position[r]: g for r, g in generators.items() if r in position}


def native_random_sample(
    native,
    logits: torch.Tensor,
    temperature: torch.Tensor,
    generators: dict[int, torch.Generator],
    top_k: torch.Tensor | None = None,
    max_top_k: int = 0,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU draw of temperature, min-p, top-k and top-p (any of the three may be None)
    from `logits [B, V]` (fp32 CPU rows, as `native_sampling` takes them) -> [B] int64: the
    rounds of `random_sample_top_p` (one round when top-p is off), each one native
    `sample_rows_truncated` call: the row's weights exp((l - max) / T), 0 below its top-k
    floor (`top_k_floor`) or where below min_p times the top one (as `apply_min_p` and
    `apply_top_k` mask), the draw from the support with one uniform, and the mass strictly
    ahead of the drawn token against p times the kept weights' total (ops/csrc/sampling.h).
    Each round draws one uniform a row still drawing, as `random_sample_top_p` (and, with one
    round, `random_sample`) does, so for the same uniforms it draws the same tokens as the
    PyTorch ops (but where a uniform or a mass falls within fp32 rounding of a boundary).
    Later rounds take the few rejected rows. `logits` is not modified; rows at temperature 0
    get 0."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    unset = torch.full_like(temperature, _NEG_INF)
    floor = unset if top_k is None else top_k_floor(logits, top_k, max_top_k).squeeze_(1)
    log_min_p = unset if min_p is None else min_p.log()
    top_p = torch.ones_like(temperature) if top_p is None else top_p
    bound = torch.full_like(temperature, -1.0)  # < 0: the whole row is the support
    out = None
    while True:
        u = uniform(rows.numel(), generators, logits.device)
        tokens, bound = native.sample_rows_truncated(
            logits, temperature, top_p, floor, log_min_p, u, bound
        )
        if out is None:
            out = tokens
        else:
            out[rows] = tokens
        rejected = (bound >= 0).nonzero().squeeze_(1)  # host sync
        if rejected.numel() == 0:
            return out
        rows, bound, floor, log_min_p = (t[rejected] for t in (rows, bound, floor, log_min_p))
        logits, temperature, top_p = logits[rejected], temperature[rejected], top_p[rejected]
        generators = _rejected_generators(generators, rejected)


def random_sample_top_p(
    weights: torch.Tensor, top_p: torch.Tensor, generators: dict[int, torch.Generator]
) -> torch.Tensor:
    """Draw one token per row from the nucleus of `weights [B, V]` (unnormalized
    probabilities) given `top_p [B]` -> [B] int64, without sorting. CPU path: it reads flags
    back to the host every round. `weights` is not modified.

    The nucleus N holds every token whose strictly-more-probable mass is < p (tokens tied with
    the last kept one are kept, as in `apply_top_k_top_p_partial`). Rejection with a shrinking
    support: draw t from the row's support S (first all tokens); accept if t is in N, which one
    masked sum checks; otherwise N lies inside {w > w_t}, which becomes S, and the row draws
    again. Each accepted draw has law w restricted to N exactly; a round accepts with
    probability >= mass(N) >= p, and a rejection cuts S like a quickselect pivot, so rounds are
    few (about one for p near 1, O(log 1/p) at worst), each costing a cumsum and three cheap
    passes over the rows still drawing, instead of an O(V log V) sort of every row.
    """
    out = None  # [B]: round one's draws, rejected rows overwritten as later rounds accept
    rows = torch.arange(weights.shape[0], device=weights.device)
    limit = None  # [R, 1]: top_p times the row's full mass
    while True:
        # Later rounds hold a few rows: one cumsum costs less than the two-level ops. (Per
        # round, not per row count, so that a seeded row draws the same whatever its batch.)
        tokens, total = _inverse_cdf_draw(weights, generators, two_level=limit is None)
        if limit is None:
            limit = _nucleus_limit(top_p) * total
        picked = weights.gather(1, tokens[:, None])  # [R, 1]
        # The support left after a rejection: w where w > picked, else 0. (A float mask from
        # `gt(out=)` is 2x cheaper than a bool one on the CPU.) Every token above `picked` is
        # still in S, so its sum is the mass ahead of `picked` in the full row.
        above = torch.gt(weights, picked, out=torch.empty_like(weights)).mul_(weights)
        accepted = (above.sum(dim=-1, keepdim=True) < limit).squeeze_(1)  # [R]
        if out is None:
            out = tokens
        else:
            out[rows[accepted]] = tokens[accepted]
        rejected = (~accepted).nonzero().squeeze_(1)  # host sync
        if rejected.numel() == 0:
            return out
        weights, rows, limit = above[rejected], rows[rejected], limit[rejected]
        generators = _rejected_generators(generators, rejected)
