"""The cost of structured outputs, offline:

1. throughput of one batch where every request is JSON-schema constrained vs the same batch
   unconstrained (same prompts, seeds and `max_tokens`; EOS ignored). The schema (an array of
   at least 50 records) cannot end before `max_tokens`, so both batches generate exactly the
   same number of tokens and the difference is the per-step cost: bitmask fill, mask, advance;
2. the time to compile a typical schema for the model's tokenizer (the compiler's cache off,
   median of `--compile-repeats`), and the time a request waits in WAITING_FOR_FSM.

    python -m pagedllm.benchmarks.structured_outputs --model DIR [engine flags]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from pagedllm.benchmarks.offline import add_model_and_engine_args, make_llm, report

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
    },
    "required": ["name", "age", "role", "address", "tags"],
}
# Throughput schema: never complete before max_tokens.
RECORDS = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": RECORD, "minItems": 50}},
    "required": ["records"],
}
PROMPTS = [
    "Here are the records as JSON:",
    "The engine keeps a small pool of memory blocks",
    "List the users of the system",
    "She opened the window and wrote",
]


def _batch_throughput(llm: Any, args: argparse.Namespace, spec: Any) -> dict[str, float]:
    from pagedllm import SamplingParams

    prompts = [PROMPTS[i % len(PROMPTS)] + f" #{i}" for i in range(args.num_prompts)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            structured_outputs=spec,
        )
        for i in range(args.num_prompts)
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed}


def _compile_times(llm: Any, args: argparse.Namespace) -> dict[str, float]:
    import xgrammar as xgr

    from pagedllm.structured_output.backend_xgrammar import XgrammarBackend, build_grammar
    from pagedllm.structured_output.params import StructuredOutputsParams

    config = llm.llm_engine.config.model_config
    backend = XgrammarBackend(
        llm.get_tokenizer(), config.vocab_size, list(config.eos_token_ids) or [0]
    )
    compiler = xgr.GrammarCompiler(backend.tokenizer_info, cache_enabled=False)
    spec = StructuredOutputsParams(json=RECORD)
    build, compile_ = [], []
    for _ in range(args.compile_repeats):
        t0 = time.perf_counter()
        grammar = build_grammar(spec)
        t1 = time.perf_counter()
        compiler.compile_grammar(grammar)
        t2 = time.perf_counter()
        build.append(t1 - t0)
        compile_.append(t2 - t1)
    return {
        "vocab_size": config.vocab_size,
        "build_grammar_ms_median": 1e3 * statistics.median(build),
        "compile_ms_median": 1e3 * statistics.median(compile_),
        "compile_ms_min": 1e3 * min(compile_),
    }


def _fsm_wait(llm: Any) -> float:
    """Seconds from add_request until a new schema's request leaves WAITING_FOR_FSM (the
    engine's own compile path: thread pool, tokenizer already loaded)."""
    from pagedllm import SamplingParams
    from pagedllm.core.request import Request

    core = llm.llm_engine.engine_core.engine_core
    manager, scheduler = core.structured_output_manager, core.scheduler
    schema = dict(RECORD, title=f"fresh-{time.time_ns()}")  # not in any cache
    params = SamplingParams(max_tokens=1, structured_outputs={"json": schema})
    request = Request(f"fsm-{time.time_ns()}", [1, 2, 3], params)
    t0 = time.perf_counter()
    scheduler.add_request(request)
    while not manager.is_ready(request):
        time.sleep(0.0002)
    waited = time.perf_counter() - t0
    scheduler.finish_requests(request.request_id, request.status.FINISHED_ABORTED)
    return waited


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--compile-repeats", type=int, default=9)
    parser.add_argument("--output-json", default=None)
    add_model_and_engine_args(parser)
    args = parser.parse_args(argv)

    import os

    os.environ.setdefault("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")  # to reach the scheduler
    from pagedllm import StructuredOutputsParams

    llm = make_llm(args)
    spec = StructuredOutputsParams(json=RECORDS)
    _batch_throughput(llm, argparse.Namespace(num_prompts=2, max_tokens=4), spec)  # warm up
    runs: dict[str, list[dict[str, float]]] = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):
        runs["unconstrained"].append(_batch_throughput(llm, args, None))
        runs["json_schema"].append(_batch_throughput(llm, args, spec))
    best = {k: max(v, key=lambda r: r["output_tok_per_s"]) for k, v in runs.items()}
    slowdown = best["unconstrained"]["output_tok_per_s"] / best["json_schema"]["output_tok_per_s"]
    result = {
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        **{f"{k}_{m}": v for k, r in best.items() for m, v in r.items()},
        "json_schema_slowdown": slowdown,
        **_compile_times(llm, args),
        "fsm_wait_ms": 1e3 * statistics.median(_fsm_wait(llm) for _ in range(5)),
    }
    report(result, args.output_json)
    return result


if __name__ == "__main__":
    main()
