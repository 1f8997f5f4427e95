"""`pagedllm bench latency`: the time to run one batch of requests end to end.

Each iteration generates `--output-len` tokens (EOS ignored) for `--batch-size` random
prompts of `--input-len` tokens; after `--num-iters-warmup` untimed iterations, the average
and the 10/25/50/75/90/99th percentiles of `--num-iters` timed ones are printed in vLLM's
format. The prompts are the same every iteration, so prefix caching (on by default) would
turn every iteration after the first into decode only; the benchmark says so when it is on.
"""

from __future__ import annotations

import argparse
import time

from pagedllm.benchmarks.datasets import sample_random_requests
from pagedllm.benchmarks.metrics import latency_percentiles
from pagedllm.benchmarks.offline import add_model_and_engine_args, make_llm, write_json

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--n", type=int, default=1, help="sequences generated per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--disable-detokenize", action="store_true")
    parser.add_argument("--output-json", default=None, help="write the latencies here")
    add_model_and_engine_args(parser)


def _validate(args: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "n", "num_iters"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be positive")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup={args.num_iters_warmup} must be non-negative")


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pagedllm import SamplingParams
    from pagedllm.benchmarks.memory import peak_rss_mib

    _validate(args)
    llm = make_llm(args)
    if getattr(args, "enable_prefix_caching", False):
        print(
            "Note: prefix caching is on; every iteration repeats the same prompts, so later "
            "iterations reuse their KV cache (pass --no-enable-prefix-caching to time prefill)."
        )
    vocab_size = llm.llm_engine.config.model_config.vocab_size
    tokenizer = llm.get_tokenizer()
    requests = sample_random_requests(
        args.batch_size,
        args.input_len,
        args.output_len,
        vocab_size,
        seed=args.seed,
        special_ids=list(getattr(tokenizer, "all_special_ids", ()) or ()),
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(
        n=args.n,
        temperature=1.0,
        top_p=1.0,
        ignore_eos=True,
        max_tokens=args.output_len,
        detokenize=not args.disable_detokenize,
    )

    def run_once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    print("Warming up...")
    for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
        run_once()
    latencies = [run_once() for _ in tqdm(range(args.num_iters), desc="Profiling iterations")]
    peak_mib = peak_rss_mib()

    avg = sum(latencies) / len(latencies)
    percentiles = latency_percentiles(latencies, PERCENTAGES)
    print(f"Avg latency: {avg} seconds")
    for p in PERCENTAGES:
        print(f"{p}% percentile latency: {percentiles[str(p)]} seconds")
    print(f"Peak memory (RSS, with engine processes): {peak_mib:.1f} MiB")
    if args.output_json:
        write_json(
            args.output_json,
            {
                "avg_latency": avg,
                "latencies": latencies,
                "percentiles": percentiles,
                "batch_size": args.batch_size,
                "input_len": args.input_len,
                "output_len": args.output_len,
                "peak_rss_mib": peak_mib,
            },
        )
    return 0
