"""Flags of the OpenAI-compatible server (`pagedllm serve`): vLLM's server flags plus every
engine flag from `EngineArgs.add_cli_args`."""

from __future__ import annotations

import argparse
import os

from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "PAGEDLLM_API_KEY"


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server and engine flags to `parser` (which may already hold a positional
    model argument). Engine statistics are on by default for a server."""
    from pagedllm.engine.arg_utils import EngineArgs

    group = parser.add_argument_group("server arguments")
    group.add_argument(
        "--host", type=str, default=None, help="Host to bind (default: all interfaces)."
    )
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--api-key",
        type=str,
        default=os.environ.get(API_KEY_ENV),
        help=f"Require `Authorization: Bearer KEY` on /v1/* (default: ${API_KEY_ENV}).",
    )
    group.add_argument(
        "--uvicorn-log-level",
        type=str,
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="Log level of uvicorn.",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Do not log one line per finished request.",
    )
    group.add_argument(
        "--chat-template",
        type=str,
        default=None,
        help="A Jinja chat template, or a file holding one (default: the tokenizer's).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Let the model decide when to call tools (tool_choice "auto"); needs '
        "--tool-call-parser.",
    )
    group.add_argument(
        "--tool-call-parser",
        type=str,
        default=None,
        choices=sorted(TOOL_PARSERS),
        help='How the model writes tool calls, read for tool_choice "auto".',
    )
    group.add_argument("--ssl-keyfile", type=str, default=None, help="TLS key file.")
    group.add_argument("--ssl-certfile", type=str, default=None, help="TLS certificate file.")
    group.add_argument("--root-path", type=str, default=None, help="ASGI root path (proxies).")
    group.add_argument(
        "--timeout-graceful-shutdown",
        type=float,
        default=10.0,
        help="Seconds open connections get to finish after SIGTERM / Ctrl-C.",
    )
    EngineArgs.add_cli_args(parser)
    return parser


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a path to a template file, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ValueError(f"--chat-template={value!r} is neither a file nor a Jinja template")
    return value
