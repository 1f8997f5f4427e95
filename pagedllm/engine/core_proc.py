"""EngineCoreProc: the EngineCore in its own process, talking ZMQ (msgspec msgpack) to its
front ends; DPEngineCoreProc: the same as one data-parallel engine among several.

Three threads, so the model never waits for (de)serialization and sockets never wait for the
model:

- input thread: reads `[EngineCoreRequestType, payload]` frames from every front end (one
  DEALER per front end, see engine/utils.py) and from the DP coordinator, decodes them and
  puts `(client index, type, message)` on the input queue;
- main thread, the busy loop: drain the input queue (add / abort / utility / shutdown), run
  `EngineCore.step()` while there is work, put the `EngineCoreOutputs` on the output queue,
  and block on the input queue when idle;
- output thread: encodes `EngineCoreOutputs` onto the PUSH socket of the front end they are
  for (each request's outputs go to the front end that sent it).

Start-up: the handshake of engine/utils.py (HELLO, addresses, then READY with the number of
KV blocks, or FAILED with the error).

Lifetime: the process exits on a SHUTDOWN message (from a front end or the coordinator), on
SIGTERM / SIGINT, and when its parent dies (a watchdog thread polls the parent pid). If
`step()` raises (or a worker of a multi-process executor dies: its failure callback wakes the
busy loop, which raises), or a signal stops it, the process sends a dead-notice (a utility reply with
call id `ENGINE_DEAD_CALL_ID`) to every front end before it exits; they then fail its
requests with `EngineDeadError`.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig
from pagedllm.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHealth,
    FinishReason,
    SchedulerStats,
)
from pagedllm.engine.snapshot import SNAPSHOT_INTERVAL_S
from pagedllm.engine.stall import StallWatchdog, StepBlocker, describe_in_flight
from pagedllm.engine.utils import (
    HANDSHAKE_ADDRESSES,
    HANDSHAKE_FAILED,
    HANDSHAKE_HELLO,
    HANDSHAKE_READY,
    EngineZmqAddresses,
    engine_identity,
    ready_timeout_s,
)
from pagedllm.spawn import exit_process, settle_forked_engine
from pagedllm.worker.cpu_binding import CPU_BIND_ENV, bind_threads, plan_cpu_binding

logger = logging.getLogger(__name__)

ENGINE_DEAD_CALL_ID = -1
# The dead notice of an engine stopped by SIGTERM / SIGINT: stopped, not failed (a Ctrl-C in
# a terminal signals the front end and its engines at once).
SIGNAL_STOP_NOTICE = "engine core stopped by a signal (SIGTERM / SIGINT)"
# How often the input thread and the parent watchdog wake up to check for shutdown.
_POLL_INTERVAL_S = 0.2
# Idle work (EngineCore.idle_work) starts once the engine has been idle this long: right
# after start-up the front end is still loading its tokenizer on the same cores, and the
# work (weights onto huge pages, the KV cache's pages) would only slow it (`LLM(...)` 1.5-1.7
# s against 1.1-1.4 s without idle work, 2 vCPUs).
_IDLE_WORK_DELAY_S = 1.0
# Grace period for a clean exit after the parent died before the process is cut off hard.
_ORPHAN_EXIT_GRACE_S = 5.0
# Messages from the coordinator carry this client index.
_COORDINATOR = -1

# Utility methods answered by EngineCoreProc itself; everything else goes to the EngineCore.
_PROC_UTILITIES = ("get_num_blocks",)
# Utility methods answered by EngineCoreProc that need to know which front end asks.
_CLIENT_UTILITIES = ("set_snapshots",)


def _configure_child_logging(rank: int) -> None:
    """A spawned process starts with no logging set up; match the front end's format."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
            format=f"%(levelname)s %(asctime)s [EngineCore_DP{rank} pid=%(process)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )


class StartupError(RuntimeError):
    """The engine core could not be built; the text goes to the head in the handshake."""


