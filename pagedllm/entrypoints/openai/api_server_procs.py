"""Several API server processes on one port (`pagedllm serve --api-server-count K`).

The head process binds the listening socket once and hands it to each API server process
(the kernel spreads the connections over the processes that accept on it), launches the
engines for K front ends (engine/utils.py: `EngineLauncher`), and gives API server `i` the
addresses of its own input / output sockets (`ClientConfig`). Every API server talks to every
engine. Their `/metrics` are shared through prometheus_client's multiprocess mode (see
metrics/prometheus.py); the head sets `PROMETHEUS_MULTIPROC_DIR` before it starts them.

The API servers open for business together (`StartGate`): while one still loads, its port
answers 503 "starting" (starting.py), and on a shared socket that responder would take some
of the connections meant for a sibling that is already up. So each server stops its responder,
then waits until every sibling has too, and only then starts accepting; connections made in
between wait in the socket's backlog.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import signal
import socket
import threading
import time
from typing import Any

from pagedllm.engine.utils import ClientConfig
from pagedllm.spawn import main_module_hidden

logger = logging.getLogger(__name__)

_POLL_S = 0.5
_GATE_POLL_S = 0.01
# How long a server that is ready waits for slow siblings before it serves anyway.
_GATE_TIMEOUT_S = 120.0


class StartGate:
    """A count shared by the API server processes: `arrive()` when this server's "starting"
    responder is closed; `wait_all()` until all `parties` have arrived (or the time-out)."""

    def __init__(self, ctx: Any, parties: int) -> None:
        self.parties = parties
        self._count = ctx.Value("i", 0)

    def arrive(self) -> None:
        with self._count.get_lock():
            self._count.value += 1

    async def wait_all(self, timeout_s: float = _GATE_TIMEOUT_S) -> bool:
        """True once every server arrived; False after `timeout_s` (then serve anyway: a
        sibling that hangs must not keep this one closed; the head stops one that dies)."""
        deadline = time.monotonic() + timeout_s
        while self._count.value < self.parties:
            if time.monotonic() > deadline:
                logger.warning(
                    "%d of %d API servers are up after %.0f s; serving without the others",
                    self._count.value,
                    self.parties,
                    timeout_s,
                )
                return False
            await asyncio.sleep(_GATE_POLL_S)
        return True


def _stop_procs(procs: list[Any], grace_s: float) -> None:
    """SIGTERM (uvicorn then finishes open requests), then SIGKILL after `grace_s`."""
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        if proc.pid is not None:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
    for proc in procs:
        if proc.pid is not None and proc.is_alive():
            logger.warning("API server pid=%s did not exit; killing it", proc.pid)
            proc.kill()
            proc.join(timeout=5.0)


class APIServerProcessManager:
    """Starts one API server process per `ClientConfig`, all serving on `sock`.

    Contract: `wait(stop)` returns when `stop` is set or any API server exits (the head then
    stops everything, as vLLM does); `shutdown()` is idempotent and runs at interpreter exit."""

    def __init__(
        self, args: argparse.Namespace, sock: socket.socket, client_configs: list[ClientConfig]
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        # Held here: the children rebuild its lock by name after they start.
        self.gate = gate = StartGate(ctx, len(client_configs))
        self.procs = [
            ctx.Process(
                target=run_api_server_worker,
                name=f"APIServer_{config.client_index}",
                args=(args, sock, config, os.getpid(), gate),
            )
            for config in client_configs
        ]
        grace = float(getattr(args, "timeout_graceful_shutdown", 10.0)) + 5.0
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_procs, args=(self.procs, grace), exitpriority=100
        )
        with main_module_hidden(None):
            for proc in self.procs:
                proc.start()

    def wait(self, stop: threading.Event) -> int | None:
        """The exit code of the first API server to exit, or None when `stop` was set."""
        sentinels = {proc.sentinel: proc for proc in self.procs}
        while not stop.is_set():
            ready = multiprocessing.connection.wait(list(sentinels), timeout=_POLL_S)
            if ready:
                proc = sentinels[ready[0]]
                proc.join(timeout=1.0)
                logger.error("API server %s exited with code %s", proc.name, proc.exitcode)
                return proc.exitcode
        return None

    def shutdown(self) -> None:
        self._finalizer()


def _parent_watchdog(parent_pid: int) -> None:
    """An orphaned API server stops itself the way SIGTERM would (uvicorn's graceful exit)."""
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    logger.warning("The head process %d died; stopping this API server", parent_pid)
    os.kill(os.getpid(), signal.SIGTERM)


def run_api_server_worker(
    args: argparse.Namespace,
    sock: socket.socket,
    client_config: ClientConfig,
    parent_pid: int,
    gate: StartGate,
) -> None:
    """Entry point of one API server process: the usual server, on the shared socket, with an
    AsyncLLM that reaches the head's engines through `client_config`, opening with its
    siblings through `gate`; exits with `run_server`'s status."""
    from pagedllm.entrypoints.openai.api_server import run_server

    logging.basicConfig(
        level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
        format=f"%(levelname)s %(asctime)s [APIServer_{client_config.client_index} "
        "pid=%(process)d] %(name)s: %(message)s",
    )
    threading.Thread(target=_parent_watchdog, args=(parent_pid,), daemon=True).start()
    # The head owns the shutdown (SIGTERM to each API server): a Ctrl-C, which reaches the
    # whole process group, is ignored here rather than raised as a KeyboardInterrupt (asyncio
    # and uvicorn re-raise it after their graceful exit, a traceback per process).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(run_server(args, sock, client_config, gate))
