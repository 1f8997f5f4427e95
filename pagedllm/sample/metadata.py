"""`SamplingMetadata`: one step's sampling parameters as batched tensors for the `Sampler`.

Row i describes the i-th request that samples this step (the i-th row of the logits). The
builder makes only the tensors some row needs: an all-greedy batch has no temperature / top-k /
top-p / min-p tensors; a batch without penalties has no token-history tensors, and the ones it
has list each row's distinct tokens, not whole histories; logit_bias, allowed_token_ids,
min_tokens and bad words cost nothing unless a row uses them. Per-token inputs travel as index
lists or (row, token) pairs, never as dense [B, V] tensors.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from pagedllm.sampling_params import SamplingParams


def _to_device(data: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """One host list -> one device tensor (pinned, asynchronous copy on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


def _pad(rows: list[list], pad: list) -> list[list]:
    """Ragged rows -> rows of one width, row i filled with `pad[i]`."""
    width = max(map(len, rows), default=0)
    return [r + [fill] * (width - len(r)) for r, fill in zip(rows, pad)]


def _banned_by_bad_words(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end `output`."""
    banned = []
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (
            prefix_len <= len(output) and output[len(output) - prefix_len :] == word[:-1]
        ):
            banned.append(word[-1])
    return banned


@dataclass
class SamplingMetadata:
    """Batched sampling parameters of one step; B rows, vocabulary size V.

    A field is None when no row needs it. Greedy rows (temperature 0) take the argmax of the
    processed logits; the others are sampled.
    """

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None  # [B] float32; 0 marks a greedy row; None if all greedy
    top_k: torch.Tensor | None  # [B] int64 in [1, V] (V = disabled); None if no row uses it
    max_top_k: int  # largest enabled k (< V) in `top_k`; 0 when `top_k` is None
    top_p: torch.Tensor | None  # [B] float32 in (0, 1] (1 = disabled)
    min_p: torch.Tensor | None  # [B] float32 in [0, 1] (0 = disabled)
    # Row -> generator of that row's seeded request (random rows only).
    generators: dict[int, torch.Generator]

    # Logprobs: how many alternatives each row asked for (None: no logprobs), and the max.
    num_logprobs: list[int | None]
    max_num_logprobs: int | None

    no_penalties: bool
    # Repetition penalty: each row's distinct prompt + output tokens, padded by repeating one of
    # them (rows without the penalty list nothing and have penalty 1).
    repetition_token_ids: torch.Tensor | None  # [B, R] int64
    repetition_penalties: torch.Tensor | None  # [B] float32
    # Frequency / presence penalties: each row's distinct output tokens and their counts,
    # padded with token 0 / count 0. None while no such row has an output token yet.
    output_token_ids: torch.Tensor | None  # [B, U] int64
    output_token_counts: torch.Tensor | None  # [B, U] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    presence_penalties: torch.Tensor | None  # [B] float32

    # (rows [N], token ids [N], bias [N]) added to the logits.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (restricted rows [R], rows [N], token ids [N]): rows in R keep only their listed tokens.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (rows [N], token ids [N]) forced to -inf: stop tokens before min_tokens, and bad words.
    banned_token_ids: tuple[torch.Tensor, torch.Tensor] | None
    # Nothing above depends on the rows' output tokens (no penalties, min_tokens or bad
    # words): the same rows may reuse this metadata next step.
    reusable: bool = False

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        generators: list[torch.Generator | None],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Batch the rows' parameters. `prompt_token_ids[i]` / `output_token_ids[i]` are row
        i's prompt and the tokens it has generated so far (before this step's); `generators[i]`
        is the generator of row i's seeded request, or None; `vocab_size` is the logits' width.
        Token ids outside [0, vocab_size) in logit_bias / allowed_token_ids / stop ids / bad
        words are ignored here (the front end is expected to reject them)."""
        assert len(prompt_token_ids) == len(output_token_ids) == len(generators) == len(params)
        temps = [p.temperature for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        all_random = not all_greedy and all(t != 0.0 for t in temps)

        temperature = top_k = top_p = min_p = None
        max_top_k = 0
        row_generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            temperature = _to_device(temps, torch.float32, device)
            ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            if any(k < vocab_size for k in ks):
                top_k = _to_device(ks, torch.int64, device)
                max_top_k = max(k for k in ks if k < vocab_size)
            if any(p.top_p < 1.0 for p in params):
                top_p = _to_device([p.top_p for p in params], torch.float32, device)
            if any(p.min_p > 0.0 for p in params):
                min_p = _to_device([p.min_p for p in params], torch.float32, device)
            row_generators = {
                i: g for i, g in enumerate(generators) if g is not None and temps[i] != 0.0
            }

        num_logprobs = [p.logprobs for p in params]
        max_num_logprobs = max((n for n in num_logprobs if n is not None), default=None)

        rep_ids, rep = _build_repetition(params, prompt_token_ids, output_token_ids, device)
        out_ids, out_counts, freq, pres = _build_frequency_presence(
            params, output_token_ids, device
        )

        return cls(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=temperature,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            min_p=min_p,
            generators=row_generators,
            num_logprobs=num_logprobs,
            max_num_logprobs=max_num_logprobs,
            no_penalties=rep is None and out_counts is None,
            repetition_token_ids=rep_ids,
            repetition_penalties=rep,
            output_token_ids=out_ids,
            output_token_counts=out_counts,
            frequency_penalties=freq,
            presence_penalties=pres,
            logit_bias=_build_logit_bias(params, vocab_size, device),
            allowed_token_ids=_build_allowed(params, vocab_size, device),
            banned_token_ids=_build_banned(params, output_token_ids, vocab_size, device),
            reusable=all(_output_independent(p) for p in params),
        )


def _output_independent(p: SamplingParams) -> bool:
    """Whether a row's sampling tensors stay the same however many tokens it generates."""
    return (
        p.repetition_penalty == 1.0
        and p.frequency_penalty == 0.0
        and p.presence_penalty == 0.0
        and p.min_tokens == 0
        and not p.bad_words_token_ids
    )


def _build_repetition(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(p.repetition_penalty == 1.0 for p in params):
        return None, None
    seen = [
        list(set(prompt).union(output)) if p.repetition_penalty != 1.0 else []
        for p, prompt, output in zip(params, prompt_token_ids, output_token_ids)
    ]
    token_ids = _pad(seen, [ids[0] if ids else 0 for ids in seen])
    penalties = [p.repetition_penalty if ids else 1.0 for p, ids in zip(params, seen)]
    return (
        _to_device(token_ids, torch.int64, device),
        _to_device(penalties, torch.float32, device),
    )


def _build_frequency_presence(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    device: torch.device | str,
) -> tuple[torch.Tensor | None, ...]:
    used = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(u and out for u, out in zip(used, output_token_ids)):
        return None, None, None, None
    counters = [Counter(out) if u else Counter() for u, out in zip(used, output_token_ids)]
    zeros = [0] * len(params)
    return (
        _to_device(_pad([list(c) for c in counters], zeros), torch.int64, device),
        _to_device(_pad([list(c.values()) for c in counters], zeros), torch.float32, device),
        _to_device([p.frequency_penalty for p in params], torch.float32, device),
        _to_device([p.presence_penalty for p in params], torch.float32, device),
    )


def _build_logit_bias(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    if not any(p.logit_bias for p in params):
        return None
    triples = [
        (i, tok, bias)
        for i, p in enumerate(params)
        if p.logit_bias
        for tok, bias in p.logit_bias.items()
        if 0 <= tok < vocab_size
    ]
    rows, toks, biases = zip(*triples) if triples else ((), (), ())
    return (
        _to_device(list(rows), torch.int64, device),
        _to_device(list(toks), torch.int64, device),
        _to_device(list(biases), torch.float32, device),
    )


def _build_allowed(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not restricted:
        return None
    pairs = [
        (i, tok) for i in restricted for tok in params[i].allowed_token_ids if 0 <= tok < vocab_size
    ]
    rows, toks = zip(*pairs) if pairs else ((), ())
    return (
        _to_device(restricted, torch.int64, device),
        _to_device(list(rows), torch.int64, device),
        _to_device(list(toks), torch.int64, device),
    )


def _build_banned(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    pairs: list[tuple[int, int]] = []
    for i, p in enumerate(params):
        if len(output_token_ids[i]) < p.min_tokens:
            stop_ids = set(p.all_stop_token_ids)
            if p.eos_token_id is not None and not p.ignore_eos:
                stop_ids.add(p.eos_token_id)
            pairs.extend((i, tok) for tok in stop_ids if 0 <= tok < vocab_size)
        if p.bad_words_token_ids:
            banned = _banned_by_bad_words(p.bad_words_token_ids, output_token_ids[i])
            pairs.extend((i, tok) for tok in banned if 0 <= tok < vocab_size)
    if not pairs:
        return None
    rows, toks = zip(*pairs)
    return _to_device(list(rows), torch.int64, device), _to_device(list(toks), torch.int64, device)
