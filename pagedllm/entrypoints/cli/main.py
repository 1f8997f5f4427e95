"""The `pagedllm` command: `serve`, `generate`, `bench ...`, `tune`, `make-demo-model`,
`fetch-demo-model`, `disagg-proxy`.

Each verb lives in its own module with `register(subparsers)`; heavy imports (torch,
transformers) happen inside the verb, so `pagedllm --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

# Verb modules, in help order. A module that is missing (a feature not built) is skipped.
_VERB_MODULES = (
    "pagedllm.entrypoints.cli.serve",
    "pagedllm.entrypoints.cli.generate",
    "pagedllm.entrypoints.cli.bench",
    "pagedllm.entrypoints.cli.tune",
    "pagedllm.entrypoints.cli.demo_model",
    "pagedllm.entrypoints.cli.fetch_demo_model",
    "pagedllm.entrypoints.cli.disagg_proxy",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm", description="pagedllm: LLM inference and serving engine"
    )
    parser.add_argument("-v", "--version", action="store_true", help="print the version")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _VERB_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                continue
            raise
        module.register(subparsers)
    return parser


def _expand_config(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`pagedllm VERB ... --config FILE`: the file's flags go in front of the verb's own."""
    from pagedllm.entrypoints.openai.cli_args import expand_config_file

    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if not argv or argv[0] not in verbs.choices:
        return argv
    return [argv[0], *expand_config_file(verbs.choices[argv[0]], argv[1:])]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
    )
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = _expand_config(parser, argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.version:
        from pagedllm import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