class EngineHandshake:
    """The engine's side of the start-up handshake (engine/utils.py): `hello()` returns the
    addresses the head hands out; `ready()` / `failed()` end it."""

    def __init__(self, ctx: zmq.Context, address: str, rank: int, local: bool) -> None:
        self.rank = rank
        self.local = local
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, engine_identity(rank))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.connect(address)
        self._encoder = msgspec.msgpack.Encoder()

    def hello(self, stop: threading.Event) -> EngineZmqAddresses:
        self._send({"status": HANDSHAKE_HELLO, "local": self.local, "pid": os.getpid()})
        deadline = time.monotonic() + ready_timeout_s()
        while not self.sock.poll(int(_POLL_INTERVAL_S * 1000)):
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError("no answer from the head node's handshake socket")
        reply = msgspec.msgpack.decode(self.sock.recv())
        if reply.get("status") != HANDSHAKE_ADDRESSES:
            raise RuntimeError(f"the head node rejected this engine: {reply.get('error')}")
        return msgspec.convert(reply["addresses"], EngineZmqAddresses)

    def ready(self, num_blocks: int) -> None:
        self._send({"status": HANDSHAKE_READY, "num_blocks": num_blocks, "pid": os.getpid()})

    def failed(self, error: str) -> None:
        self._send({"status": HANDSHAKE_FAILED, "error": error})

    def _send(self, msg: dict[str, Any]) -> None:
        self.sock.send(self._encoder.encode({**msg, "rank": self.rank}))

    def close(self) -> None:
        self.sock.close()


