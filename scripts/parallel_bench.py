"""TP=2 and PP=2 (one core per rank) against TP=1 (two threads) on this machine: batch-1 decode
time per output token and 64 x 128/128 generated tokens/s, engines alternated round by round.

    python scripts/parallel_bench.py /tmp/bench/llama-125m --rounds 3

Each round starts every engine once (TP=1 on 2 threads and on 1, TP=2, PP=2, in that order) and measures, in that
engine, `--decode-runs` batch-1 requests (32 random prompt tokens, 128 generated, greedy, EOS
ignored; time per output token = request time / 128, prefill included, like `bench latency`)
and one 64 x 128/128 batch (generated tokens over the whole run). Prints every figure and the
medians over all rounds.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

# name -> (LLM kwargs, OMP_NUM_THREADS for the engine process or None). TP=1 on one thread is
# a reference: on a shared machine two OpenMP threads lose time waiting for each other.
ENGINES = {
    "TP=1 (2 threads)": ({}, None),
    "TP=1 (1 thread)": ({}, "1"),
    "TP=2 (a core each)": ({"tensor_parallel_size": 2}, None),
    "PP=2 (a core each)": ({"pipeline_parallel_size": 2}, None),
}


def _prompts(n: int, length: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(length)]}
            for _ in range(n)]  # fmt: skip


def _measure(
    model: str, kwargs: dict, threads: str | None, decode_runs: int, dtype: str
) -> tuple[list[float], float]:
    """(ms per output token of each batch-1 run, 64 x 128/128 generated tokens/s)."""
    from pagedllm import LLM, SamplingParams

    if threads is not None:  # the engine process is spawned with this environment
        os.environ["OMP_NUM_THREADS"] = threads
    try:
        llm = LLM(model=model, dtype=dtype, kv_cache_memory_bytes=512 << 20, **kwargs)
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate(_prompts(1, 32, 0), params, use_tqdm=False)  # warm-up
        per_token = []
        for i in range(decode_runs):
            t0 = time.perf_counter()
            llm.generate(_prompts(1, 32, i + 1), params, use_tqdm=False)
            per_token.append((time.perf_counter() - t0) / 128 * 1e3)
        t0 = time.perf_counter()
        outs = llm.generate(_prompts(64, 128, 99), params, use_tqdm=False)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        return per_token, generated / (time.perf_counter() - t0)
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto", help="bf16 where the CPU has it, else fp32")
    args = parser.parse_args()
    decode: dict[str, list[float]] = {name: [] for name in ENGINES}
    batch: dict[str, list[float]] = {name: [] for name in ENGINES}
    for r in range(args.rounds):
        for name, (kwargs, threads) in ENGINES.items():
            per_token, tokens_s = _measure(
                args.model, kwargs, threads, args.decode_runs, args.dtype
            )
            decode[name] += per_token
            batch[name].append(tokens_s)
            print(f"round {r + 1} {name}: batch-1 {[round(t, 1) for t in per_token]} ms/token, "
                  f"64x128/128 {tokens_s:.1f} tokens/s", flush=True)  # fmt: skip
    base_decode = statistics.median(decode["TP=1 (2 threads)"])
    base_batch = statistics.median(batch["TP=1 (2 threads)"])
    for name in ENGINES:
        d, b = statistics.median(decode[name]), statistics.median(batch[name])
        print(f"{name}: batch-1 median {d:.1f} ms/token ({d / base_decode:.2f}x TP=1's time), "
              f"64x128/128 median {b:.1f} tokens/s ({b / base_batch:.2f}x TP=1's)")  # fmt: skip


if __name__ == "__main__":
    main()
