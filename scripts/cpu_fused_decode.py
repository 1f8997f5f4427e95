"""Batch-1 decode time per token with pagedllm's fused decoder layers (`layers/cpu_fused.py`) and
without them (each layer's modules, the same native kernels), in fresh processes, alternating,
for each weight kind asked for. `--narrow`: the same model with its widths cut to 128 (random
weights, same layer count and vocabulary), so the GEMMs cost next to nothing and what is left is
the per-layer overhead the fused ops remove.

    python scripts/cpu_fused_decode.py MODEL_DIR [--quantization none int8] [--rounds 3] [--narrow]

Each run: one 128-token random prompt, 128 greedy tokens (EOS ignored), in-process engine,
`dtype="auto"`; a warm-up request, then 4 timed ones; the run's figure is their median.
Prints the median over rounds per configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, random, statistics, sys, time
os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
model, quantization, fused = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
if not fused:
    import pagedllm.models.llama as llama
    llama.layer_plan = lambda layer: None
from pagedllm import LLM, SamplingParams
llm = LLM(model=model, dtype="auto", seed=0, kv_cache_memory=1 << 30,
          quantization=None if quantization == "none" else quantization)
rng = random.Random(0)
prompt = [{"prompt_token_ids": [rng.randrange(3, 30000) for _ in range(128)]}]
params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
llm.generate(prompt, params, use_tqdm=False)
times = []
for _ in range(4):
    t = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    times.append((time.perf_counter() - t) / 128 * 1e3)
print(json.dumps(statistics.median(times)))
"""


def narrow_copy(model_dir: str, out_dir: str) -> str:
    """MODEL_DIR's architecture with hidden / MLP widths 128 (2 heads of 64, 1 KV head)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size = config.intermediate_size = 128
    config.num_attention_heads, config.num_key_value_heads = 2, 1
    config.head_dim = 64
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--narrow", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = narrow_copy(args.model, tmp) if args.narrow else args.model
        runs: dict[tuple[str, bool], list[float]] = {}
        for _ in range(args.rounds):
            for q in args.quantization:
                for fused in (False, True):
                    out = subprocess.run(
                        [sys.executable, "-c", CHILD, model, q, "1" if fused else "0"],
                        check=True,
                        capture_output=True,
                        text=True,
                    )
                    ms = json.loads(out.stdout.strip().splitlines()[-1])
                    runs.setdefault((q, fused), []).append(ms)
                    print(f"{q} fused={fused}: {ms:.2f} ms/token", flush=True)
    print("| weights | layers' modules (ms/token) | fused layers (ms/token) | modules / fused |")
    print("|---|---|---|---|")
    for q in args.quantization:
        plain, fused = (statistics.median(runs[(q, f)]) for f in (False, True))
        shown = {"none": "model dtype"}.get(q, q)
        print(
            f"| {shown} | {plain:.2f} ({', '.join(f'{v:.2f}' for v in runs[(q, False)])}) "
            f"| {fused:.2f} ({', '.join(f'{v:.2f}' for v in runs[(q, True)])}) "
            f"| {plain / fused:.2f}x |"
        )


if __name__ == "__main__":
    main()
