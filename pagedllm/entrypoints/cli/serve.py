"""`pagedllm serve [MODEL_DIR]`: the OpenAI-compatible server, with vLLM's flags.

With no model (positional or `--model`), it serves the demo model (SmolLM2-135M-Instruct,
fetched and converted on first use into the user's cache directory) under its name. Three shapes, as in vLLM:

- one API server (default), which launches the engines itself (`--data-parallel-size D`);
- `--api-server-count K`: this process launches the engines and K API server processes on
  one port (entrypoints/openai/api_server_procs.py), then watches them;
- `--headless`: only engine cores (`--data-parallel-size-local` of them, ranks from
  `--data-parallel-start-rank`), which join the head at `--data-parallel-address` /
  `--data-parallel-rpc-port`.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import tempfile
import threading

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagedllm.entrypoints.openai.cli_args import make_arg_parser

    parser = subparsers.add_parser(
        "serve",
        help="start the OpenAI-compatible HTTP server",
        description="Start the OpenAI-compatible HTTP server (vLLM's flags).",
    )
    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="checkpoint directory or .gguf file (default: the demo model)",
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
        from pagedllm.testing.smollm2 import DEMO_MODEL_NAME, fetch_demo_model

        args.model = str(fetch_demo_model())
        args.served_model_name = args.served_model_name or [DEMO_MODEL_NAME]
    check_data_parallel_args(args)
    if args.headless:
        return run_headless(args)
    if args.api_server_count > 1:
        return run_multi_api_server(args)
    return run_server(args)


def check_data_parallel_args(args: argparse.Namespace) -> None:
    """Combinations of the scale-out flags that cannot work are a ValueError naming them."""
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count={args.api_server_count} must be >= 1")
    if args.headless:
        if args.api_server_count > 1:
            raise ValueError("--headless runs no API server; drop --api-server-count")
        if args.data_parallel_backend == "ray":
            raise ValueError(
                "--headless is for --data-parallel-backend mp; with ray the head places "
                "every engine on the Ray cluster"
            )
        if not args.data_parallel_size_local:
            raise ValueError(
                "--headless needs --data-parallel-size-local >= 1 (the engines on this node)"
            )
    elif args.data_parallel_start_rank != 0:
        raise ValueError(
            f"--data-parallel-start-rank={args.data_parallel_start_rank} is for --headless "
            "nodes; the head runs the ranks from 0"
        )
    local, size = args.data_parallel_size_local, args.data_parallel_size
    if args.data_parallel_backend == "ray" and local not in (None, size):
        raise ValueError(
            f"--data-parallel-size-local={local} does not apply to --data-parallel-backend "
            "ray: Ray places all --data-parallel-size engines"
        )


def _stop_on_signals(stop: threading.Event) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())


def run_headless(args: argparse.Namespace) -> int:
    """Run this node's engine cores until they stop (the head's coordinator tells them to
    when the head stops) or SIGTERM / Ctrl-C."""
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.utils import CoreEngineProcManager

    config = EngineArgs.from_cli_args(args).create_engine_config()
    parallel = config.parallel_config
    address = f"tcp://{parallel.data_parallel_address}:{parallel.data_parallel_handshake_port}"
    start = parallel.data_parallel_start_rank
    ranks = list(range(start, start + parallel.data_parallel_size_local))
    logger.info("Headless node: engine cores %s join the head at %s", ranks, address)
    stop = threading.Event()
    _stop_on_signals(stop)
    manager = CoreEngineProcManager(config, address, ranks, local_handshake=False)
    try:
        while not stop.is_set() and len(manager.deaths) < len(ranks):
            stop.wait(0.5)
    finally:
        manager.shutdown()
    return 0


def run_multi_api_server(args: argparse.Namespace) -> int:
    """Launch the engines and `--api-server-count` API servers on one port; stop them all
    on SIGTERM / Ctrl-C or when one API server exits."""
    import zmq

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.coordinator import report_engine_death
    from pagedllm.engine.utils import ClientConfig, EngineLauncher
    from pagedllm.entrypoints.openai.api_server import close_server_socket, create_server_socket
    from pagedllm.entrypoints.openai.api_server_procs import APIServerProcessManager

    num_servers = args.api_server_count
    prometheus_dir = None
    if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:  # before the API servers start
        prometheus_dir = tempfile.mkdtemp(prefix="pagedllm-prometheus-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = prometheus_dir
    stop = threading.Event()
    _stop_on_signals(stop)
    sock = create_server_socket(args.host, args.port, args.uds)  # each API server listens on it
    config = EngineArgs.from_cli_args(args).create_engine_config()
    launcher = EngineLauncher(config, num_clients=num_servers)
    ctx = zmq.Context()
    servers = None
    try:
        coordinator_input = launcher.addresses.coordinator_input

        def on_death(rank: int, reason: str) -> None:
            report_engine_death(ctx, coordinator_input, rank, reason)

        num_blocks = launcher.start_engines(on_death=on_death)
        clients = [ClientConfig(i, launcher.addresses, num_blocks) for i in range(num_servers)]
        logger.info("Starting %d API servers on %s:%d", num_servers, args.host, args.port)
        servers = APIServerProcessManager(args, sock, clients)
        exit_code = servers.wait(stop)
    finally:
        if servers is not None:
            servers.shutdown()
        launcher.shutdown()
        ctx.destroy(linger=0)
        close_server_socket(sock, args.uds)
        if prometheus_dir is not None:
            shutil.rmtree(prometheus_dir, ignore_errors=True)
    return 0 if exit_code in (None, 0) else 1
