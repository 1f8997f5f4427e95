"""Speculative-decoding benchmark: output tokens/s with and without each proposer, and the mean
acceptance length, at a few batch sizes; medians of several timed runs.

    python -m pagedllm.spec_decode.bench --model DIR [--batch-sizes 1 16] \
        [--methods none ngram draft_model eagle medusa] [--draft-model DIR] [--runs 3]

Workload: greedy, EOS ignored, `--max-tokens` new tokens per request, prompts made of one
English sentence repeated (a different sentence per request): text where prompt
lookup has something to copy; or (`--prompts summarize`, for a real instruction-tuned model
such as the demo model) chat requests to summarise a paragraph, EOS honoured. `draft_model` defaults to the target itself (every draft is
accepted: the upper bound of acceptance, at the full cost of the target per draft token);
EAGLE and Medusa heads are random (built for the target under --work-dir) unless given, so
their numbers show the overhead at near-zero acceptance; `pagedllm.spec_decode.train_heads`
trains real ones for a copy model (`--prompts copy`). The engine core runs in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

_SENTENCES = [
    "The farmer counted his sheep every evening, and every evening one of them was missing.",
    "Each block holds the keys and values of sixteen tokens, so a long prompt needs many.",
    "She opened the window, looked at the river, and wrote three short letters.",
    "The library closes early on Sundays, so we went to the market and bought bread.",
    "Light travels faster than sound, which is why we see the lightning first.",
    "Once upon a time there was a small village by the sea where everyone knew each other.",
    "Water boils at one hundred degrees, and ice melts above zero.",
    "A good question is often more useful than a quick answer, said the old teacher.",
]


def _prompts(tokenizer: Any, batch_size: int, min_tokens: int) -> list[list[int]]:
    """One sentence per request, repeated to at least `min_tokens` tokens."""
    prompts = []
    for i in range(batch_size):
        sentence = _SENTENCES[i % len(_SENTENCES)]
        if i >= len(_SENTENCES):
            sentence = sentence.lower() if i // len(_SENTENCES) % 2 else sentence.upper()
        ids = tokenizer.encode(sentence + " ", add_special_tokens=False)
        prompts.append(ids * -(-min_tokens // len(ids)))
    return prompts


def _summary_prompts(tokenizer: Any, batch_size: int, min_tokens: int) -> list[list[int]]:
    """Chat requests asking an instruction-tuned model to summarise a paragraph (the
    sentences above, rotated per request, repeated to at least `min_tokens` tokens): answers
    that reuse their input's wording, the workload prompt lookup is for."""
    prompts = []
    for i in range(batch_size):
        text = ""
        for j in range(4 * len(_SENTENCES)):
            text += _SENTENCES[(i + j) % len(_SENTENCES)] + " "
            if len(tokenizer.encode(text, add_special_tokens=False)) >= min_tokens:
                break
        message = f"Summarize the following text in a few sentences.\n\n{text.strip()}"
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def _spec_config(args: argparse.Namespace, method: str) -> dict[str, Any] | None:
    from pagedllm.spec_decode.testing import make_eagle_head, make_medusa_heads

    k = args.num_speculative_tokens
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 5}  # fmt: skip
    if method == "draft_model":
        return {"method": method, "num_speculative_tokens": k,
                "model": args.draft_model or args.model}  # fmt: skip
    if method == "eagle":
        head = args.eagle or make_eagle_head(os.path.join(args.work_dir, "eagle"), args.model)
        return {"method": method, "num_speculative_tokens": k, "model": head}
    if method == "medusa":
        heads = args.medusa or make_medusa_heads(
            os.path.join(args.work_dir, "medusa"), args.model, num_heads=k
        )
        return {"method": method, "num_speculative_tokens": k, "model": heads}
    raise ValueError(f"method={method!r} is not one of none, ngram, draft_model, eagle, medusa")


class _StepCounter:
    """Counts engine steps (one SchedulerStats per step) as a stat logger."""

    def __init__(self) -> None:
        self.num_steps = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any = None) -> None:
        self.num_steps += scheduler_stats is not None

    def log(self) -> None:
        pass


def run_one(args: argparse.Namespace, method: str, batch_size: int) -> dict[str, Any]:
    from pagedllm import LLM, SamplingParams
    from pagedllm.spec_decode.metrics import SpecDecodingRecorder

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        speculative_config=_spec_config(args, method),
    )
    tokenizer = llm.get_tokenizer()
    if args.prompts == "copy":  # for models from pagedllm.testing.copy_model
        from pagedllm.testing.copy_model import copy_prompts

        ids = copy_prompts(tokenizer, batch_size, args.prompt_tokens, args.copy_alphabet)
    elif args.prompts == "summarize":
        ids = _summary_prompts(tokenizer, batch_size, args.prompt_tokens)
    else:
        ids = _prompts(tokenizer, batch_size, args.prompt_tokens)
    prompts = [{"prompt_token_ids": p} for p in ids]
    params = SamplingParams(
        temperature=args.temperature,
        seed=0 if args.temperature > 0 else None,
        max_tokens=args.max_tokens,
        ignore_eos=args.prompts != "summarize",  # a real model's answers end where they end
    )
    llm.generate(prompts[:1], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    recorder = SpecDecodingRecorder()
    llm.llm_engine.stat_loggers.append(recorder)
    steps = _StepCounter()
    llm.llm_engine.stat_loggers.append(steps)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    median = statistics.median(times)
    return {
        "method": method,
        "batch_size": batch_size,
        "output_tokens_per_s": num_tokens / median,
        "median_s": median,
        "mean_acceptance_length": recorder.mean_acceptance_length if method != "none" else 1.0,
        # Verified drafts per engine step (prefill steps included): how often a draft existed.
        "drafts_per_step": recorder.num_drafts / max(steps.num_steps, 1),
        "tokens_per_step": num_tokens * args.runs / max(steps.num_steps, 1),
        "times_s": times,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "draft_model"])
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    parser.add_argument("--draft-model", default=None, help="default: the target itself")
    parser.add_argument("--eagle", default=None, help="EAGLE head dir (default: random)")
    parser.add_argument("--medusa", default=None, help="Medusa heads dir (default: random)")
    parser.add_argument("--work-dir", default="/tmp/pagedllm-spec-bench")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-memory-bytes", "--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument(
        "--prompts",
        choices=["text", "copy", "summarize"],
        default="text",
        help="text: a sentence repeated; copy: a token pattern repeated, from the alphabet "
        "a pagedllm.testing.copy_model checkpoint was trained on; summarize: chat requests to "
        "summarise a paragraph (an instruction-tuned model; EOS honoured)",
    )
    parser.add_argument("--copy-alphabet", type=int, default=64)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; > 0: seeded sampling"
    )
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
    results = []
    for batch_size in args.batch_sizes:
        for method in args.methods:
            r = run_one(args, method, batch_size)
            results.append(r)
            print(
                f"batch {batch_size:3d}  {method:12s}  {r['output_tokens_per_s']:8.1f} tok/s  "
                f"mean acceptance length {r['mean_acceptance_length']:.2f}  "
                f"tokens/step/request {r['tokens_per_step'] / batch_size:.2f}  "
                f"(runs: {', '.join(f'{t:.2f}s' for t in r['times_s'])})",
                flush=True,
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
