"""`pagedllm bench latency | throughput | serve`: vLLM's benchmarks, same flags and output.

The benchmark code lives in `pagedllm.benchmarks`; each sub-verb module there has
`add_cli_args(parser)` and `main(args)`.
"""

from __future__ import annotations

import argparse
import importlib

_SUB_VERBS = {
    "latency": ("pagedllm.benchmarks.latency", "latency of one batch, end to end (offline)"),
    "throughput": ("pagedllm.benchmarks.throughput", "offline throughput of a workload"),
    "serve": ("pagedllm.benchmarks.serve", "latency and throughput of a running server"),
}


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmark latency, throughput or a server")
    verbs = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    for name, (module_name, help_text) in _SUB_VERBS.items():
        module = importlib.import_module(module_name)
        p = verbs.add_parser(
            name,
            help=help_text,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_cli_args(p)
        p.set_defaults(func=module.main)
    bench.set_defaults(func=lambda _args: _missing_verb(bench))


def _missing_verb(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
