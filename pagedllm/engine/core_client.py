"""Clients that talk to an EngineCore: in-process, or across a process boundary (ZMQ).

`EngineCoreClient.make_client` is the one factory: the in-process client (tests, debugging,
`PAGEDLLM_ENABLE_MULTIPROCESSING=0`), the sync multiprocess client (`LLM`'s default) or the
async multiprocess client (`AsyncLLM`).

Multiprocess clients (`MPClient`) start an `EngineCoreProc` with the `spawn` context and bind
two ZMQ sockets on fresh ipc paths in a private temp dir: a PUSH socket for requests and a
PULL socket for outputs. One background thread per client reads the output socket and watches
the process sentinel at the same time, so a dead engine process is noticed within one poll and
turned into `EngineDeadError` for every pending and every new call.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import multiprocessing.util
import os
import queue
import shutil
import tempfile
import threading
import weakref
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig, env_flag
from pagedllm.engine import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType
from pagedllm.engine.core_proc import (
    ENGINE_DEAD_CALL_ID,
    HANDSHAKE_FAILED,
    HANDSHAKE_READY,
    run_engine_core,
)
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.spawn import main_module_hidden, model_process_env

logger = logging.getLogger(__name__)

MULTIPROCESSING_ENV = "PAGEDLLM_ENABLE_MULTIPROCESSING"
READY_TIMEOUT_ENV = "PAGEDLLM_ENGINE_READY_TIMEOUT_S"
_POLL_MS = 100


def multiprocessing_enabled() -> bool:
    """`PAGEDLLM_ENABLE_MULTIPROCESSING` (default on), like vLLM's VLLM_ENABLE_V1_MULTIPROCESSING."""
    return env_flag(MULTIPROCESSING_ENV, True)


class EngineCoreClient(ABC):
    """What the front end needs from an engine core, wherever it runs.

    Sync clients implement the plain methods, the async client their `*_async` twins.
    """

    num_blocks: int = 0

    @staticmethod
    def make_client(
        config: EngineConfig,
        multiprocess_mode: bool | None = None,
        asyncio_mode: bool = False,
        engine_core_cls: type | None = None,
    ) -> EngineCoreClient:
        """Pick the client: asyncio -> AsyncMPClient; multiprocess (default: the env var) ->
        SyncMPClient; otherwise InprocClient. `engine_core_cls` replaces `EngineCore`."""
        if multiprocess_mode is None:
            multiprocess_mode = multiprocessing_enabled()
        if asyncio_mode:
            return AsyncMPClient(config, engine_core_cls=engine_core_cls)
        if multiprocess_mode:
            return SyncMPClient(config, engine_core_cls=engine_core_cls)
        return InprocClient(config, engine_core_cls=engine_core_cls)

    @abstractmethod
    def shutdown(self) -> None: ...

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


