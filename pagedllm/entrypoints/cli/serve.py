"""`pagedllm serve [MODEL_DIR]`: the OpenAI-compatible server, with vLLM's flags.

With no model (positional or `--model`), it serves the built-in demo model, built on first
use into the user's cache directory.
"""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start the OpenAI-compatible HTTP server (vLLM's flags).",
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, help="checkpoint directory (default: demo model)"
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (same as MODEL)")
    make_arg_parser(parser)
    parser.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    """Resolve the model directory and run the server until it is stopped; returns the
    exit status (non-zero after the engine died)."""
    from pagedllm.entrypoints.openai.api_server import run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(
            f"two models given: MODEL={args.model_tag!r} and --model={args.model!r}; pass one"
        )
    args.model = args.model_tag or args.model
    if not args.model:
        from pagedllm.testing.demo_model import default_demo_model_dir

        args.model = default_demo_model_dir()
    return run_server(args)
