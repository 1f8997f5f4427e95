"""The sampler's random draw on the CPU: the native one-pass `sample_rows` against the
PyTorch ops it replaces (`Sampler._draw` on a copy of the logits, as the sampler runs it:
temperature, max, subtract, exp, the chunked inverse CDF), on fp32 logits of SmolLM2's 49,152-token vocabulary; the two alternated, the
median of 9 blocks of calls. With `--engine MODEL`, the same two inside the engine: an
in-process `LLM` generating 64 x 128 in / 64 out at temperature 1, the draw switched between
the two every run (alternated, 6 runs each), timing the model runner's `_sample_tokens` (the
LM head and the draw) and the whole `generate`. Runs under the engine process's malloc
settings (`spawn.ENGINE_GLIBC_TUNABLES`: large temporaries reused, not faulted in afresh).
`--top-p P` / `--top-k K`: every row with top_p = P / top_k = K as well, so the native side
is the truncated rounds (`ops.native_random_sample`, one `sample_rows_truncated` call a round,
top-k's threshold by `top_k_floors`) and the PyTorch side the sampler's ops (`torch.topk`,
masking, `random_sample_top_p`).

    python scripts/cpu_sampling.py [--rows 1 8 64] [--vocab 49152] [--top-p 0.95] [--top-k 20]
        [--engine .demo-model/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from functools import partial

import torch


def _block_ms(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def _torch_draw(sampler, logits, metadata):
    from pagedllm.sample import ops

    native = ops.native_sampling
    ops.native_sampling = lambda logits: None  # top-k's threshold by torch.topk too
    try:
        return sampler._draw(logits.clone(), metadata, True, False)
    finally:
        ops.native_sampling = native


def _native_draw(native, logits, metadata):
    if metadata.top_p is not None or metadata.top_k is not None:
        from pagedllm.sample import ops

        return ops.native_random_sample(
            native,
            logits,
            metadata.temperature,
            {},
            top_k=metadata.top_k,
            max_top_k=metadata.max_top_k,
            top_p=metadata.top_p,
        )
    return native.sample_rows(logits, metadata.temperature, torch.rand(logits.shape[0]))


def ops_figures(rows: list[int], vocab: int, top_p: float, top_k: int) -> None:
    from pagedllm.sample import ops
    from pagedllm.sample.metadata import SamplingMetadata
    from pagedllm.sample.sampler import Sampler
    from pagedllm.sampling_params import SamplingParams

    kind = "sample_rows" if top_p == 1.0 and top_k == 0 else "truncated rounds"
    print(f"| rows | PyTorch ops | native {kind} | ratio |")
    print("|---|---|---|---|")
    for b in rows:
        logits = torch.randn(b, vocab) * 3
        params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)] * b
        metadata = SamplingMetadata.build(params, [[1]] * b, [[]] * b, [None] * b, vocab, "cpu")
        native = ops.native_sampling(logits)
        assert native is not None, "no native sampling on this CPU"
        # As the sampler calls each: the PyTorch draw on its own copy of the logits.
        kinds = {
            "torch": partial(_torch_draw, Sampler, logits, metadata),
            "native": partial(_native_draw, native, logits, metadata),
        }
        calls = max(5, 2000 // b)
        blocks: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(9):
            for k, fn in kinds.items():
                blocks[k].append(_block_ms(fn, calls))
        t = {k: statistics.median(v) for k, v in blocks.items()}
        print(
            f"| {b} | {t['torch']:.3f} ms | {t['native']:.3f} ms | {t['torch'] / t['native']:.2f}x |"
        )


def engine_figures(model: str, top_p: float, top_k: int) -> None:
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    from pagedllm import LLM, SamplingParams
    from pagedllm.sample import ops

    llm = LLM(model=model, seed=0, enable_prefix_caching=False)
    core = llm.llm_engine.engine_core.engine_core
    while core.idle_work():  # the KV cache's pages faulted in first
        pass
    runner = core.executor.worker.model_runner
    spent = {"s": 0.0}
    sample_tokens = runner._sample_tokens

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = sample_tokens(*args, **kwargs)
        spent["s"] += time.perf_counter() - start
        return out

    runner._sample_tokens = timed
    native = ops.native_sampling
    params = SamplingParams(
        max_tokens=64, temperature=1.0, top_p=top_p, top_k=top_k, ignore_eos=True
    )
    rng = random.Random(1)
    llm.generate([{"prompt_token_ids": [5] * 16}], params, use_tqdm=False)
    runs: dict[str, list[tuple[float, float]]] = {"torch": [], "native": []}
    for r in range(6):
        for kind in ("native", "torch") if r % 2 == 0 else ("torch", "native"):
            ops.native_sampling = native if kind == "native" else (lambda logits: None)
            prompts = [
                {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(128)]}
                for _ in range(64)
            ]
            spent["s"] = 0.0
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            runs[kind].append((time.perf_counter() - start, spent["s"]))
    ops.native_sampling = native
    for kind, v in runs.items():
        total = statistics.median(x[0] for x in v)
        sampling = statistics.median(x[1] for x in v)
        print(f"{kind}: generate {total:.3f} s, LM head + draw {sampling:.3f} s (medians of 6)")


def main() -> None:
    from pagedllm.spawn import ENGINE_GLIBC_TUNABLES

    if os.environ.get("GLIBC_TUNABLES") != ENGINE_GLIBC_TUNABLES:  # as the engine runs
        env = dict(os.environ, GLIBC_TUNABLES=ENGINE_GLIBC_TUNABLES)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--engine", metavar="MODEL", default=None)
    args = p.parse_args()
    ops_figures(args.rows, args.vocab, args.top_p, args.top_k)
    if args.engine:
        engine_figures(args.engine, args.top_p, args.top_k)


if __name__ == "__main__":
    main()