class _EngineProcHandle:
    """Everything needed to stop an engine process, held apart from the client so that a
    `multiprocessing.util.Finalize` can stop it at interpreter exit without keeping the client
    alive (and before multiprocessing joins its non-daemon children)."""

    def __init__(self, proc: Any, ctx: zmq.Context, tmpdir: str) -> None:
        self.proc = proc
        self.ctx = ctx
        self.tmpdir = tmpdir
        self.input_socket: zmq.Socket | None = None
        self.send_lock = threading.Lock()
        self.stop_reader = threading.Event()
        self.reader: threading.Thread | None = None

    def __call__(self) -> None:
        """Idempotent: ask the engine to exit, then terminate, then kill; free the sockets."""
        self.stop_reader.set()  # an exit we asked for is not a death to report
        if self.proc.pid is None:  # never started
            self._close()
            return
        if self.proc.is_alive() and self.input_socket is not None:
            try:
                with self.send_lock:
                    self.input_socket.send(EngineCoreRequestType.SHUTDOWN.value, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        self.proc.join(timeout=5.0)
        if self.proc.is_alive():
            logger.warning("EngineCore pid=%s did not exit; terminating it", self.proc.pid)
            self.proc.terminate()
            self.proc.join(timeout=5.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        self.stop_reader.set()
        if self.reader is not None and self.reader is not threading.current_thread():
            self.reader.join(timeout=2.0)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class MPClient(EngineCoreClient):
    """Base of the multiprocess clients: process start-up, handshake, sending, the output
    reader thread and engine-death detection. Subclasses decide how outputs are delivered
    (`_deliver`) and how waiters are woken on death (`_deliver` gets the exception)."""

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self.config = config
        self._dead_error: EngineDeadError | None = None
        self._call_ids = itertools.count(1)
        self._pending_calls: dict[int, Future] = {}
        self._calls_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()

        tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        input_address = f"ipc://{tmpdir}/input"
        output_address = f"ipc://{tmpdir}/output"
        ctx = zmq.Context()
        mp_ctx = multiprocessing.get_context("spawn")
        proc = mp_ctx.Process(
            target=run_engine_core,
            name="EngineCore",
            kwargs=dict(
                config=config,
                input_address=input_address,
                output_address=output_address,
                parent_pid=os.getpid(),
                engine_core_cls=engine_core_cls,
            ),
        )
        self._handle = _EngineProcHandle(proc, ctx, tmpdir)
        # Runs at shutdown(), at garbage collection, and at interpreter exit before
        # multiprocessing joins its children.
        self._finalizer = multiprocessing.util.Finalize(self, self._handle, exitpriority=100)
        try:
            self._input_socket = ctx.socket(zmq.PUSH)
            self._input_socket.setsockopt(zmq.LINGER, 0)
            self._input_socket.setsockopt(zmq.SNDHWM, 0)
            self._input_socket.bind(input_address)
            self._handle.input_socket = self._input_socket
            self._output_socket = ctx.socket(zmq.PULL)
            self._output_socket.setsockopt(zmq.LINGER, 0)
            self._output_socket.setsockopt(zmq.RCVHWM, 0)
            self._output_socket.bind(output_address)
            with main_module_hidden(engine_core_cls), model_process_env():
                proc.start()
            self.engine_pid: int = proc.pid
            self.num_blocks = self._wait_for_handshake(proc)
        except BaseException:
            self._finalizer()
            raise
        self._handle.reader = threading.Thread(
            target=MPClient._read_outputs,
            args=(weakref.ref(self), self._handle),
            name="EngineCoreOutputReader",
            daemon=True,
        )
        self._handle.reader.start()

    @property
    def proc(self) -> Any:
        return self._handle.proc

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    def _wait_for_handshake(self, proc: Any) -> int:
        timeout_s = float(os.environ.get(READY_TIMEOUT_ENV, "600"))
        poller = zmq.Poller()
        poller.register(self._output_socket, zmq.POLLIN)
        poller.register(proc.sentinel, zmq.POLLIN)
        events = dict(poller.poll(int(timeout_s * 1000)))
        if self._output_socket in events:
            reply = msgspec.msgpack.decode(self._output_socket.recv())
            if reply.get("status") == HANDSHAKE_READY:
                logger.info(
                    "EngineCore process pid=%s ready (%s KV blocks)", proc.pid, reply["num_blocks"]
                )
                return int(reply["num_blocks"])
            if reply.get("status") == HANDSHAKE_FAILED:
                raise RuntimeError(f"Engine core initialization failed: {reply.get('error')}")
            raise RuntimeError(f"Engine core sent an unexpected handshake: {reply!r}")
        if events:
            proc.join(timeout=1.0)
            raise RuntimeError(
                f"Engine core initialization failed: the engine process exited with code "
                f"{proc.exitcode} before it was ready; see its log above for the root cause"
            )
        raise RuntimeError(
            f"Engine core initialization failed: no handshake within {timeout_s:.0f}s "
            f"(set {READY_TIMEOUT_ENV} to wait longer)"
        )

    # ----------------------------------------------------------------------------- sending

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._dead_error is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def _send(self, request_type: EngineCoreRequestType, payload: Any = None) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        frames = [request_type.value]
        if payload is not None:
            frames.append(self._encoder.encode(payload))
        while True:
            try:
                with self._handle.send_lock:
                    self._input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                # No peer: the engine process is gone (or its socket is not connected yet).
                if self._dead_error is not None or not self.proc.is_alive():
                    raise self._dead_error or EngineDeadError(
                        f"(process exited with code {self.proc.exitcode})"
                    ) from None
                self._input_socket.poll(_POLL_MS, zmq.POLLOUT)

    def _start_utility_call(self, method: str, args: tuple) -> Future:
        call_id = next(self._call_ids)
        future: Future = Future()
        with self._calls_lock:
            self._pending_calls[call_id] = future
        try:
            self._send(EngineCoreRequestType.UTILITY, (call_id, method, list(args)))
        except BaseException:
            with self._calls_lock:
                self._pending_calls.pop(call_id, None)
            raise
        return future

    # --------------------------------------------------------------------------- receiving

    @staticmethod
    def _read_outputs(client_ref: weakref.ref[MPClient], handle: _EngineProcHandle) -> None:
        """Reader thread: decodes outputs and delivers them; on process death, delivers
        `EngineDeadError` after whatever the process sent before dying. Holds the client only
        weakly between polls, so an unreferenced client can still be garbage-collected."""
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        client = client_ref()
        if client is None:
            return
        sock, sentinel = client._output_socket, handle.proc.sentinel
        del client
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(sentinel, zmq.POLLIN)
        while not handle.stop_reader.is_set():
            try:
                events = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError:
                return  # context destroyed by shutdown
            client = client_ref()
            if client is None or not events:
                if client is None:
                    return
                del client
                continue
            try:
                client._drain(sock, decoder)
                if sentinel in events:
                    client._drain(sock, decoder)
                    handle.proc.join(timeout=1.0)  # reap it, so exitcode is known
                    if not handle.stop_reader.is_set():
                        client._mark_dead(
                            EngineDeadError(f"(process exited with code {handle.proc.exitcode})")
                        )
                    return
            except zmq.ZMQError as e:
                if not handle.stop_reader.is_set():
                    client._mark_dead(EngineDeadError(f"(output socket failed: {e})"))
                return
            except Exception as e:  # a decoding bug must not leave callers hanging
                logger.exception("EngineCore output reader failed")
                client._mark_dead(EngineDeadError(f"(output reader failed: {e})"))
                return
            del client

    def _drain(self, sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> None:
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            outputs = decoder.decode(frame.buffer)
            if outputs.utility_output is not None:
                self._resolve_utility(outputs.utility_output)
                if not outputs.outputs and outputs.scheduler_stats is None:
                    continue
            self._deliver(outputs)

    def _resolve_utility(self, reply: tuple[int, Any, str | None]) -> None:
        call_id, result, error = reply
        if call_id == ENGINE_DEAD_CALL_ID:
            logger.error("EngineCore reported a fatal error: %s", error)
            self._mark_dead(EngineDeadError(f"(fatal error in the engine: {error})"))
            return
        with self._calls_lock:
            future = self._pending_calls.pop(call_id, None)
        if future is None:
            return
        if error is not None:
            future.set_exception(RuntimeError(f"engine utility call failed: {error}"))
        else:
            future.set_result(result)

    def _mark_dead(self, error: EngineDeadError) -> None:
        if self._dead_error is not None:
            return
        self._dead_error = error
        logger.error("EngineCore process pid=%s is dead: %s", self.engine_pid, error)
        with self._calls_lock:
            pending, self._pending_calls = self._pending_calls, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(error)
        self._deliver(error)

    @abstractmethod
    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        """Called from the reader thread, in order."""

    def shutdown(self) -> None:
        """Stops the engine process (SHUTDOWN, then terminate, then kill). Idempotent."""
        self._handle.stop_reader.set()
        self._finalizer()


class SyncMPClient(MPClient):
    """Blocking client for `LLMEngine`: `get_output` waits for the engine's next message."""

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self._outputs: queue.Queue[EngineCoreOutputs | EngineDeadError] = queue.Queue()
        super().__init__(config, engine_core_cls)

    def _deliver(self, item: EngineCoreOutputs | EngineDeadError) -> None:
        self._outputs.put(item)

    def get_output(self) -> EngineCoreOutputs:
        item = self._outputs.get()
        if isinstance(item, EngineDeadError):
            self._outputs.put(item)  # every later call fails the same way
            raise item
        return item

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(EngineCoreRequestType.ADD, request)

    def call_utility(self, method: str, *args: Any) -> Any:
        return self._start_utility_call(method, args).result()


class AsyncMPClient(MPClient):
    """Client for `AsyncLLM`. Its async methods must run on one event loop (the first one
    that awaits `get_output_async`); the reader thread wakes that loop thread-safely."""

    def __init__(self, config: EngineConfig, engine_core_cls: type | None = None) -> None:
        self._outputs: queue.SimpleQueue[EngineCoreOutputs | EngineDeadError] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        super().__init__(config, engine_core_cls)

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
        self._send(EngineCoreRequestType.ADD, request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests(request_ids)

    # Abort without awaiting (safe where awaiting is not, e.g. on GeneratorExit).
    abort_requests_nowait = MPClient.abort_requests

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        return await asyncio.wrap_future(self._start_utility_call(method, args))
