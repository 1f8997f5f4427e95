"""What beam search costs, offline: beam width K inside the engine vs K independent samples
(`n=K`) vs vLLM's way (re-submitting every beam as a one-token request each step).

Same prompts (`--num-prompts` of `--prompt-len` random tokens), `--max-tokens` each, EOS
ignored, so all three compute the same number of tokens per prompt and step. Reported per
mode: wall time (median of `--repeats`, modes alternated), and from a separate instrumented
run the peak number of KV blocks in use, the most blocks shared by several requests at once
and the copy-on-write block copies (beam search only).

    python -m pagedllm.benchmarks.beam_search --model DIR [engine flags]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from pagedllm.benchmarks.offline import add_model_and_engine_args, make_llm, report

MODES = ("beam_search", "n_samples", "vllm_style_beam_search")


def _prompts(args: argparse.Namespace, vocab_size: int) -> list[dict[str, list[int]]]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(args.prompt_len)]}
        for _ in range(args.num_prompts)
    ]


def _run(llm: Any, mode: str, prompts: list[dict], args: argparse.Namespace) -> list[list[int]]:
    """One batch in `mode`; returns each prompt's best (or first) output tokens."""
    from pagedllm import BeamSearchParams, SamplingParams

    k, steps = args.beam_width, args.max_tokens
    if mode == "beam_search":
        params = BeamSearchParams(beam_width=k, max_tokens=steps, ignore_eos=True)
        outs = llm.beam_search(prompts, params)
        return [o.sequences[0].tokens[args.prompt_len :] for o in outs]
    if mode == "n_samples":
        sp = SamplingParams(n=k, max_tokens=steps, ignore_eos=True, temperature=1.0, seed=0)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    return _vllm_style(llm, prompts, k, steps)


def _vllm_style(llm: Any, prompts: list[dict], k: int, steps: int) -> list[list[int]]:
    """vLLM's LLM.beam_search: every step, every beam is a new one-token request asking for
    2k logprobs; the prefix cache spares most of the prompt's recomputation."""
    from pagedllm import SamplingParams

    one_step = SamplingParams(max_tokens=1, logprobs=2 * k, temperature=0.0, ignore_eos=True)
    beams = [[(p["prompt_token_ids"], 0.0)] for p in prompts]
    for _ in range(steps):
        flat = [beam for group in beams for beam in group]
        outs = llm.generate([{"prompt_token_ids": t} for t, _ in flat], one_step, use_tqdm=False)
        new_beams, i = [], 0
        for group in beams:
            candidates = []
            for tokens, cum in group:
                for token_id, lp in outs[i].outputs[0].logprobs[0].items():
                    candidates.append((tokens + [token_id], cum + lp.logprob))
                i += 1
            candidates.sort(key=lambda c: -c[1])
            new_beams.append(candidates[:k])
        beams = new_beams
    return [group[0][0][len(p["prompt_token_ids"]) :] for group, p in zip(beams, prompts)]


class _KVWatcher:
    """Wraps the engine core's step to sample the block pool after every step."""

    def __init__(self, llm: Any) -> None:
        core = llm.llm_engine.engine_core.engine_core
        self.kv = core.scheduler.kv_cache_manager
        self.peak_used = self.peak_shared = self.copies = 0
        self._schedule = core.scheduler.schedule
        core.scheduler.schedule = self._watch
        self._core = core

    def _watch(self) -> Any:
        out = self._schedule()
        pool = self.kv.block_pool
        self.peak_used = max(self.peak_used, pool.num_blocks - pool.get_num_free_blocks())
        self.peak_shared = max(self.peak_shared, sum(1 for b in pool.blocks if b.ref_cnt > 1))
        self.copies += len(out.blocks_to_copy)
        return out

    def close(self) -> None:
        self._core.scheduler.schedule = self._schedule


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--output-json", default=None)
    add_model_and_engine_args(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the scheduler

    llm = make_llm(args)
    config = llm.llm_engine.config
    prompts = _prompts(args, config.model_config.vocab_size)
    result: dict[str, Any] = {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                              "max_tokens": args.max_tokens, "beam_width": args.beam_width}  # fmt: skip
    best: dict[str, list[list[int]]] = {}
    for mode in args.modes:  # memory, and a warm-up
        llm.reset_prefix_cache()
        watcher = _KVWatcher(llm)
        best[mode] = _run(llm, mode, prompts, args)
        watcher.close()
        result[f"{mode}_peak_kv_blocks"] = watcher.peak_used
        result[f"{mode}_peak_shared_blocks"] = watcher.peak_shared
        result[f"{mode}_block_copies"] = watcher.copies
    times: dict[str, list[float]] = {mode: [] for mode in args.modes}
    for _ in range(args.repeats):
        for mode in args.modes:  # alternated, so a busy spell hits every mode alike
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            _run(llm, mode, prompts, args)
            times[mode].append(time.perf_counter() - t0)
    for mode in args.modes:
        result[f"{mode}_seconds"] = statistics.median(times[mode])
    if "beam_search" in best and "vllm_style_beam_search" in best:
        result["same_best_beam_as_vllm_style"] = (
            best["beam_search"] == best["vllm_style_beam_search"]
        )
    result["block_size"] = config.cache_config.block_size
    report(result, args.output_json)
    return result


if __name__ == "__main__":
    main()
