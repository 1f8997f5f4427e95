"""`pagedllm tune`: sweep the engine's batching knobs against an SLO (benchmarks/tune.py)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.benchmarks import tune

    parser = subparsers.add_parser(
        "tune",
        help="find the serving configuration with the highest goodput under an SLO",
        description=tune.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    tune.add_cli_args(parser)
    parser.set_defaults(func=tune.main)
