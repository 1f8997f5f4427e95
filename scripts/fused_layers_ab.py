"""The fused CPU decoder layers (`layers/cpu_fused.py`) against the layers' own modules, in one
process: two in-process engines on the same checkpoint, one with no fused plan (every layer
runs module by module), alternated workload by workload, so both see the machine's same
minutes. Workloads are vs_vllm's (`decode1`: tokens/s of decode alone; `prefill`: prompt
tokens/s; `batch64`, `mixed`: output tokens/s). Prints each round and the median ratio.

    python scripts/fused_layers_ab.py MODEL_DIR [--workload decode1] [--rounds 9]
        [--old-qk-norm]

`--old-qk-norm` gives the modules' side the per-head q/k norm as it ran before 0b3651b (on
[T, heads, head_size] through RMSNorm's PyTorch code), to reproduce BENCHMARKS.md's Qwen3
figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _old_attention_forward(self, positions, hidden_states, attn_metadata):
    """LlamaAttention.forward before 0b3651b: q/k norms on 3-D views (PyTorch ops)."""
    num_tokens = hidden_states.shape[0]
    qkv = self.qkv_proj(hidden_states)
    q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
    if self.qk_norm:
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
    q, k = self.rotary_emb(positions, q, k)
    return self.o_proj(self.attn(q, k, v.contiguous(), attn_metadata))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--workload", default="decode1")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--old-qk-norm", action="store_true")
    args = parser.parse_args()
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"

    import pagedllm.models.llama as llama
    from pagedllm import LLM, SamplingParams
    from pagedllm.benchmarks.vs_vllm import DECODE_TOKENS, projection_shapes, workload

    kw = dict(kv_cache_memory=int(args.kv_cache_gib * (1 << 30)), seed=0)
    vocab = projection_shapes(args.model)["lm_head"][0]
    new_forward = llama.LlamaAttention.forward

    def generate(llm, prompts, outs) -> float:
        params = [SamplingParams(max_tokens=m, ignore_eos=True, temperature=1.0) for m in outs]
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    def run(llm, seed: int, modules: bool) -> float:
        old = modules and args.old_qk_norm
        llama.LlamaAttention.forward = _old_attention_forward if old else new_forward
        calls = workload(args.workload, vocab, seed)
        if args.workload == "decode1":
            (p1, o1), (p2, o2) = calls
            return DECODE_TOKENS / (generate(llm, p1, o1) - generate(llm, p2, o2))
        ((prompts, outs),) = calls
        seconds = generate(llm, prompts, outs)
        tokens = sum(map(len, prompts)) if args.workload == "prefill" else sum(outs)
        return tokens / seconds

    # Each layer decides its plan at its first forward: the modules' engine runs one with
    # layer_plan off, the fused engine after it is back.
    real_plan = llama.layer_plan
    llama.layer_plan = lambda layer: None
    modules = LLM(model=args.model, **kw)
    run(modules, 99, True)
    llama.layer_plan = real_plan
    fused = LLM(model=args.model, **kw)
    run(fused, 99, False)
    a, b = [], []
    for seed in range(100, 100 + args.rounds):
        a.append(run(modules, seed, True))
        b.append(run(fused, seed, False))
        print(f"round {seed - 99}: modules {a[-1]:.2f}, fused {b[-1]:.2f} ({b[-1] / a[-1]:.3f}x)")
    ratio = statistics.median(y / x for x, y in zip(a, b))
    print(
        f"{args.workload}: modules {statistics.median(a):.2f}, fused {statistics.median(b):.2f} "
        f"tok/s; fused / modules {ratio:.3f}x (median of {args.rounds} rounds)"
    )


if __name__ == "__main__":
    main()