class EngineCoreProc:
    """Owns one EngineCore inside the engine process and serves it to its front ends.

    Contract: construct only inside the child (see `run_engine_core`), after the handshake
    gave the addresses; `run_busy_loop` returns when a shutdown was requested (message,
    signal or orphaning) and raises if the engine core fails. Messages to the core are
    handled in arrival order.
    """

    def __init__(
        self,
        config: EngineConfig,
        ctx: zmq.Context,
        addresses: EngineZmqAddresses,
        engine_index: int,
        stop: threading.Event,
        engine_core_cls: type | None = None,
    ) -> None:
        self.engine_index = engine_index
        self.addresses = addresses
        self.input_queue: queue.Queue[tuple[int, EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[tuple[int, EngineCoreOutputs] | None] = queue.Queue()
        self._stop = stop
        self._ctx = ctx
        self._encoder = msgspec.msgpack.Encoder()
        # request id -> index of the front end that sent it (its outputs go back there).
        self._request_clients: dict[str, int] = {}
        self._out_sockets: list[zmq.Socket] = []
        for address in addresses.outputs:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            self._out_sockets.append(sock)

        try:
            if engine_core_cls is None:
                from pagedllm.engine.core import EngineCore

                engine_core_cls = EngineCore
            self.engine_core = engine_core_cls(config)
        except SystemExit:  # SIGTERM while starting (the front end stops us): no failure
            self._close_sockets()
            raise
        except BaseException as e:
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            logger.error("EngineCore failed to start:\n%s", traceback.format_exc())
            self._close_sockets()
            raise StartupError(text) from e

        executor = getattr(self.engine_core, "executor", None)
        if executor is not None:
            executor.register_failure_callback(self._on_executor_failure)
        # Whether the stats the front end last saw may be stale (see _process_engine_step).
        self._stats_dirty = False
        # Idle work: the CPU weights' move onto huge pages and the KV cache's pages faulted
        # in ahead of use (ModelRunner.idle_work).
        self._idle_work = getattr(self.engine_core, "idle_work", None)
        self._idle_since: float | None = None  # when the engine last ran out of work
        self._threads: list[threading.Thread] = []
        # Front ends that asked for dashboard snapshots (engine/snapshot.py), and when the
        # last one was sent.
        self._snapshot_clients: set[int] = set()
        self._last_snapshot = 0.0
        self._step_blocker = StepBlocker.from_env()
        self._watchdog: StallWatchdog | None = None
        if config.stall_timeout_s > 0 and hasattr(self.engine_core, "scheduler"):
            self._watchdog = StallWatchdog(
                config.stall_timeout_s,
                engine_index,
                has_work=self.engine_core.has_unfinished_requests,
                describe=lambda: describe_in_flight(self.engine_core.scheduler),
                send=self._send_health,
                stop=stop,
            )

    def start(self, handshake: EngineHandshake) -> None:
        """Start the threads and end the handshake with READY. Apart from the constructor,
        so that whoever stops this object knows it before any thread runs."""
        self._start_thread(self._process_input_sockets, "EngineCoreInput")
        handshake.ready(self.get_num_blocks())
        self._start_thread(self._process_output_sockets, "EngineCoreOutput")
        if self._watchdog is not None:
            self._start_thread(self._watchdog.run, "EngineCoreStallWatchdog")

    def _start_thread(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    # ----------------------------------------------------------------------------- main loop

    def run_busy_loop(self) -> None:
        """Drain inputs, step, push outputs; block on the input queue when there is no work."""
        while not self._stop.is_set():
            self._process_input_queue()
            if self._stop.is_set():
                break
            self._process_engine_step()

    def _process_input_queue(self) -> None:
        has_work = self.engine_core.has_unfinished_requests() or self._stats_dirty
        if has_work:
            self._idle_since = None
        while not has_work and not self._stop.is_set():
            if self._idle_since is None:  # idle since now (utility calls do not reset it)
                self._idle_since = time.monotonic()
            if self._watchdog is not None:
                self._watchdog.progress()  # idle is not stalled
            # Idle: once idle for _IDLE_WORK_DELAY_S, a piece of idle work while nothing
            # waits (a request that arrives meanwhile waits for one piece, a few ms at most);
            # otherwise sleep until a front end sends something (or shutdown is requested).
            # The timeout lets SIGTERM's handler run: a signal that lands on another thread
            # does not wake a blocked wait.
            wait = _POLL_INTERVAL_S
            if self._idle_work is not None:
                until_idle_work = self._idle_since + _IDLE_WORK_DELAY_S - time.monotonic()
                if until_idle_work <= 0 and self.input_queue.empty():
                    if not self._idle_work():
                        self._idle_work = None
                    continue
                if until_idle_work > 0:
                    wait = min(wait, until_idle_work)
            try:
                self._handle_client_request(*self.input_queue.get(timeout=wait))
                break
            except queue.Empty:
                continue
        while not self.input_queue.empty() and not self._stop.is_set():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        """One step. When the last request has just left (finished or aborted), one more,
        idle, step is run so the front end's gauges (running, KV usage) drop back to 0."""
        had_work = self.engine_core.has_unfinished_requests()
        if not had_work and not self._stats_dirty:
            return
        if had_work:
            self._step_blocker.wait(self._stop)
        outputs = self.engine_core.step()
        if self._watchdog is not None:
            self._watchdog.progress()
        self._stats_dirty = had_work
        self._on_scheduler_stats(outputs.scheduler_stats)
        if outputs.outputs or outputs.scheduler_stats is not None:
            self._send_outputs(outputs, idle=not had_work)
        if self._snapshot_clients:
            # At most one a second, and one as soon as the engine goes idle (the last state).
            now = time.monotonic()
            if now - self._last_snapshot >= SNAPSHOT_INTERVAL_S or not had_work:
                self._send_snapshot(self._snapshot_clients)

    def _send_snapshot(self, clients: set[int]) -> None:
        self._last_snapshot = time.monotonic()
        snapshot = self.engine_core.make_snapshot()
        for client in clients:
            self.output_queue.put(
                (client, EngineCoreOutputs(snapshot=snapshot, engine_index=self.engine_index))
            )

    def set_snapshots(self, client: int, enabled: bool) -> bool:
        """Utility: front end `client` wants dashboard snapshots (or no longer); it gets one
        at once. False if this engine core cannot make them."""
        if not hasattr(self.engine_core, "make_snapshot"):
            return False
        if not enabled:
            self._snapshot_clients.discard(client)
            return True
        if not self._snapshot_clients:
            self.engine_core.step_times.take()  # the step split starts now, not at start-up
        self._snapshot_clients.add(client)
        self._send_snapshot({client})
        return True

    def _send_health(self, health: EngineHealth) -> None:
        """The watchdog's heartbeat (any thread), to every front end."""
        for client in range(len(self._out_sockets)):
            self.output_queue.put(
                (client, EngineCoreOutputs(health=health, engine_index=self.engine_index))
            )

    def _on_scheduler_stats(self, stats: SchedulerStats | None) -> None:
        """Hook for DPEngineCoreProc (queue lengths for the coordinator)."""

    def _send_outputs(self, outputs: EngineCoreOutputs, idle: bool = False) -> None:
        """Queue each request's outputs for the front end that sent it; the scheduler stats
        go to exactly one front end (the first with outputs), so none is counted twice. The
        step that leaves the engine `idle` also sends its gauges (running, waiting, KV usage;
        no counts) to every other front end: each API server's last gauge write is then the
        idle state, whichever of them wrote last (one that handled an older step's stats
        after another handled the idle one would otherwise leave a stale gauge)."""
        outputs.engine_index = self.engine_index
        clients = self._request_clients
        if len(self._out_sockets) == 1:
            for out in outputs.outputs:
                if out.finished:
                    clients.pop(out.request_id, None)
            self.output_queue.put((0, outputs))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for out in outputs.outputs:
            index = (
                clients.pop(out.request_id, 0) if out.finished else clients.get(out.request_id, 0)
            )
            by_client.setdefault(index, []).append(out)
        first = next(iter(by_client), 0)
        stats = outputs.scheduler_stats
        gauges = None
        if idle and stats is not None:
            gauges = msgspec.structs.replace(
                stats,
                prefix_cache_queries=0,
                prefix_cache_hits=0,
                num_preemptions=0,
                spec_decode=None,
            )
        targets = (
            range(len(self._out_sockets)) if gauges is not None else by_client.keys() | {first}
        )
        for index in targets:
            part = msgspec.structs.replace(
                outputs,
                outputs=by_client.get(index, []),
                scheduler_stats=stats if index == first else gauges,
            )
            self.output_queue.put((index, part))

    def _handle_client_request(
        self, client: int, request_type: EngineCoreRequestType, message: Any
    ) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self._stats_dirty = True
            self._request_clients[message.request_id] = client
            try:
                self.engine_core.add_request(message)
            except Exception as e:
                # The front end validates first, so this is rare; finish the request rather
                # than leave its caller waiting forever.
                logger.error("Rejected request %s: %s", message.request_id, e)
                rejected = EngineCoreOutput(
                    request_id=message.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ABORT,
                    stop_reason=str(e),
                )
                self._send_outputs(EngineCoreOutputs(outputs=[rejected]))
        elif request_type == EngineCoreRequestType.ABORT:
            self._stats_dirty = True
            for request_id in message:
                self._request_clients.pop(request_id, None)
            self.engine_core.abort_requests(list(message))
        elif request_type == EngineCoreRequestType.UTILITY:
            call_id, method, args = message
            if method in _CLIENT_UTILITIES:
                args = [client, *(args or ())]
            reply = self._call_utility(call_id, method, args)
            self.output_queue.put(
                (client, EngineCoreOutputs(utility_output=reply, engine_index=self.engine_index))
            )
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            self._stop.set()
        elif request_type == EngineCoreRequestType.START_DP_WAVE:
            self._on_start_wave(message)
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"the executor failed: {message}")
        else:
            logger.error("Unknown request type %r ignored", request_type)

    def _on_executor_failure(self, reason: str) -> None:
        """Executor callback (any thread): make the busy loop raise at its next turn, even
        while idle (a dead worker of a multi-process executor)."""
        self.input_queue.put((0, EngineCoreRequestType.EXECUTOR_FAILED, reason))

    def _on_start_wave(self, wave: int) -> None:
        """The coordinator's lockstep seam (engine/coordinator.py); dense engines step on
        their own, so a wave start needs nothing from them."""

    def _call_utility(self, call_id: int, method: str, args: Any) -> tuple[int, Any, str | None]:
        try:
            if method in _PROC_UTILITIES or method in _CLIENT_UTILITIES:
                fn = getattr(self, method)
            elif method.startswith("_") or not callable(getattr(self.engine_core, method, None)):
                raise AttributeError(f"EngineCore has no utility method {method!r}")
            else:
                fn = getattr(self.engine_core, method)
            result = msgspec.to_builtins(fn(*(args or ())))
            return (call_id, result, None)
        except Exception as e:
            logger.warning("Utility call %s failed: %s", method, e)
            return (call_id, None, f"{type(e).__name__}: {e}")

    def get_num_blocks(self) -> int:
        return self.engine_core.num_blocks

    # ------------------------------------------------------------------------------- threads

    def _process_input_sockets(self) -> None:
        """Input thread: ZMQ frames from every front end (and the coordinator) -> decoded
        messages on the input queue, tagged with the front end's index."""
        poller = zmq.Poller()
        sockets: dict[zmq.Socket, int] = {}
        for index, address in enumerate(self.addresses.inputs):
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, engine_identity(self.engine_index))
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.connect(address)
            sockets[sock] = index
        if self.addresses.coordinator_engines:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self.addresses.coordinator_engines)
            sockets[sock] = _COORDINATOR
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        any_decoder = msgspec.msgpack.Decoder()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(int(_POLL_INTERVAL_S * 1000)):
                    frames = sock.recv_multipart(copy=False)
                    request_type = EngineCoreRequestType(bytes(frames[0].buffer))
                    if request_type == EngineCoreRequestType.ADD:
                        message = add_decoder.decode(frames[1].buffer)
                    elif len(frames) > 1:
                        message = any_decoder.decode(frames[1].buffer)
                    else:
                        message = None
                    if request_type == EngineCoreRequestType.SHUTDOWN:
                        self.request_shutdown()
                    else:
                        self.input_queue.put((sockets[sock], request_type, message))
        except Exception:
            logger.exception("EngineCore input thread failed; shutting down")
            self.request_shutdown()
        finally:
            for sock in sockets:
                sock.close()

    def _process_output_sockets(self) -> None:
        """Output thread: encodes what the busy loop produced; `None` ends it after a flush."""
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            client, outputs = item
            self._out_sockets[client].send(self._encoder.encode(outputs), copy=False)

    def request_shutdown(self) -> None:
        """Thread-safe: makes the busy loop return at its next turn."""
        self._stop.set()
        self.input_queue.put((0, EngineCoreRequestType.SHUTDOWN, None))

    # ------------------------------------------------------------------------------ shutdown

    def send_dead_notice(self, error: str) -> None:
        """Tell every front end this engine is gone, and why."""
        for client in range(len(self._out_sockets)):
            notice = EngineCoreOutputs(
                utility_output=(ENGINE_DEAD_CALL_ID, None, error), engine_index=self.engine_index
            )
            self.output_queue.put((client, notice))

    def shutdown(self) -> None:
        """Stops the engine core and the threads; outputs already queued are still sent."""
        self._stop.set()
        try:
            self.engine_core.shutdown()
        except Exception:
            logger.exception("EngineCore.shutdown failed")
        self.output_queue.put(None)
        # Output first: it flushes what is queued. Every socket must be closed by its own
        # thread before the context goes.
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._out_sockets:
            sock.close()


