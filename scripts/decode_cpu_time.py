"""CPU time of a batch-1 decode step, and of the GEMMs inside it, bf16 against int8.

    python scripts/decode_cpu_time.py --model DIR [--rounds 5] [--prompt-len 128] [--tokens 64]

Both engines live in this process (in-process engine core, one thread), and the rounds
alternate them. A step's time is (t(1 + N) - t(1)) / N for N output tokens after one prompt
(the prefill and the per-request costs cancel); the GEMMs' share is the thread CPU time spent
in `packed_linear` (every linear layer and the LM head). Process CPU time, not wall time: it
hardly depends on what else the machine runs, so the ratio holds on a shared machine (wall
time on a quiet one also has the memory bandwidth of more threads; see `vs_vllm`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    torch.set_num_threads(1)
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers import cpu_gemm, linear, logits_processor

    gemm_s = [0.0]
    untimed = cpu_gemm.packed_linear

    def timed(*a, **kw):
        start = time.thread_time()
        try:
            return untimed(*a, **kw)
        finally:
            gemm_s[0] += time.thread_time() - start

    linear.packed_linear = logits_processor.packed_linear = timed  # the modules' own names
    engines = {
        q or "bf16": LLM(model=args.model, quantization=q, kv_cache_memory=256 << 20)
        for q in (None, "int8")
    }
    prompt = [{"prompt_token_ids": list(range(100, 100 + args.prompt_len))}]

    def run(llm, n: int) -> tuple[float, float]:
        gemm_s[0] = 0.0
        start = time.process_time()
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        llm.generate(prompt, params, use_tqdm=False)
        return time.process_time() - start, gemm_s[0]

    steps: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in list(engines)[r % 2 :] + list(engines)[: r % 2]:
            (one, g1), (many, gn) = run(engines[name], 1), run(engines[name], 1 + args.tokens)
            if r:
                steps[name].append(((many - one) / args.tokens, (gn - g1) / args.tokens))
    for llm in engines.values():
        llm.shutdown()
    med = {
        name: tuple(statistics.median(s[i] for s in v) * 1e3 for i in (0, 1))
        for name, v in steps.items()
    }
    for name, (step, gemm) in med.items():
        print(f"{name:5s} step {step:6.2f} ms  GEMMs {gemm:6.2f} ms  rest {step - gemm:5.2f} ms")
    (bs, bg), (qs, qg) = med["bf16"], med["int8"]
    print(f"int8 / bf16 speed-up: step {bs / qs:.2f}x, GEMMs {bg / qg:.2f}x")


if __name__ == "__main__":
    main()
