"""Batch-1 decode with a decode-only step's layers in one native call (`FusedStack`,
layers/cpu_fused.py) and layer by layer (each layer's own fused call), alternated round by round
in one in-process engine: one request of a 128-token prompt and 200 greedy tokens (EOS ignored)
a round. Prints the median milliseconds a token of each, the median of the per-round ratios
(layer by layer / stack) and whether both produced the same tokens.

    python scripts/decode_stack_ab.py MODEL_DIR [--quantization int8] [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    from pagedllm import LLM, SamplingParams
    from pagedllm.layers import cpu_fused

    llm = LLM(model=args.model, quantization=args.quantization, kv_cache_memory_bytes=1 << 30)
    tokens = 200
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(100, 228))}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up (and the stack's plan)
    stack_forward = cpu_fused.FusedStack.forward

    def layer_by_layer(self, *args):
        return None  # the model then runs its layers one by one

    ms: dict[str, list[float]] = {"stack": [], "layers": []}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for mode in ms:
            cpu_fused.FusedStack.forward = stack_forward if mode == "stack" else layer_by_layer
            start = time.perf_counter()
            out = llm.generate(prompt, params, use_tqdm=False)
            ms[mode].append((time.perf_counter() - start) / tokens * 1e3)
            outputs[mode] = out[0].outputs[0].token_ids
    cpu_fused.FusedStack.forward = stack_forward
    ratios = [b / a for a, b in zip(ms["stack"], ms["layers"])]
    print(
        f"quantization={args.quantization}: stack {statistics.median(ms['stack']):.2f} ms a token, "
        f"layer by layer {statistics.median(ms['layers']):.2f}, "
        f"speed-up {statistics.median(ratios):.3f}x (rounds {min(ratios):.2f} .. {max(ratios):.2f}), "
        f"same tokens: {outputs['stack'] == outputs['layers']}"
    )


if __name__ == "__main__":
    main()