class DPEngineCoreProc(EngineCoreProc):
    """One data-parallel engine: an EngineCoreProc that also reports its queue lengths
    (waiting, running) to the DP coordinator, whenever they change and at least every
    `HEARTBEAT_INTERVAL_S` (its heartbeat), from a thread of its own so that a long step
    never looks like a dead engine."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._counts = (0, 0)
        self._counts_changed = threading.Event()
        super().__init__(*args, **kwargs)

    def start(self, handshake: EngineHandshake) -> None:
        super().start(handshake)
        self._start_thread(self._report_counts, "EngineCoreStats")

    def shutdown(self) -> None:
        self._stop.set()
        self._counts_changed.set()  # wakes the stats thread
        super().shutdown()

    def _on_scheduler_stats(self, stats: SchedulerStats | None) -> None:
        if stats is None:
            return
        counts = (stats.num_waiting_reqs, stats.num_running_reqs)
        if counts != self._counts:
            self._counts = counts
            self._counts_changed.set()

    def _report_counts(self) -> None:
        from pagedllm.engine.coordinator import HEARTBEAT_INTERVAL_S

        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.addresses.coordinator_input)
        encoder = msgspec.msgpack.Encoder()
        try:
            while not self._stop.is_set():
                waiting, running = self._counts
                sock.send(encoder.encode(["counts", self.engine_index, waiting, running]))
                self._counts_changed.wait(HEARTBEAT_INTERVAL_S)
                self._counts_changed.clear()
        finally:
            sock.close()

    def send_dead_notice(self, error: str) -> None:
        super().send_dead_notice(error)
        from pagedllm.engine.coordinator import report_engine_death

        report_engine_death(self._ctx, self.addresses.coordinator_input, self.engine_index, error)


def _parent_watchdog(
    parent_pid: int, stop: threading.Event, procs: list[EngineCoreProc], handshake_address: str
) -> None:
    """Exits the process once the front end (or headless node) that owns it is gone."""
    while not stop.wait(_POLL_INTERVAL_S):
        if os.getppid() == parent_pid:
            continue
        logger.warning("Parent process %d died; EngineCore shutting down", parent_pid)
        stop.set()
        for proc in procs:
            proc.request_shutdown()
        # The parent cannot clean up its ipc socket directory any more.
        if handshake_address.startswith("ipc://"):
            shutil.rmtree(os.path.dirname(handshake_address[6:]), ignore_errors=True)
        # A clean exit ends this daemon thread with the process; if the busy loop is stuck
        # (a long step, a hung kernel), cut the process off.
        time.sleep(_ORPHAN_EXIT_GRACE_S)
        os._exit(1)


def set_data_parallel_rank(config: EngineConfig, dp_rank: int, local_dp_rank: int) -> None:
    """Make `config` (this engine process's copy) the config of data-parallel engine
    `dp_rank`. With a KV connector, each engine is a peer of its own, as in vLLM: its
    `engine_id` gets the suffix `_dp<rank>` and a fixed `kv_port` is offset by the local rank
    (engines of one node must not bind the same port)."""
    parallel = config.parallel_config
    parallel.data_parallel_rank = dp_rank
    parallel.data_parallel_rank_local = local_dp_rank
    kv = config.kv_transfer_config
    if kv is not None and parallel.data_parallel_size > 1:
        kv.engine_id = f"{kv.engine_id}_dp{dp_rank}"
        if kv.kv_port:
            kv.kv_port += local_dp_rank


def run_engine_core(
    config: EngineConfig,
    handshake_address: str,
    dp_rank: int,
    local_dp_rank: int,
    local: bool,
    parent_pid: int | None,
    engine_core_cls: type | None = None,
) -> int:
    """Run one engine core until it is stopped; returns the exit code (0: stopped as asked,
    1: failed). A Ray actor calls it with `parent_pid=None`, as Ray ends actors whose owner is
    gone; an engine process runs it through `engine_process_main`."""
    _configure_child_logging(dp_rank)
    set_data_parallel_rank(config, dp_rank, local_dp_rank)

    ctx = zmq.Context()
    stop = threading.Event()
    procs: list[EngineCoreProc] = []
    signalled: list[int] = []

    def _on_signal(signum: int, frame: Any) -> None:
        # Running: stop at the end of the current step (only the flag: the interrupted
        # code may hold the input queue's lock). Starting: abort the start.
        signalled.append(signum)
        stop.set()
        if not procs:
            raise SystemExit(0)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    if parent_pid is not None:
        threading.Thread(
            target=_parent_watchdog,
            args=(parent_pid, stop, procs, handshake_address),
            name="ParentWatchdog",
            daemon=True,
        ).start()
    handshake = EngineHandshake(ctx, handshake_address, dp_rank, local)
    failed = False
    try:
        try:
            addresses = handshake.hello(stop)
            proc_cls = DPEngineCoreProc if addresses.coordinator_input else EngineCoreProc
            procs.append(proc_cls(config, ctx, addresses, dp_rank, stop, engine_core_cls))
            procs[0].start(handshake)
        except StartupError as e:
            handshake.failed(str(e))
            raise
        finally:
            handshake.close()
        procs[0].run_busy_loop()
        if signalled:
            logger.info("EngineCore received a termination signal; shutting down")
            procs[0].send_dead_notice(SIGNAL_STOP_NOTICE)
    except SystemExit:
        logger.info("EngineCore start-up interrupted by a signal")
    except BaseException as e:
        failed = True
        if not procs:
            logger.error("EngineCore failed to start: %s", e)
        else:
            logger.error("EngineCore hit a fatal error:\n%s", traceback.format_exc())
            procs[0].send_dead_notice(f"{type(e).__name__}: {e}")
    finally:
        if threading.current_thread() is threading.main_thread():
            # A second signal while shutting down should not interrupt the clean-up.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        for proc in procs:
            proc.shutdown()
        ctx.destroy(linger=2000)
    return 1 if failed else 0


def engine_cpu_cores(
    config: EngineConfig, local_dp_rank: int, available: set[int] | None = None
) -> set[int] | None:
    """On the CPU, the cores of this node's data-parallel engine `local_dp_rank`: the node's
    cores (`available`, default this process's affinity) split evenly between its engines, so
    that engines never share a core (the `auto` of PAGEDLLM_CPU_OMP_THREADS_BIND, the default;
    an engine's executor then splits its share between its workers). None (no pinning) for one
    engine, on GPUs, or when that variable is `nobind` or names explicit groups."""
    parallel = config.parallel_config
    if config.device_config.device != "cpu" or parallel.data_parallel_size_local <= 1:
        return None
    if os.environ.get(CPU_BIND_ENV, "auto").strip() != "auto":
        return None
    return plan_cpu_binding(parallel.data_parallel_size_local, "auto", available)[local_dp_rank]


def pin_engine_process(config: EngineConfig, local_dp_rank: int) -> set[int] | None:
    """Pin this engine process to its cores (`engine_cpu_cores`) and size torch's compute
    threads to them; returns the cores (None: not pinned). torch and its OpenMP runtime are
    loaded by now, sized for every core the process could use: without the resize, a spawned
    engine pinned to one core ran two compute threads on it, each stalling the other.
    OMP_NUM_THREADS is set for this engine's own worker processes."""
    cores = engine_cpu_cores(config, local_dp_rank)
    if cores:
        os.environ.setdefault("OMP_NUM_THREADS", str(bind_threads(cores)))
    return cores


def engine_process_main(**kwargs: Any) -> None:
    """Entry point of an engine process (multiprocessing target, forked or spawned). Once the engine has
    stopped and flushed its sockets, the process ends without the interpreter's finalization,
    which can stall for seconds collecting the model's object graph."""
    pin_engine_process(kwargs["config"], kwargs["local_dp_rank"])
    if kwargs.pop("forked", False):
        settle_forked_engine()
    exit_process(run_engine_core(**kwargs))
