"""int8 weights against bf16 at batch-1 decode in one process: two in-process engines on the
same checkpoint (`quantization="int8"` and the bf16 default), alternated round by round, each
round one request of a 128-token prompt and 128 greedy tokens (EOS ignored). A token's time is
decode alone, as vs_vllm's `decode1` takes it: (t(1 + 128 tokens) - t(1 token)) / 128, so the
prefill and the per-request costs cancel out (int8's prefill is not what the target is about).
Prints each engine's median milliseconds a token and the median of the per-round ratios
(bf16 time / int8 time). On a machine whose speed swings from one minute to the next,
alternating in one process compares the two under the same conditions.

    python scripts/int8_speedup.py MODEL_DIR [--rounds 9]
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
    args = parser.parse_args()
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    from pagedllm import LLM, SamplingParams

    engines = {
        name: LLM(model=args.model, quantization=q, kv_cache_memory_bytes=1 << 30)
        for name, q in (("bf16", None), ("int8", "int8"))
    }
    tokens = 128
    long, short = (
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (1 + tokens, 1)
    )
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    for llm in engines.values():
        llm.generate(prompt, long, use_tqdm=False)  # warm-up

    def seconds(llm, params) -> float:
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        return time.perf_counter() - start

    ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, llm in engines.items():
            ms[name].append((seconds(llm, long) - seconds(llm, short)) / tokens * 1e3)
    ratios = [b / i for b, i in zip(ms["bf16"], ms["int8"])]
    print(
        f"bf16 {statistics.median(ms['bf16']):.2f} ms a token, "
        f"int8 {statistics.median(ms['int8']):.2f} ms a token, "
        f"int8 speed-up {statistics.median(ratios):.3f}x "
        f"(rounds {min(ratios):.2f} .. {max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
