"""Greedy agreement of fp8 KV caches (scale 1.0 and `calculate_kv_scales`) with the model's
own-dtype cache on a real chat model, free-running and teacher-forced (pagedllm/testing/
agreement.py says how each is counted); the own-dtype engine teacher-forced on its own
continuation gives the floor set by rounding alone.

    python scripts/fp8_kv_agreement.py MODEL_DIR [--tokens 64] [--dtype bfloat16]

The prompts are the fixed chat instructions of `agreement.CHAT_PROMPTS`; the engines run in
this process one after the other (greedy, `ignore_eos`).
"""

from __future__ import annotations

import argparse
import os

VARIANTS = {
    "auto": {},
    "fp8 (e4m3), scale 1": {"kv_cache_dtype": "fp8"},
    "fp8 (e4m3), calculate_kv_scales": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
    "fp8_e5m2, scale 1": {"kv_cache_dtype": "fp8_e5m2"},
    "fp8_e5m2, calculate_kv_scales": {"kv_cache_dtype": "fp8_e5m2", "calculate_kv_scales": True},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    from pagedllm.testing import agreement

    count, outs, top1 = agreement.compare_engines(args.model, args.dtype, args.tokens, VARIANTS)
    print(f"{count} prompts x {args.tokens} greedy tokens, against the {args.dtype} cache")
    print(
        "| KV cache | free-running: before the first disagreement | positions equal | "
        "requests identical | teacher-forced top-1 |"
    )
    print("|---|---|---|---|---|")
    for name in VARIANTS:
        before, positions, identical = agreement.free_running(outs["auto"], outs[name])
        print(
            f"| {name} | {before:.1%} | {positions:.1%} | {identical}/{count} | {top1[name]:.1%} |"
        )


if __name__ == "__main__":
    main()
