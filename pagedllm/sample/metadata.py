"""`SamplingMetadata`: one step's sampling parameters as batched tensors for the `Sampler`.

Row i describes the i-th request that samples this step (the i-th row of the logits). The
builder makes only the tensors some row needs: an all-greedy batch has no temperature / top-k /
top-p / min-p tensors; a batch without penalties has no token-history tensors, and the ones it
has list each row's distinct tokens, not whole histories; logit_bias, allowed_token_ids,
min_tokens and bad words cost nothing unless a row uses them. Per-token inputs travel as index
lists or (row, token) pairs, never as dense [B, V] tensors, except allowed_token_ids: a list
that can hold most of the vocabulary becomes a [R, V] mask of its R rows (vLLM keeps one too),
each row's ids read into an array once per request. The mask is additive (0 where allowed,
-inf elsewhere): on the CPU one add runs ~15x faster than a boolean masked_fill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import SamplingParams


def _to_device(
    data: list | np.ndarray, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """One host list or array -> one device tensor (pinned, asynchronous copy on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        host = torch.tensor(data, dtype=dtype, pin_memory=True)
        return host.to(device, non_blocking=True)
    return torch.tensor(data, dtype=dtype, device=device)


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


def _grown(buf: np.ndarray, n: int) -> np.ndarray:
    """buf, or a copy twice as long, so that it holds at least n + 1 values."""
    if n < len(buf):
        return buf
    out = np.zeros(max(2 * len(buf), 16), dtype=buf.dtype)
    out[:n] = buf[:n]
    return out


def _distinct(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A token list's distinct ids, sorted (int64), and how often each occurs (np.unique's
    result, by a plain sort: np.unique's own path costs several times more on rows this
    short)."""
    a = np.sort(np.asarray(tokens, dtype=np.int64))
    if not len(a):
        return a, np.zeros(0, dtype=np.int64)
    first = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
    return a[first], np.diff(np.append(first, len(a)))


def _missing_from(values: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    """The entries of `values` not in `sorted_ids` (sorted, distinct)."""
    if not len(sorted_ids):
        return values
    at = np.minimum(np.searchsorted(sorted_ids, values), len(sorted_ids) - 1)
    return values[sorted_ids[at] != values]


class TokenHistory:
    """A request's tokens as the penalties read them, kept up to date a step at a time: the
    prompt's distinct tokens (sorted, taken once) and the output's distinct tokens with their
    counts. The model runner keeps one a request, so a step's penalties cost its new tokens,
    not the whole history again (64 rows of 256-token prompts and 1,024-token outputs took
    8.5-11 ms a step to list afresh, 0.3-1.4 ms kept).

    `sync(output)` folds in the tokens appended to `output` since the last call; a request
    whose earlier tokens were rewritten needs a new TokenHistory (`CachedRequestState` makes
    one); a shorter output than already folded starts over."""

    __slots__ = ("_prompt", "_prompt_sorted", "_folded", "_n", "_slot", "_ids", "_counts")

    def __init__(self, prompt_token_ids: list[int]) -> None:
        self._prompt: list[int] | None = prompt_token_ids
        self._prompt_sorted: np.ndarray | None = None
        self._reset()

    def _reset(self) -> None:
        self._folded = 0
        self._n = 0  # distinct output tokens: the first _n of _ids / _counts
        # output token -> its index in _ids / _counts (None after a bulk fold, until the next)
        self._slot: dict[int, int] | None = {}
        self._ids = np.zeros(16, dtype=np.int64)
        self._counts = np.zeros(16, dtype=np.float32)

    def sync(self, output: list[int]) -> None:
        if len(output) < self._folded:
            self._reset()
        if self._folded == 0 and len(output) > 16:  # a whole history at once: in bulk
            ids, counts = _distinct(output)
            self._n, self._slot = len(ids), None
            self._ids, self._counts = ids, counts.astype(np.float32)
            self._folded = len(output)
            return
        if self._folded == len(output):
            return
        if self._slot is None:
            self._slot = dict(zip(self._ids[: self._n].tolist(), range(self._n)))
        slot = self._slot
        for t in output[self._folded :]:
            i = slot.get(t)
            if i is not None:
                self._counts[i] += 1
                continue
            i = slot[t] = self._n
            self._n += 1
            self._ids, self._counts = _grown(self._ids, i), _grown(self._counts, i)
            self._ids[i], self._counts[i] = t, 1
        self._folded = len(output)

    def seen(self, output: list[int]) -> np.ndarray:
        """The distinct tokens of the prompt and `output`: the prompt's, then the others."""
        if self._prompt_sorted is None:
            self._prompt_sorted = _distinct(self._prompt)[0]
            self._prompt = None  # the sorted copy is all it needs from now on
        self.sync(output)
        extra = _missing_from(self._ids[: self._n], self._prompt_sorted)
        return np.concatenate((self._prompt_sorted, extra)) if len(extra) else self._prompt_sorted

    def output_counts(self, output: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """`output`'s distinct tokens and how often each occurs (float32)."""
        self.sync(output)
        return self._ids[: self._n], self._counts[: self._n]


def _padded(rows: list[np.ndarray], dtype: type, pad_first: bool) -> np.ndarray:
    """[B, width] rows, each padded by repeating its first value (pad_first) or with zeros."""
    out = np.zeros((len(rows), max(map(len, rows), default=0)), dtype=dtype)
    for row, values in zip(out, rows):
        row[: len(values)] = values
        if pad_first and len(values):
            row[len(values) :] = values[0]
    return out


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
    # (restricted rows [R], mask [R, V] float32: 0 allowed, -inf not): rows in R keep only
    # their allowed tokens.
    allowed_token_ids: tuple[torch.Tensor, torch.Tensor] | None
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
        histories: Sequence[TokenHistory] | None = None,
    ) -> SamplingMetadata:
        """Batch the rows' parameters. `prompt_token_ids[i]` / `output_token_ids[i]` are row
        i's prompt and the tokens it has generated so far (before this step's); `generators[i]`
        is the generator of row i's seeded request, or None; `vocab_size` is the logits' width.
        `histories[i]`, when given, is row i's `TokenHistory` (for its prompt and output
        tokens), which the penalties read instead of listing the tokens afresh.
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

        if histories is None:
            histories = [TokenHistory(prompt) for prompt in prompt_token_ids]
        rep_ids, rep = _build_repetition(params, output_token_ids, histories, device)
        out_ids, out_counts, freq, pres = _build_frequency_presence(
            params, output_token_ids, histories, device
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
    output_token_ids: list[list[int]],
    histories: Sequence[TokenHistory],
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if all(p.repetition_penalty == 1.0 for p in params):
        return None, None
    empty = np.zeros(0, dtype=np.int64)
    seen = [
        h.seen(output) if p.repetition_penalty != 1.0 else empty
        for p, output, h in zip(params, output_token_ids, histories)
    ]
    penalties = [p.repetition_penalty if len(ids) else 1.0 for p, ids in zip(params, seen)]
    return (
        _to_device(_padded(seen, np.int64, pad_first=True), torch.int64, device),
        _to_device(penalties, torch.float32, device),
    )


def _build_frequency_presence(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    histories: Sequence[TokenHistory],
    device: torch.device | str,
) -> tuple[torch.Tensor | None, ...]:
    used = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(u and out for u, out in zip(used, output_token_ids)):
        return None, None, None, None
    empty = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32))
    rows = [
        h.output_counts(out) if u else empty for u, out, h in zip(used, output_token_ids, histories)
    ]
    return (
        _to_device(_padded([r[0] for r in rows], np.int64, False), torch.int64, device),
        _to_device(_padded([r[1] for r in rows], np.float32, False), torch.float32, device),
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
) -> tuple[torch.Tensor, torch.Tensor] | None:
    restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if not restricted:
        return None
    mask = np.full((len(restricted), vocab_size), -np.inf, dtype=np.float32)
    for j, i in enumerate(restricted):
        ids = _allowed_ids(params[i])
        mask[j, ids[ids < vocab_size]] = 0.0
    return (
        _to_device(restricted, torch.int64, device),
        torch.from_numpy(mask).to(device, non_blocking=True),
    )


def _allowed_ids(p: SamplingParams) -> np.ndarray:
    """`p.allowed_token_ids` as an int64 array, kept on the params (a request's metadata is
    rebuilt whenever its batch changes; the list can hold tens of thousands of ids)."""
    ids = p.__dict__.get("_allowed_ids_array")
    if ids is None:
        ids = np.asarray(p.allowed_token_ids, dtype=np.int64)
        p.__dict__["_allowed_ids_array"] = ids
    return ids


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
