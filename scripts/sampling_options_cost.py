"""What penalties, logprobs and grammar bitmasks cost a decode step.

`metadata`: `SamplingMetadata.build` for BATCH rows of PROMPT-token prompts and OUTPUT-token
outputs, each row's `TokenHistory` kept from the step before (as the model runner keeps one a
request: the timed step folds in one new token a row) against listing every row's tokens
afresh;
median milliseconds of 9 builds each.

`logprobs`: the sampler's logprobs of BATCH rows of a VOCAB-wide vocabulary (0, 5 and 20
alternatives), `compute_token_logprobs` (one native call on a CPU with AVX2 or AVX-512)
against log_softmax, gather, the ranks' sum and topk; median of 20 calls each.

`bitmask`: a grammar bitmask (a JSON grammar's: a few words allowing some tokens, the rest
forbidding every one) applied to BATCH rows of VOCAB logits by `apply_token_bitmask` (the
native kernel on fp32 CPU rows) and by xgrammar's CPU kernel; median of 20 calls each.

`prompt-logprobs`: an in-process engine (prefix caching off) prefilling BATCH prompts of
PROMPT random tokens with one output token each, without prompt logprobs and with 1 and 5;
median prompt tokens/s of 3 passes each (`--src DIR` as for `engine`).

`engine`: an in-process engine decoding BATCH requests of PROMPT random tokens (cached by the
prefix cache after a warm-up pass, so the timed passes are decode) for OUTPUT tokens at
temperature 0.8 with the option (none: `--option plain`); median generated tokens/s of 3
passes. `--src DIR` runs the pagedllm package found in DIR (a `git worktree` of another
commit), for A/B runs.

    python scripts/sampling_options_cost.py metadata [--batch 64 --prompt 1024 --output 64]
    python scripts/sampling_options_cost.py logprobs [--batch 64 --vocab 49152]
    python scripts/sampling_options_cost.py bitmask [--batch 64 --vocab 49152]
    python scripts/sampling_options_cost.py prompt-logprobs MODEL_DIR --prompt 256 [--batch 64]
        [--src DIR]
    python scripts/sampling_options_cost.py engine MODEL_DIR [--batch 64 --prompt 1024
        --output 64] [--option plain|rep|freq|logprobs0|logprobs5|allowed|min_p] [--src DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

PENALTIES = {
    "rep": {"repetition_penalty": 1.1},
    "freq": {"frequency_penalty": 0.3, "presence_penalty": 0.3},
}
OPTIONS = {
    "plain": {},
    **PENALTIES,
    "logprobs0": {"logprobs": 0},
    "logprobs5": {"logprobs": 5},
    # Most of SmolLM2's vocabulary allowed (29,000 of 49,152 ids) on every row.
    "allowed": {"allowed_token_ids": list(range(1000, 30000))},
    "min_p": {"min_p": 0.05},
}


def metadata(args: argparse.Namespace) -> None:
    from pagedllm.sample.metadata import SamplingMetadata, TokenHistory
    from pagedllm.sampling_params import SamplingParams

    rng = random.Random(0)
    vocab, B = 49152, args.batch
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(B)]
    outputs = [[rng.randrange(vocab) for _ in range(args.output)] for _ in range(B)]
    for name, kwargs in PENALTIES.items():
        params = [SamplingParams(temperature=0.8, **kwargs)] * B

        def build(histories, rows, params=params):
            return SamplingMetadata.build(
                params, prompts, rows, [None] * B, vocab, "cpu", histories=histories
            )

        kept, fresh = [], []
        for _ in range(9):
            histories = [TokenHistory(p) for p in prompts]
            build(histories, [o[:-2] for o in outputs])  # the steps before
            build(histories, [o[:-1] for o in outputs])
            start = time.perf_counter()
            build(histories, outputs)
            kept.append(time.perf_counter() - start)
            start = time.perf_counter()
            build(None, outputs)
            fresh.append(time.perf_counter() - start)
        print(
            f"{name}: {B} rows, {args.prompt} prompt / {args.output} output tokens: kept "
            f"histories {statistics.median(kept) * 1e3:.2f} ms, afresh "
            f"{statistics.median(fresh) * 1e3:.2f} ms"
        )


def logprobs(args: argparse.Namespace) -> None:
    import torch

    from pagedllm.sample.logprobs import compute_token_logprobs

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=g) * 4
    tokens = torch.randint(0, args.vocab, (args.batch,), generator=g)

    def pytorch(k: int) -> None:
        lp = torch.log_softmax(logits, dim=-1)
        picked = lp.gather(1, tokens[:, None])
        (lp > picked).sum(dim=-1, dtype=torch.int32)
        if k:
            lp.topk(k, dim=-1)

    for k in (0, 5, 20):
        times = {"native": [], "pytorch": []}
        for _ in range(20):
            for name, fn in (("native", compute_token_logprobs), ("pytorch", None)):
                start = time.perf_counter()
                fn(logits, tokens, k) if fn else pytorch(k)
                times[name].append(time.perf_counter() - start)
        native_ms, torch_ms = (statistics.median(times[n]) * 1e3 for n in ("native", "pytorch"))
        print(
            f"{args.batch} x {args.vocab}, k={k}: {native_ms:.2f} ms, PyTorch ops {torch_ms:.2f} ms"
        )


def bitmask(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import xgrammar as xgr

    from pagedllm.structured_output.bitmask import apply_token_bitmask

    B, V = args.batch, args.vocab
    words = np.zeros((B, (V + 31) // 32), dtype=np.int32)
    words[:, :40] = np.random.default_rng(0).integers(-(2**31), 2**31, (B, 40), dtype=np.int32)
    rows = np.arange(B)
    times = {"native": [], "xgrammar": []}
    for _ in range(20):
        a = torch.randn(B, V)
        b = a.clone()
        start = time.perf_counter()
        apply_token_bitmask(a, words, rows, rows)
        times["native"].append(time.perf_counter() - start)
        start = time.perf_counter()
        xgr.apply_token_bitmask_inplace(b, torch.from_numpy(words), vocab_size=V)
        times["xgrammar"].append(time.perf_counter() - start)
        assert torch.equal(a, b)
    native_ms, xgr_ms = (statistics.median(times[n]) * 1e3 for n in ("native", "xgrammar"))
    print(f"{B} x {V}: apply_token_bitmask {native_ms:.2f} ms, xgrammar {xgr_ms:.2f} ms")


def _in_process_llm(args: argparse.Namespace, **kwargs):
    """(pagedllm's top directory, an in-process LLM of args.model), from args.src if given."""
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    if args.src:
        sys.path.insert(0, os.path.abspath(args.src))
    import pagedllm

    top = os.path.dirname(os.path.dirname(pagedllm.__file__))
    return top, pagedllm.LLM(model=args.model, kv_cache_memory_bytes=4 << 30, **kwargs)


def prompt_logprobs(args: argparse.Namespace) -> None:
    top, llm = _in_process_llm(args, enable_prefix_caching=False)
    from pagedllm import SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt)]}
        for _ in range(args.batch)
    ]
    llm.generate(prompts[:2], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    variants = {"none": {}, "1": {"prompt_logprobs": 1}, "5": {"prompt_logprobs": 5}}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(3):
        for name, kwargs in variants.items():
            start = time.perf_counter()
            llm.generate(prompts, SamplingParams(max_tokens=1, **kwargs), use_tqdm=False)
            rates[name].append(args.batch * args.prompt / (time.perf_counter() - start))
    for name, r in rates.items():
        print(f"{top} prompt_logprobs={name}: {statistics.median(r):.1f} prompt tok/s")


def engine(args: argparse.Namespace) -> None:
    top, llm = _in_process_llm(args)
    from pagedllm import SamplingParams

    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt)]}
        for _ in range(args.batch)
    ]
    params = SamplingParams(
        max_tokens=args.output,
        temperature=0.8,
        seed=1,
        ignore_eos=True,
        **OPTIONS[args.option],
    )
    llm.generate(prompts, params, use_tqdm=False)  # warm-up; the prompts then come cached
    rates = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(args.batch * args.output / (time.perf_counter() - start))
    print(f"{top} {args.option}: {statistics.median(rates):.1f} tok/s {[round(r) for r in rates]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = {
        "metadata": metadata,
        "logprobs": logprobs,
        "bitmask": bitmask,
        "prompt-logprobs": prompt_logprobs,
        "engine": engine,
    }
    parser.add_argument("mode", choices=list(modes))
    parser.add_argument("model", nargs="?")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--option", choices=list(OPTIONS), default="rep")
    parser.add_argument("--src", help="run the pagedllm package in this directory")
    args = parser.parse_args()
    if args.mode in ("engine", "prompt-logprobs") and not args.model:
        parser.error(f"{args.mode} needs MODEL_DIR")
    modes[args.mode](args)


if __name__ == "__main__":
    main()
