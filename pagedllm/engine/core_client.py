"""Clients that talk to engine cores: in-process, or across a process boundary (ZMQ).

`EngineCoreClient.make_client` is the one factory: the in-process client (tests, debugging,
`PAGEDLLM_ENABLE_MULTIPROCESSING=0`), the sync multiprocess client (`LLM`'s default), the
async multiprocess client (`AsyncLLM`), and their data-parallel twins `DPLBSyncMPClient` /
`DPLBAsyncMPClient` when `data_parallel_size > 1` (engine processes always; the in-process
client runs one engine).

Multiprocess clients (`MPClient`) launch the engines (engine/utils.py: `EngineLauncher`) or,
as one of several API servers, reach engines launched by the head (`ClientConfig`). They bind
an input ROUTER (one DEALER per engine connects to it) and an output PULL. One background
thread per client reads the outputs, the deaths reported by whoever watches the engine
processes, and the DP coordinator's published counts. A dead engine is turned into
`EngineDeadError`: for every pending and new call when it was the last one (or the user
asked to stop on any death), else only for the requests it held, while the others serve on.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import multiprocessing.util
import queue
import threading
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig, env_flag
from pagedllm.engine import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineHealth,
)
from pagedllm.engine.core_proc import ENGINE_DEAD_CALL_ID, SIGNAL_STOP_NOTICE
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.load_balancer import DPLoadBalancer
from pagedllm.engine.stall import heartbeat_interval_s
from pagedllm.engine.utils import ClientConfig, EngineLauncher, engine_identity, ready_timeout_s

logger = logging.getLogger(__name__)

MULTIPROCESSING_ENV = "PAGEDLLM_ENABLE_MULTIPROCESSING"
_POLL_MS = 100


def multiprocessing_enabled() -> bool:
    """`PAGEDLLM_ENABLE_MULTIPROCESSING` (default on), like vLLM's VLLM_ENABLE_V1_MULTIPROCESSING."""
    return env_flag(MULTIPROCESSING_ENV, True)


class EngineCoreClient(ABC):
    """What the front end needs from the engine cores, wherever they run.

    Sync clients implement the plain methods, the async client their `*_async` twins.
    """

    num_blocks: int = 0
    # The engines ended because a signal stopped them (SIGTERM / SIGINT), not by failing.
    stopped_by_signal: bool = False

    @staticmethod
    def make_client(
        config: EngineConfig,
        multiprocess_mode: bool | None = None,
        asyncio_mode: bool = False,
        engine_core_cls: type | None = None,
        client_config: ClientConfig | None = None,
    ) -> EngineCoreClient:
        """Pick the client: asyncio -> (DPLB)AsyncMPClient; multiprocess (default: the env
        var) or data parallel -> (DPLB)SyncMPClient; otherwise InprocClient.
        `engine_core_cls` replaces `EngineCore`; `client_config`: reach engines that another
        process launched (several API servers)."""
        dp = config.parallel_config.data_parallel_size > 1
        if asyncio_mode:
            cls: type[MPClient] = DPLBAsyncMPClient if dp else AsyncMPClient
            return cls(config, engine_core_cls=engine_core_cls, client_config=client_config)
        if not EngineCoreClient.runs_in_process(config, multiprocess_mode, client_config):
            cls = DPLBSyncMPClient if dp else SyncMPClient
            return cls(config, engine_core_cls=engine_core_cls, client_config=client_config)
        return InprocClient(config, engine_core_cls=engine_core_cls)

    @staticmethod
    def runs_in_process(
        config: EngineConfig,
        multiprocess_mode: bool | None = None,
        client_config: ClientConfig | None = None,
    ) -> bool:
        """Whether a synchronous `make_client` builds the engine core in this process."""
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        dp = config.parallel_config.data_parallel_size > 1
        return not (multiprocess_mode or dp or client_config is not None)

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def dead_engines(self) -> dict[int, str]:
        """Data-parallel engines that died while the others serve on: rank -> why."""
        return {}

    @property
    def stalled_engines(self) -> dict[int, str]:
        """Live engines that make no progress (engine/stall.py): rank -> why."""
        return {}

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def reset_prefix_cache(self) -> bool:
        return bool(self.call_utility("reset_prefix_cache"))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError


