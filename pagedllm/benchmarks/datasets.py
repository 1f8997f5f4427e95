"""Benchmark workloads: a seeded random dataset and ShareGPT conversations.

A `SampleRequest` always carries its prompt's token ids (so prompt lengths are exact and
backends see the same tokens); ShareGPT requests also keep their text, which a server
benchmark sends as-is.

Random dataset (vLLM's `--dataset-name random`): every prompt is `prefix + body`, where
`prefix` is `prefix_len` tokens shared by all prompts and each body's length is drawn
uniformly from `[input_len * (1 - r), input_len * (1 + r)]` (and each output length likewise
from `output_len`), `r = random_range_ratio` in `[0, 1)`. Token ids are drawn uniformly from
the vocabulary without the tokenizer's special tokens. Everything comes from one
`numpy.random.Generator(seed)`, so a seed names a workload.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from typing import Any

import numpy as np

DATASET_NAMES = ("random", "sharegpt")
# ShareGPT filtering, as vLLM does it: drop very short turns and over-long pairs.
_SHAREGPT_MIN_LEN = 4
_SHAREGPT_MAX_PROMPT_LEN = 1024
_SHAREGPT_MAX_TOTAL_LEN = 2048


@dataclass
class SampleRequest:
    """One benchmark request: prompt token ids, optional prompt text, and output length."""

    prompt_token_ids: list[int]
    expected_output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def uniform_range(length: int, ratio: float, minimum: int = 0) -> tuple[int, int]:
    """Inclusive `[low, high]` of lengths around `length` for a range ratio in [0, 1)."""
    if length < 0:
        raise ValueError(f"length={length} must be non-negative")
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"random_range_ratio={ratio} must be in [0, 1)")
    low = max(minimum, int(length * (1.0 - ratio)))
    high = max(low, int(length * (1.0 + ratio)))
    return low, high


def sampleable_token_ids(
    vocab_size: int, special_ids: list[int] | tuple[int, ...] = ()
) -> np.ndarray:
    """Token ids `[0, vocab_size)` minus special ones (BOS/EOS inside a prompt skews nothing
    but confuses tokenizers that re-read the text)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size={vocab_size} must be positive")
    ids = np.arange(vocab_size, dtype=np.int64)
    keep = np.ones(vocab_size, dtype=bool)
    special = [i for i in special_ids if 0 <= i < vocab_size]
    keep[special] = False
    if not keep.any():
        raise ValueError("every token id in the vocabulary is a special token")
    return ids[keep]


def sample_random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    special_ids: list[int] | tuple[int, ...] = (),
) -> list[SampleRequest]:
    """`num_requests` random token-id prompts (see the module docstring for the layout)."""
    if num_requests <= 0:
        raise ValueError(f"num_prompts={num_requests} must be positive")
    if prefix_len < 0:
        raise ValueError(f"prefix_len={prefix_len} must be non-negative")
    if output_len <= 0:
        raise ValueError(f"output_len={output_len} must be positive")
    in_low, in_high = uniform_range(input_len, range_ratio)
    out_low, out_high = uniform_range(output_len, range_ratio, minimum=1)
    pool = sampleable_token_ids(vocab_size, special_ids)
    rng = np.random.default_rng(seed)
    prefix = rng.choice(pool, size=prefix_len).tolist()
    input_lens = rng.integers(in_low, in_high + 1, size=num_requests)
    output_lens = rng.integers(out_low, out_high + 1, size=num_requests)
    requests = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        # An empty prompt is invalid: a zero-length body without a prefix gets one token.
        body = rng.choice(pool, size=max(n_in, 0 if prefix_len else 1)).tolist()
        requests.append(SampleRequest(prefix + body, n_out))
    return requests


def load_sharegpt_requests(
    path: str,
    num_requests: int,
    tokenizer: Any,
    seed: int = 0,
    output_len: int | None = None,
    max_model_len: int | None = None,
) -> list[SampleRequest]:
    """First human turn as prompt, the reply's token count as output length (or `output_len`).

    Conversations are shuffled with `seed`; pairs with a prompt or reply under 4 tokens, a
    prompt over 1024 tokens or a total over 2048 (or over `max_model_len`) are skipped.
    """
    if num_requests <= 0:
        raise ValueError(f"num_prompts={num_requests} must be positive")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"--dataset-path={path!r}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--dataset-path={path!r} is not JSON ({e})") from e
    if not isinstance(data, list):
        raise ValueError(f"dataset {path!r} must hold a JSON list of ShareGPT entries")
    convs = [
        e["conversations"]
        for e in data
        if isinstance(e, dict) and len(e.get("conversations") or ()) >= 2
    ]
    random.Random(seed).shuffle(convs)
    max_total = min(_SHAREGPT_MAX_TOTAL_LEN, max_model_len or _SHAREGPT_MAX_TOTAL_LEN)
    requests: list[SampleRequest] = []
    for conv in convs:
        if len(requests) == num_requests:
            break
        prompt, reply = conv[0].get("value", ""), conv[1].get("value", "")
        prompt_ids = list(tokenizer(prompt).input_ids)
        n_out = output_len if output_len is not None else len(tokenizer(reply).input_ids)
        too_short = len(prompt_ids) < _SHAREGPT_MIN_LEN or (
            output_len is None and n_out < _SHAREGPT_MIN_LEN
        )
        too_long = len(prompt_ids) > _SHAREGPT_MAX_PROMPT_LEN or len(prompt_ids) + n_out > max_total
        if too_short or too_long:
            continue
        requests.append(SampleRequest(prompt_ids, n_out, prompt=prompt))
    if not requests:
        raise ValueError(f"dataset {path!r} has no usable conversation")
    return requests


def add_dataset_args(parser: argparse.ArgumentParser, default_num_prompts: int = 1000) -> None:
    """The dataset flags shared by `bench throughput` and `bench serve` (vLLM's names; the
    random-dataset flags also answer to their `--random-` spelling)."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    group.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    group.add_argument("--num-prompts", type=int, default=default_num_prompts)
    group.add_argument(
        "--input-len", "--random-input-len", dest="input_len", type=int, default=1024
    )
    group.add_argument(
        "--output-len", "--random-output-len", dest="output_len", type=int, default=128
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)",
    )
    group.add_argument(
        "--prefix-len",
        "--random-prefix-len",
        dest="prefix_len",
        type=int,
        default=0,
        help="random tokens shared by every prompt, before its own input-len tokens",
    )
    group.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="fixed output length for ShareGPT requests (default: the reply's length)",
    )


def get_requests(
    args: argparse.Namespace, tokenizer: Any, vocab_size: int | None = None
) -> list[SampleRequest]:
    """Build the workload named by the dataset flags (`--seed` seeds it)."""
    seed = getattr(args, "seed", 0) or 0
    if args.dataset_name == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--dataset-name sharegpt needs --dataset-path")
        return load_sharegpt_requests(
            args.dataset_path,
            args.num_prompts,
            tokenizer,
            seed=seed,
            output_len=args.sharegpt_output_len,
            max_model_len=getattr(args, "max_model_len", None),
        )
    return sample_random_requests(
        args.num_prompts,
        args.input_len,
        args.output_len,
        vocab_size or len(tokenizer),
        range_ratio=args.random_range_ratio,
        prefix_len=args.prefix_len,
        seed=seed,
        special_ids=list(getattr(tokenizer, "all_special_ids", ()) or ()),
    )
