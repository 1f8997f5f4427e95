"""Flags of the OpenAI-compatible server (`pagedllm serve`): vLLM's server flags plus every
engine flag from `EngineArgs.add_cli_args`."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from pagedllm.engine.arg_utils import json_object_arg
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS

API_KEY_ENV = "PAGEDLLM_API_KEY"
# vLLM's VLLM_MAX_N_SEQUENCES and VLLM_KEEP_ALIVE_ON_ENGINE_DEATH.
MAX_N_SEQUENCES_ENV = "PAGEDLLM_MAX_N_SEQUENCES"
KEEP_ALIVE_ENV = "PAGEDLLM_KEEP_ALIVE_ON_ENGINE_DEATH"

logger = logging.getLogger(__name__)


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
        "--config",
        type=str,
        default=None,
        help="A YAML file of flags (keys are flag names, e.g. `max-model-len: 256`); flags "
        "given on the command line win over the file.",
    )
    group.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log each request as it arrives (id, user, sampling parameters, prompt length; "
        "the prompt itself at DEBUG, PAGEDLLM_LOGGING_LEVEL=DEBUG) and as it finishes or is "
        "aborted.",
    )
    group.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="With --enable-log-requests: log each finished choice's text (its token ids at "
        "DEBUG).",
    )
    group.add_argument(
        "--max-log-len",
        type=_non_negative_int,
        default=None,
        help="Log at most this many characters or token ids of a prompt or output (default: all).",
    )
    group.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Deprecated (vLLM's old flag): requests are not logged unless --enable-log-requests.",
    )
    for what in ("origins", "methods", "headers"):
        group.add_argument(
            f"--allowed-{what}",
            type=json.loads,
            default=["*"],
            help=f'CORS: {what} allowed, a JSON list (default ["*"]).',
        )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    group.add_argument(
        "--chat-template",
        type=str,
        default=None,
        help="A Jinja chat template, or a file holding one (default: the tokenizer's).",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="Accept a chat_template sent with a request (refused by default, as vLLM's).",
    )
    group.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='Leave a request\'s tools out of the prompt when its tool_choice is "none".',
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
    group.add_argument(
        "--response-role",
        default="assistant",
        help="The role of the reply's message after a generation prompt (default assistant).",
    )
    group.add_argument(
        "--default-chat-template-kwargs",
        type=json_object_arg,
        default=None,
        help="chat_template_kwargs every chat request starts from (its own win), e.g. "
        "'{\"enable_thinking\": false}'.",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="Logprob tokens as 'token_id:N' unless a request says otherwise.",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="End every stream with a usage chunk, asked for or not.",
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="Answer every request with an X-Request-Id header (the request's own, or a new "
        "id, which the generation endpoints then use as the request's id).",
    )
    group.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="No uvicorn access log."
    )
    group.add_argument(
        "--disable-access-log-for-endpoints",
        type=str,
        default=None,
        help='No access-log lines for these paths, a comma list (e.g. "/health,/metrics").',
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help='Serve GET /load: the generation requests in flight ({"server_load": N}).',
    )
    group.add_argument(
        "--middleware",
        action="append",
        default=[],
        help="Import path of an ASGI middleware class or an async (request, call_next) "
        "function to add to the app; repeat for several.",
    )
    group.add_argument(
        "--sse-keep-alive-interval",
        type=_non_negative_int,
        default=0,
        help="Send an SSE comment line on a stream that has been idle this many seconds "
        "(for proxies with read timeouts; default 0: never).",
    )
    group.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="No /docs, /redoc or /openapi.json.",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Report usage.prompt_tokens_details.cached_tokens (the prompt tokens served "
        "from the prefix cache) in chat and completions responses.",
    )
    group.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="Serve GET /tokenizer_info (vLLM's opt-in endpoint: the tokenizer's config and "
        "chat template, which lm-eval's tokenizer_backend=remote reads).",
    )
    add_limit_args(group)
    group.add_argument("--ssl-keyfile", type=str, default=None, help="TLS key file.")
    group.add_argument("--ssl-certfile", type=str, default=None, help="TLS certificate file.")
    group.add_argument("--root-path", type=str, default=None, help="ASGI root path (proxies).")
    group.add_argument(
        "--uds",
        type=str,
        default=None,
        help="Serve on this Unix domain socket path instead of --host / --port.",
    )
    group.add_argument(
        "--timeout-graceful-shutdown",
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="Seconds in-flight requests get to finish after SIGTERM / Ctrl-C before they are "
        "aborted (--shutdown-timeout: vLLM's name; 0 aborts them at once).",
    )
    group.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port, each talking to every engine.",
    )
    group.add_argument(
        "--headless",
        action="store_true",
        help="Run only engine cores, which join the head node at --data-parallel-address "
        "(with --data-parallel-start-rank and --data-parallel-size-local).",
    )
    EngineArgs.add_cli_args(parser)
    return parser


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    """Request limits (limits.py) and what the server does when its engine dies."""
    from pagedllm.config import env_flag
    from pagedllm.entrypoints.openai.limits import (
        DEFAULT_MAX_N_SEQUENCES,
        DEFAULT_MAX_REQUEST_BODY_BYTES,
    )

    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="Refuse (400) a request body larger than this, before parsing it.",
    )
    group.add_argument(
        "--max-prompt-chars",
        type=int,
        default=None,
        help="Refuse (400) a prompt (or rendered chat) longer than this many characters "
        "before tokenizing it (default: max_model_len times the longest vocabulary entry, "
        "beyond which a prompt cannot fit).",
    )
    group.add_argument(
        "--max-n-sequences",
        type=int,
        default=int(os.environ.get(MAX_N_SEQUENCES_ENV, DEFAULT_MAX_N_SEQUENCES)),
        help=f"Largest `n` a request may ask for (default: ${MAX_N_SEQUENCES_ENV} or "
        f"{DEFAULT_MAX_N_SEQUENCES}, OpenAI's limit).",
    )
    group.add_argument(
        "--disable-dashboard",
        action="store_true",
        help="Do not serve the live dashboard at /dashboard (it is behind --api-key when "
        "one is set).",
    )
    group.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        default=env_flag(KEEP_ALIVE_ENV, False),
        help="If the engine dies, keep serving (503 to every request) instead of failing "
        f"in-flight requests and exiting with status 1 for a supervisor to restart the "
        f"server (default: ${KEEP_ALIVE_ENV}, else off).",
    )


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a non-negative integer")
    return number


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


def log_requests_enabled(args: argparse.Namespace) -> bool:
    """`--enable-log-requests` (vLLM's flag); ValueError together with the old opposite."""
    enabled = bool(getattr(args, "enable_log_requests", False))
    if getattr(args, "disable_log_requests", False):
        if enabled:
            raise ValueError("--enable-log-requests and --disable-log-requests contradict")
        logger.warning("--disable-log-requests is deprecated: requests are not logged by default")
    return enabled


def expand_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """Replace `--config FILE` in `argv` (a verb's arguments) by the flags the YAML file
    holds, placed before all other arguments so that the command line wins (argparse keeps
    the last value). Keys are flag names (`max-model-len` or `max_model_len`); `true` turns a
    switch on and `false` off; a list fills a multi-value flag or becomes JSON, as does a
    mapping. A key that is no flag is a ValueError naming it."""
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        return argv
    rest: list[str] = []
    path = None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if not path:
        raise ValueError("--config needs a YAML file")
    return _config_args(parser, path) + rest


def _config_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise ValueError(f"--config {path}: expected a mapping of flag names to values")
    actions = {opt: a for a in parser._actions for opt in a.option_strings}
    args: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise ValueError(f"--config {path}: {key!r} is not a flag of this command")
        args.extend(_flag_args(flag, action, value))
    return args


def _flag_args(flag: str, action: argparse.Action, value: Any) -> list[str]:
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        if action.nargs == 0:  # store_true
            return [flag] if value else []
        return [flag, json.dumps(value)]
    if isinstance(value, list) and action.nargs in ("+", "*"):
        return [flag, *(str(v) for v in value)]
    if isinstance(value, list) and isinstance(action, argparse._AppendAction):
        return [arg for v in value for arg in (flag, str(v))]
    if isinstance(value, (list, dict)):
        return [flag, json.dumps(value)]
    return [flag, str(value)]