class InprocClient(EngineCoreClient):
    """The EngineCore in this process: `get_output` runs one step. For tests and debugging."""

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        if engine_core_cls is None:
            from pagedllm.engine.core import EngineCore

            engine_core_cls = EngineCore
        self.engine_core = engine_core_cls(config)
        self.num_blocks = self.engine_core.num_blocks
        # No idle loop steps this engine: its weights go onto huge pages before it serves.
        finish = getattr(self.engine_core, "finish_weight_move", None)
        if finish is not None:
            finish()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.engine_core.step()

    def call_utility(self, method: str, *args: Any) -> Any:
        return getattr(self.engine_core, method)(*args)

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class _ClientResources:
    """Everything needed to stop the engines this client launched and to free its sockets,
    held apart from the client so that a `multiprocessing.util.Finalize` can run it at
    interpreter exit without keeping the client alive (and before multiprocessing joins its
    non-daemon children)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.launcher: EngineLauncher | None = None
        self.send_lock = threading.Lock()
        self.stop_reader = threading.Event()
        self.reader: threading.Thread | None = None
        self.death_address = f"inproc://engine-deaths-{uuid.uuid4().hex}"

    def report_death(self, rank: int, reason: str) -> None:
        """Called from the engine monitor's thread; the reader thread takes it from there."""
        if self.stop_reader.is_set() or self.ctx.closed:
            return
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            sock.connect(self.death_address)
            sock.send(msgspec.msgpack.encode([rank, reason]))
        finally:
            sock.close()

    def __call__(self) -> None:
        """Idempotent: stop the engines (SIGTERM, then SIGKILL) and the coordinator (which
        also stops engines on other nodes), then free the sockets."""
        self.stop_reader.set()  # an exit we asked for is not a death to report
        if self.launcher is not None:
            self.launcher.shutdown()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=2.0)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)


