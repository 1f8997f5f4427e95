"""Share of a decode step spent outside the model forward (the engine's own CPU work).

Usage: python scripts/engine_overhead.py MODEL_DIR BATCH CONTEXT [TEMPERATURE TOP_P]

Runs an in-process engine with BATCH requests of CONTEXT random prompt tokens, lets them
reach steady decoding, then times `LLMEngine.step` (scheduling, input preparation, sampling,
output processing) against the time inside the model forward and the LM head. Requests are
FINAL_ONLY, as in `LLM.generate`, and the process gets the engine process's malloc settings.
"""

from __future__ import annotations

import os
import random
import sys
import time


def main() -> None:
    from pagedllm.engine.core_client import _ENGINE_GLIBC_TUNABLES

    if "GLIBC_TUNABLES" not in os.environ:
        # The engine runs in this process here: give it the malloc settings a spawned engine
        # process gets (they are read at process start, hence the re-exec).
        env = dict(os.environ, GLIBC_TUNABLES=_ENGINE_GLIBC_TUNABLES)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    model_dir, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.8
    top_p = float(sys.argv[5]) if len(sys.argv) > 5 else 0.95
    llm = LLM(model=model_dir, kv_cache_memory=2 << 30, enable_prefix_caching=False)
    engine = llm.llm_engine
    model = engine.engine_core.engine_core.executor.worker.model_runner.model
    in_model = [0.0]

    def timed(fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            in_model[0] += time.perf_counter() - start
            return out

        return wrapper

    model.forward = timed(model.forward)
    model.compute_logits = timed(model.compute_logits)
    vocab = engine.config.model_config.vocab_size
    rng = random.Random(0)
    # FINAL_ONLY, as `LLM.generate` sets it: no per-step RequestOutput (text is still
    # detokenized incrementally every step).
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=10_000,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(context)]
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    for _ in range(4):  # prefill and warm-up
        engine.step()
    shares = []
    for _ in range(5):
        in_model[0] = 0.0
        start = time.perf_counter()
        for _ in range(10):
            engine.step()
        total = time.perf_counter() - start
        shares.append((total / 10 * 1e3, (total - in_model[0]) / total * 100))
    shares.sort(key=lambda s: s[1])
    step_ms, outside = shares[len(shares) // 2]
    print(
        f"batch={batch} context={context} temperature={temperature} top_p={top_p}: "
        f"step {step_ms:.1f} ms, outside the model {outside:.1f}% "
        f"(median of 5 x 10 steps; all: {[round(s[1], 1) for s in shares]})"
    )
    llm.shutdown()


if __name__ == "__main__":
    main()
