"""A demo checkpoint trained to continue repeating text: a workload where speculative decoding
can help (n-gram drafts come true, a small trained draft model agrees with the target).

Usage: python -m pagedllm.testing.copy_model DIR [make-demo-model options] [--steps 1500]

`make_demo_model` writes a random checkpoint; this then trains it with transformers (fp32,
AdamW) on sequences that repeat a random pattern of 3-24 tokens, which teaches the model to
copy from its context (induction heads form after ~1,000 steps), and saves it again. Patterns
draw from an alphabet of the first `alphabet` ordinary (non-special) token ids: a small one
makes the copying easy to learn; `copy_prompts` builds prompts from the same alphabet.

`train_format_model` reuses the recipe for a fixed output format instead: the checkpoint learns
to answer prompts the way given examples do (e.g. a tool call in a model family's syntax), so
tests can show a format end to end with a model that writes it.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from pagedllm.testing.demo_model import add_cli_args, demo_model_kwargs, make_demo_model

MAX_PERIOD = 24  # from this position on, every row of a periodic batch can be copied


def periodic_batch(
    token_ids: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """[batch_size, seq_len] rows, each a random pattern of 3-24 tokens from `token_ids`
    repeated to `seq_len`."""
    rows = []
    for _ in range(batch_size):
        period = int(torch.randint(3, MAX_PERIOD + 1, (1,), generator=generator))
        picks = torch.randint(len(token_ids), (period,), generator=generator)
        rows.append(token_ids[picks].repeat(-(-seq_len // period))[:seq_len])
    return torch.stack(rows)


def copy_alphabet(tokenizer: Any, size: int) -> torch.Tensor:
    """The first `size` token ids that are not special tokens."""
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    ids = [i for i in range(len(tokenizer)) if i not in special][:size]
    return torch.tensor(ids)


def copy_prompts(
    tokenizer: Any, num_prompts: int, prompt_len: int, alphabet: int = 64, seed: int = 0
) -> list[list[int]]:
    """Prompts a copy model continues: each repeats a random pattern from its alphabet."""
    generator = torch.Generator().manual_seed(seed)
    batch = periodic_batch(copy_alphabet(tokenizer, alphabet), num_prompts, prompt_len, generator)
    return batch.tolist()


def train_periodic(
    loss_fn: Callable[[torch.Tensor], torch.Tensor],
    parameters: Iterable[torch.nn.Parameter],
    token_ids: torch.Tensor,
    generator: torch.Generator,
    *,
    steps: int,
    batch_size: int,
    seq_len: int,
    lr: float,
) -> None:
    """`steps` AdamW steps (no weight decay) on `loss_fn(batch)`, each on a fresh
    `periodic_batch` of `token_ids`."""
    train_steps(
        lambda: loss_fn(periodic_batch(token_ids, batch_size, seq_len, generator)),
        parameters,
        steps=steps,
        lr=lr,
    )


def train_steps(
    step_loss: Callable[[], torch.Tensor],
    parameters: Iterable[torch.nn.Parameter],
    *,
    steps: int,
    lr: float,
) -> None:
    """`steps` AdamW steps (no weight decay), each on the loss `step_loss()` returns."""
    optimizer = torch.optim.AdamW(parameters, lr=lr, weight_decay=0.0)
    for _ in range(steps):
        loss = step_loss()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()


def _fresh_model(path: str | os.PathLike, seed: int, demo_model_kwargs: dict[str, Any]):
    """A new fp32 demo checkpoint at `path`, loaded: (path, tokenizer, model in train mode)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_demo_model(path, seed=seed, dtype="float32", **demo_model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    model.train()
    return path, tokenizer, model


def _save_trained(model: Any, path: str, dtype: str, max_shard_size: int | str | None) -> None:
    """Replace the checkpoint's random weights with the trained ones, in `dtype`."""
    model.eval()
    shards = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    for old in Path(path).glob("model*.safetensors*"):
        old.unlink()
    model.to(getattr(torch, dtype)).save_pretrained(path, **shards)


def train_copy_model(
    path: str | os.PathLike,
    *,
    steps: int = 1500,
    alphabet: int = 64,
    batch_size: int = 16,
    seq_len: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
    **demo_model_kwargs: Any,
) -> tuple[str, float]:
    """Make a demo checkpoint at `path` (`make_demo_model` arguments), train it to copy, save
    it in `dtype`; returns (path, loss in nats/token on fresh sequences where copying is
    possible: after the longest period)."""
    path, tokenizer, model = _fresh_model(path, seed, demo_model_kwargs)
    tokens = copy_alphabet(tokenizer, alphabet)
    generator = torch.Generator().manual_seed(seed)
    train_periodic(
        lambda batch: model(input_ids=batch, labels=batch).loss,
        model.parameters(),
        tokens,
        generator,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        lr=lr,
    )
    model.eval()
    with torch.no_grad():
        batch = periodic_batch(tokens, batch_size, seq_len, generator)
        logits = model(input_ids=batch).logits[:, MAX_PERIOD:-1]
        final = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, MAX_PERIOD + 1 :].reshape(-1)
        ).item()
    _save_trained(model, path, dtype, max_shard_size)
    return path, final


def format_batch(
    tokenizer: Any, examples: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) [len(examples), longest]: prompt then completion tokens, padded;
    only completion tokens are labels (-100 elsewhere)."""
    rows = []
    for prompt, completion in examples:
        p = tokenizer(prompt, add_special_tokens=False).input_ids
        c = tokenizer(completion, add_special_tokens=False).input_ids
        rows.append((p + c, [-100] * len(p) + c))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    return input_ids, labels


def train_format_model(
    path: str | os.PathLike,
    make_example: Callable[[random.Random], tuple[str, str]],
    *,
    steps: int = 300,
    batch_size: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    dtype: str = "float32",
    **demo_model_kwargs: Any,
) -> tuple[str, float]:
    """Make a demo checkpoint at `path` and train it (AdamW, fp32) to write the completion of
    each `make_example(rng) -> (prompt text, completion text)`; saves it in `dtype`. Returns
    (path, loss in nats per completion token on a fresh batch)."""
    path, tokenizer, model = _fresh_model(path, seed, demo_model_kwargs)
    rng = random.Random(seed)

    def batch_loss() -> torch.Tensor:
        input_ids, labels = format_batch(tokenizer, [make_example(rng) for _ in range(batch_size)])
        return model(input_ids=input_ids, labels=labels).loss

    train_steps(batch_loss, model.parameters(), steps=steps, lr=lr)
    model.eval()
    with torch.no_grad():
        final = batch_loss().item()
    _save_trained(model, path, dtype, None)
    return path, final


def main(argv: list[str] | None = None) -> int:
    parser = add_cli_args(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.set_defaults(preset="tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--alphabet", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)
    path, loss = train_copy_model(
        args.path, steps=args.steps, alphabet=args.alphabet, lr=args.lr, **demo_model_kwargs(args)
    )
    print(f"{path}: copy loss {loss:.3f} nats/token after {args.steps} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