class MPClient(EngineCoreClient):
    """Base of the multiprocess clients: start-up, sending, the reader thread and engine-death
    handling. Subclasses decide how outputs are delivered (`_deliver`, which also gets the
    `EngineDeadError` that ends everything) and which engine gets a request (`_balance`)."""

    def __init__(
        self,
        config: EngineConfig,
        engine_core_cls: type | None = None,
        client_config: ClientConfig | None = None,
    ) -> None:
        self.config = config
        self._stop_on_engine_death = config.parallel_config.data_parallel_stop_on_engine_death
        self._dead_error: EngineDeadError | None = None
        self._dead_engines: dict[int, str] = {}
        # Stall detection (engine/stall.py): each engine's last heartbeat, and when this
        # client last heard from it at all.
        self._stall_timeout_s = config.stall_timeout_s
        self._engine_health: dict[int, EngineHealth] = {}
        self._last_heard: dict[int, float] = {}
        self._silent: set[int] = set()  # engines whose heartbeats stopped (logged once)
        # request id -> engine rank, for aborts and for failing a dead engine's requests.
        self._request_engines: dict[str, int] = {}
        self._call_ids = itertools.count(1)
        self._pending_calls: dict[int, tuple[Future, int]] = {}
        self._calls_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._resources = res = _ClientResources()
        # Runs at shutdown(), at garbage collection, and at interpreter exit: there before
        # the launcher's own finalizers (priority 100), so that the engines' exit is known
        # to be ours before they are signalled, and not reported as a death.
        self._finalizer = multiprocessing.util.Finalize(self, res, exitpriority=110)
        try:
            if client_config is None:
                res.launcher = EngineLauncher(config, num_clients=1)
                addresses, self.client_index = res.launcher.addresses, 0
            else:
                addresses, self.client_index = client_config.addresses, client_config.client_index
            self._input_socket = self._bind(zmq.ROUTER, addresses.inputs[self.client_index])
            self._input_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
            self._output_socket = self._bind(zmq.PULL, addresses.outputs[self.client_index])
            self._death_socket = self._bind(zmq.PULL, res.death_address)
            self._coordinator_socket: zmq.Socket | None = None
            if addresses.coordinator_front:
                sock = self._coordinator_socket = res.ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
                sock.connect(addresses.coordinator_front)
            if res.launcher is not None:
                num_blocks = res.launcher.start_engines(engine_core_cls, res.report_death)
            else:
                num_blocks = list(client_config.num_blocks)
        except BaseException:
            self._finalizer()
            raise
        self.engine_num_blocks = num_blocks
        self.num_engines = len(num_blocks)
        started = time.monotonic()
        self._last_heard = {rank: started for rank in range(self.num_engines)}
        self.num_blocks = num_blocks[0]
        res.reader = threading.Thread(
            target=MPClient._read_outputs,
            args=(weakref.ref(self), res),
            name="EngineCoreOutputReader",
            daemon=True,
        )
        res.reader.start()

    def _bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self._resources.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(address)
        return sock

    @property
    def engine_pids(self) -> dict[int, int]:
        """Rank -> pid of the engine processes this client launched on this node."""
        launcher = self._resources.launcher
        manager = launcher.engine_manager if launcher is not None else None
        return dict(getattr(manager, "pids", {}))

    @property
    def engine_pid(self) -> int:
        return self.engine_pids[0]

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def dead_engines(self) -> dict[int, str]:
        return dict(self._dead_engines)

    @property
    def stalled_engines(self) -> dict[int, str]:
        """Live engines whose last heartbeat says stalled, or whose heartbeats stopped for
        longer than the stall timeout (a frozen process; only engines that sent one): rank
        -> why. A silent engine is logged when first found so (the engine logs its own
        stalls) and again when it is heard from."""
        timeout = self._stall_timeout_s
        if timeout <= 0 or self._dead_error is not None:
            return {}
        now = time.monotonic()
        stalled = {}
        for rank in range(self.num_engines):
            if rank in self._dead_engines:
                continue
            health = self._engine_health.get(rank)
            if health is None:
                continue  # no heartbeat yet (an engine core without a watchdog sends none)
            silent_for = now - self._last_heard[rank]
            silent = silent_for > timeout + heartbeat_interval_s(timeout)
            if health.stalled_for_s > 0:
                stalled[rank] = health.reason
            elif silent:
                stalled[rank] = (
                    f"engine {rank} stalled: no heartbeat for {silent_for:.0f}s "
                    "(its process may be frozen)"
                )
            if silent and rank not in self._silent:
                self._silent.add(rank)
                logger.warning("EngineCore %d sends no heartbeats: %s", rank, stalled[rank])
            elif not silent and rank in self._silent:
                self._silent.discard(rank)
                logger.info("EngineCore %d is heard from again", rank)
        return stalled

    # ----------------------------------------------------------------------------- sending

    def _balance(self, request: EngineCoreRequest) -> int:
        """The engine for a new request (no explicit `data_parallel_rank`)."""
        return 0

    def _select_engine(self, request: EngineCoreRequest) -> int:
        rank = request.data_parallel_rank
        if rank is None:
            return self._balance(request)
        if not 0 <= rank < self.num_engines:
            raise ValueError(
                f"data_parallel_rank={rank} is out of range: there are {self.num_engines} "
                "data-parallel engines"
            )
        return rank

    def _add_request(self, request: EngineCoreRequest) -> None:
        rank = self._select_engine(request)
        self._request_engines[request.request_id] = rank
        try:
            self._send(rank, EngineCoreRequestType.ADD, request)
        except BaseException:
            self._request_engines.pop(request.request_id, None)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        if not request_ids or self._dead_error is not None:
            return
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            rank = self._request_engines.pop(request_id, None)
            if rank is not None and rank not in self._dead_engines:
                by_engine.setdefault(rank, []).append(request_id)
        for rank, ids in by_engine.items():
            self._send(rank, EngineCoreRequestType.ABORT, ids)

    def _send(self, rank: int, request_type: EngineCoreRequestType, payload: Any = None) -> None:
        frames = [engine_identity(rank), request_type.value]
        if payload is not None:
            frames.append(self._encoder.encode(payload))
        deadline = None
        while True:
            if self._dead_error is not None:
                raise self._dead_error
            if rank in self._dead_engines:
                raise self._engine_error(rank, self._dead_engines[rank])
            try:
                with self._resources.send_lock:
                    self._input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.ZMQError as e:
                if e.errno not in (errno.EHOSTUNREACH, errno.EAGAIN):
                    raise
            # The engine's DEALER is not connected (yet: it connects while it starts; or any
            # more: its death is about to be reported).
            deadline = deadline or time.monotonic() + ready_timeout_s()
            if time.monotonic() > deadline:
                raise EngineDeadError(f"(engine {rank} is not connected)")
            time.sleep(0.005)

    def _start_utility_calls(self, method: str, args: tuple) -> list[Future]:
        """One call per live engine (they are copies of one model; callers take the first
        answer, every engine acts)."""
        futures = []
        for rank in range(self.num_engines):
            if rank in self._dead_engines:
                continue
            call_id = next(self._call_ids)
            future: Future = Future()
            with self._calls_lock:
                self._pending_calls[call_id] = (future, rank)
            try:
                self._send(rank, EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
            except BaseException:
                with self._calls_lock:
                    self._pending_calls.pop(call_id, None)
                raise
            futures.append(future)
        if not futures:
            raise self._dead_error or EngineDeadError("(no live engine)")
        return futures

    # --------------------------------------------------------------------------- receiving

    @staticmethod
    def _read_outputs(client_ref: weakref.ref[MPClient], res: _ClientResources) -> None:
        """Reader thread: decodes outputs and delivers them; handles engine deaths after
        whatever the engine sent before dying. Holds the client only weakly between polls, so
        an unreferenced client can still be garbage-collected."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        client = client_ref()
        if client is None:
            return
        out_sock, death_sock = client._output_socket, client._death_socket
        coord_sock = client._coordinator_socket
        del client
        poller = zmq.Poller()
        for sock in (out_sock, death_sock, coord_sock):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while not res.stop_reader.is_set():
            try:
                events = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                return  # context destroyed by shutdown
            client = client_ref()
            if client is None:
                return
            try:
                if events:
                    client._drain(out_sock, decoder)
                if coord_sock in events:
                    client._drain_coordinator(coord_sock)
                if death_sock in events:
                    client._drain(out_sock, decoder)
                    while death_sock.poll(0):
                        rank, reason = msgspec.msgpack.decode(death_sock.recv())
                        if not res.stop_reader.is_set():
                            client._engine_died(rank, reason)
            except zmq.ZMQError as e:
                if not res.stop_reader.is_set():
                    client._mark_dead(EngineDeadError(f"(output socket failed: {e})"))
                return
            except Exception as e:  # a decoding bug must not leave callers hanging
                logger.exception("EngineCore output reader failed")
                client._mark_dead(EngineDeadError(f"(output reader failed: {e})"))
                return
            if client._dead_error is not None:
                return
            del client

    def _drain(self, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            outputs = decoder.decode(frame.buffer)
            self._last_heard[outputs.engine_index] = time.monotonic()
            if outputs.health is not None:
                self._engine_health[outputs.engine_index] = outputs.health
                continue  # heartbeats travel alone
            if outputs.utility_output is not None:
                self._resolve_utility(outputs.engine_index, outputs.utility_output)
                if not outputs.outputs and outputs.scheduler_stats is None:
                    continue
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    self._request_engines.pop(out.request_id, None)
            self._deliver(outputs)

    def _drain_coordinator(self, sock: zmq.Socket) -> None:
        latest = None
        while True:
            try:
                latest = msgspec.msgpack.decode(sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        if latest is None:
            return
        self._on_counts(latest["counts"])
        for rank, reason in latest["dead"].items():
            self._engine_died(int(rank), reason)

    def _on_counts(self, counts: list[list[int]]) -> None:
        """The coordinator's published (waiting, running) per engine; for the balancer."""

    def _resolve_utility(self, rank: int, reply: tuple[int, Any, str | None]) -> None:
        call_id, result, error = reply
        if call_id == ENGINE_DEAD_CALL_ID:
            if self._resources.stop_reader.is_set():
                return  # we are stopping the engines ourselves
            if error == SIGNAL_STOP_NOTICE:  # stopped (a Ctrl-C reaches us too), not failed
                self._engine_died(rank, error, stopped=True)
                return
            logger.error("EngineCore %d reported a fatal error: %s", rank, error)
            self._engine_died(rank, f"fatal error in the engine: {error}")
            return
        with self._calls_lock:
            future, _ = self._pending_calls.pop(call_id, (None, None))
        if future is None:
            return
        if error is not None:
            future.set_exception(RuntimeError(f"engine utility call failed: {error}"))
        else:
            future.set_result(result)

    def _engine_error(self, rank: int, reason: str) -> EngineDeadError:
        where = f"data-parallel engine {rank}: " if self.num_engines > 1 else ""
        return EngineDeadError(f"({where}{reason})")

    def _engine_died(self, rank: int, reason: str, stopped: bool = False) -> None:
        """Reader thread only. The last engine (or any, if the user asked to stop then) takes
        the whole client down; otherwise only its requests fail and the others serve on."""
        if rank in self._dead_engines or self._dead_error is not None:
            return
        if self._resources.stop_reader.is_set():
            return  # we are stopping the engines ourselves
        self._dead_engines[rank] = reason
        error = self._engine_error(rank, reason)
        alive = self.num_engines - len(self._dead_engines)
        if alive == 0 or self._stop_on_engine_death:
            self._mark_dead(error, stopped)
            return
        if stopped:
            logger.warning(
                "Data-parallel engine %d was stopped by a signal; serving on the other %d",
                rank,
                alive,
            )
        else:
            logger.error(
                "Data-parallel engine %d died (%s); serving on the other %d", rank, reason, alive
            )
        failed = [rid for rid, r in list(self._request_engines.items()) if r == rank]
        for request_id in failed:
            self._request_engines.pop(request_id, None)
        with self._calls_lock:
            calls = [cid for cid, (_, r) in self._pending_calls.items() if r == rank]
            futures = [self._pending_calls.pop(cid)[0] for cid in calls]
        for future in futures:
            future.set_exception(error)
        text = str(error)
        self._deliver(
            EngineCoreOutputs(engine_index=rank, errored_requests={rid: text for rid in failed})
        )

    def _mark_dead(self, error: EngineDeadError, stopped: bool = False) -> None:
        """`stopped`: by a signal (a warning; nothing failed)."""
        if self._dead_error is not None:
            return
        self._dead_error = error
        self.stopped_by_signal = stopped
        if stopped:  # nothing failed: not reported as a death
            logger.warning("EngineCore was stopped by a signal (SIGTERM / SIGINT)")
        else:
            logger.error("EngineCore is dead: %s", error)
        with self._calls_lock:
            pending, self._pending_calls = self._pending_calls, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(error)
        self._deliver(error)

    @abstractmethod
    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Called from the reader thread, in order."""

    def shutdown(self) -> None:
        """Stops the engines this client launched (SIGTERM, then SIGKILL). Idempotent."""
        self._resources.stop_reader.set()
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking client for `LLMEngine`: `get_output` waits for the engines' next message."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        super().__init__(*args, **kwargs)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._outputs.put(item)

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # every later call fails the same way
            raise item
        return item

    def add_request(self, request: EngineCoreRequest) -> None:
        self._add_request(request)

    def call_utility(self, method: str, *args: Any) -> Any:
        return [f.result() for f in self._start_utility_calls(method, args)][0]


class AsyncMPClient(MPClient):
    """Client for `AsyncLLM`. Its async methods must run on one event loop (the first one
    that awaits `get_output_async`); the reader thread wakes that loop thread-safely."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | EngineDeadError] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        super().__init__(*args, **kwargs)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._outputs.put(item)
        loop, ready = self._loop, self._ready
        if loop is not None and ready is not None:
            try:
                loop.call_soon_threadsafe(ready.set)
            except RuntimeError:
                pass  # the loop is closed: nobody is waiting

    async def get_output_async(self) -> EngineCoreOutputs:
        if self._ready is None:
            self._ready = asyncio.Event()
            self._loop = asyncio.get_running_loop()
        while True:
            try:
                item = self._outputs.get_nowait()
            except queue.Empty:
                self._ready.clear()
                if not self._outputs.empty():
                    continue
                await self._ready.wait()
                continue
            if isinstance(item, EngineDeadError):
                self._outputs.put(item)
                raise item
            return item

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._add_request(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    # Abort without awaiting (safe where awaiting is not, e.g. on GeneratorExit).
    abort_requests_nowait = MPClient.abort_requests

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        futures = self._start_utility_calls(method, args)
        return (await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))[0]


class _DPLBMixin:
    """Data-parallel load balancing (engine/load_balancer.py) on the coordinator's counts."""

    def __init__(
        self: Any,
        config: EngineConfig,
        engine_core_cls: type | None = None,
        client_config: ClientConfig | None = None,
    ) -> None:
        # Before the reader thread starts: it feeds the balancer.
        index = client_config.client_index if client_config is not None else 0
        self._lb = DPLoadBalancer(config.parallel_config.data_parallel_size, index)
        super().__init__(config, engine_core_cls, client_config)

    def _balance(self: Any, request: EngineCoreRequest) -> int:
        return self._lb.choose(self._dead_engines, request.prompt_cache_key)

    def _on_counts(self: Any, counts: list[list[int]]) -> None:
        self._lb.update(counts)


class DPLBSyncMPClient(_DPLBMixin, SyncMPClient):
    """`SyncMPClient` over several data-parallel engines (offline `LLM(data_parallel_size=D)`)."""


class DPLBAsyncMPClient(_DPLBMixin, AsyncMPClient):
    """`AsyncMPClient` over several data-parallel engines, load-balanced per request."""
