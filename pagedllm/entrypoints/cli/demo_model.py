"""`pagedllm make-demo-model DIR`: build a small random-weight checkpoint with a tokenizer."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.testing import demo_model

    p = subparsers.add_parser(
        "make-demo-model", help="write a small seeded random-weight checkpoint to DIR"
    )
    demo_model.add_cli_args(p)
    p.set_defaults(func=demo_model.run_from_args)
