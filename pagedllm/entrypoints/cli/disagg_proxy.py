"""`pagedllm disagg-proxy --prefill URL... --decode URL...`: one OpenAI-compatible endpoint
in front of prefill and decode instances (see `pagedllm.entrypoints.disagg_proxy`)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.disagg_proxy import add_cli_args

    parser = subparsers.add_parser(
        "disagg-proxy",
        help="serve prefill and decode instances behind one OpenAI-compatible endpoint",
        description=(
            "Send each request to a prefill instance (max_tokens=1), then to a decode "
            "instance with the returned kv_transfer_params. The instances run `pagedllm "
            "serve` with --kv-transfer-config "
            '\'{"kv_connector": "P2pZmqConnector", "kv_role": "kv_producer"}\' (prefill) or '
            '"kv_role": "kv_consumer" (decode).'
        ),
    )
    add_cli_args(parser)
    parser.set_defaults(func=cmd)


def cmd(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.disagg_proxy import run_proxy

    run_proxy(args)
    return 0
