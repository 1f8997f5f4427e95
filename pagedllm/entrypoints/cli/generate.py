"""`pagedllm generate`: one-shot offline generation from the command line."""

from __future__ import annotations

import argparse
import time


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.engine.arg_utils import EngineArgs

    p = subparsers.add_parser("generate", help="generate text offline for one or more prompts")
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory or .gguf file (default: the demo model, SmolLM2-135M-Instruct)",
    )
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument(
        "--chat",
        action="append",
        default=None,
        help="a user message, sent through the model's chat template (repeatable; one "
        "conversation each); not with --prompt",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("-n", type=int, default=1)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.testing.smollm2 import fetch_demo_model

    if args.prompt and args.chat:
        raise ValueError("pass --prompt or --chat, not both")
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model or str(fetch_demo_model())
    llm = LLM(**engine_args.as_kwargs())
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        n=args.n,
    )
    t0 = time.perf_counter()
    if args.chat:
        conversations = [[{"role": "user", "content": text}] for text in args.chat]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt or ["The capital of France is"], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_tokens = 0
    inputs = [f"User: {text!r}" for text in args.chat] if args.chat else None
    for i, out in enumerate(outputs):
        print(inputs[i] if inputs else f"Prompt: {out.prompt!r}")
        for c in out.outputs:
            n_tokens += len(c.token_ids)
            print(f"Output[{c.index}]: {c.text!r} ({c.finish_reason})")
    print(f"{n_tokens} tokens in {elapsed:.2f}s ({n_tokens / elapsed:.1f} tokens/s)")
    return 0
