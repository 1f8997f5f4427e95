"""Share of a decode step spent outside the model (the engine's own CPU work), by stage.

Usage: python scripts/engine_overhead.py MODEL_DIR BATCH CONTEXT [TEMPERATURE TOP_P [QUANTIZATION]]

Runs an in-process engine with BATCH requests of CONTEXT random prompt tokens, lets them
reach steady decoding, then times `LLMEngine.step` and, inside it, each stage: scheduling,
input preparation, the model forward, the LM head, sampling, folding the results into the
requests (`update_from_output`) and the front end's output processing (detokenization). The
rest of the step is reported as "other". Requests are FINAL_ONLY, as in `LLM.generate`, and
the process gets the malloc settings a spawned engine process gets.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections import defaultdict

MODEL_STAGES = ("model forward", "LM head")


def main() -> None:
    from pagedllm.spawn import ENGINE_GLIBC_TUNABLES

    if "GLIBC_TUNABLES" not in os.environ:
        # The engine runs in this process here: give it the malloc settings a spawned engine
        # process gets (they are read at process start, hence the re-exec).
        env = dict(os.environ, GLIBC_TUNABLES=ENGINE_GLIBC_TUNABLES)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ["PAGEDLLM_ENABLE_MULTIPROCESSING"] = "0"
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import RequestOutputKind

    model_dir, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    temperature = float(sys.argv[4]) if len(sys.argv) > 4 else 0.8
    top_p = float(sys.argv[5]) if len(sys.argv) > 5 else 0.95
    quantization = sys.argv[6] if len(sys.argv) > 6 else None
    llm = LLM(
        model=model_dir,
        kv_cache_memory=2 << 30,
        enable_prefix_caching=False,
        quantization=quantization,
    )
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.executor.worker.model_runner
    spent: dict[str, float] = defaultdict(float)

    def timed(obj: object, attr: str, stage: str) -> None:
        fn = getattr(obj, attr)

        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - start

        setattr(obj, attr, wrapper)

    # None of these calls another one of them.
    timed(core.scheduler, "schedule", "schedule")
    timed(runner, "_prepare_inputs", "input preparation")
    timed(runner.model, "forward", "model forward")
    timed(runner.model, "compute_logits", "LM head")
    timed(runner, "sampler", "sampling")
    timed(core.scheduler, "update_from_output", "update_from_output")
    timed(engine.output_processor, "process_outputs", "output processing")

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
    runs: list[dict[str, float]] = []  # ms per step, by stage
    for _ in range(5):
        spent.clear()
        start = time.perf_counter()
        for _ in range(10):
            engine.step()
        total = time.perf_counter() - start
        run = {stage: secs / 10 * 1e3 for stage, secs in spent.items()}
        run["other"] = (total - sum(spent.values())) / 10 * 1e3
        run["step"] = total / 10 * 1e3
        runs.append(run)
    for run in runs:
        model_ms = sum(run.get(stage, 0.0) for stage in MODEL_STAGES)
        run["outside"] = (run["step"] - model_ms) / run["step"] * 100
    runs.sort(key=lambda r: r["outside"])
    median = runs[len(runs) // 2]
    print(
        f"batch={batch} context={context} temperature={temperature} top_p={top_p}: "
        f"step {median['step']:.1f} ms, outside the model {median['outside']:.1f}% "
        f"(median of 5 x 10 steps; all: {[round(r['outside'], 1) for r in runs]})"
    )
    stages = [s for s in runs[0] if s not in ("step", "outside")]
    for stage in sorted(stages, key=lambda s: -statistics.median(r[s] for r in runs)):
        ms = statistics.median(r[stage] for r in runs)
        where = "model" if stage in MODEL_STAGES else "engine"
        print(f"  {stage:<20} {ms:6.2f} ms  {ms / median['step'] * 100:5.1f}%  ({where})")
    llm.shutdown()


if __name__ == "__main__":
    main()
