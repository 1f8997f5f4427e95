"""int8 weights against bf16 at batch-1 decode in one process: two in-process engines on the
same checkpoint (`quantization="int8"` and the bf16 default), alternated round by round, each
round one request of a 128-token prompt and 128 greedy tokens (EOS ignored). A token's time is
decode alone, as vs_vllm's `decode1` takes it: (t(1 + 128 tokens) - t(1 token)) / 128, so the
prefill and the per-request costs cancel out (int8's prefill is not what the target is about).
Prints each engine's median milliseconds a token and the median of the per-round ratios
(bf16 time / int8 time). On a machine whose speed swings from one minute to the next,
alternating in one process compares the two under the same conditions.

    python scripts/int8_speedup.py MODEL_DIR [--rounds 9] [--row-stream]

`--row-stream` compares instead one int8 engine with and without the one-row int8 kernel's
non-temporal prefetch (the `cpu_int8_row_stream` switch, flipped between its runs): the ratio is
then the time without it / the time with it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument(
        "--row-stream", action="store_true", help="int8 with and without the row stream"
    )
    args = parser.parse_args()
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    import torch

    from pagedllm import LLM, SamplingParams

    def engine(quantization: str | None) -> LLM:
        return LLM(model=args.model, quantization=quantization, kv_cache_memory_bytes=1 << 30)

    # name -> (engine, the row stream's setting for its runs; None: the CPU's default)
    if args.row_stream:
        int8 = engine("int8")
        engines = {"int8, no stream": (int8, False), "int8, stream": (int8, True)}
    else:
        engines = {"bf16": (engine(None), None), "int8": (engine("int8"), None)}
    tokens = 128
    long, short = (
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1 + tokens, 1)
    )
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    for llm, _ in engines.values():
        llm.generate(prompt, long, use_tqdm=False)  # warm-up

    def seconds(name: str, params) -> float:
        llm, stream = engines[name]
        if stream is not None:
            torch.ops.pagedllm.cpu_int8_row_stream(stream)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name in engines:
            ms[name].append((seconds(name, long) - seconds(name, short)) / tokens * 1e3)
    base, new = engines
    ratios = [b / i for b, i in zip(ms[base], ms[new])]
    print(
        f"{base} {statistics.median(ms[base]):.2f} ms a token, "
        f"{new} {statistics.median(ms[new]):.2f} ms a token, "
        f"{new} speed-up {statistics.median(ratios):.3f}x "
        f"(rounds {min(ratios):.2f} .. {max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
