"""EngineCoreProc: the EngineCore in its own process, talking ZMQ (msgspec msgpack) to a client.

Three threads, so the model never waits for (de)serialization and sockets never wait for the
model:

- input thread: reads `[EngineCoreRequestType, payload]` frames from the PULL socket, decodes
  them and puts `(type, message)` on the input queue;
- main thread, the busy loop: drain the input queue (add / abort / utility / shutdown), run
  `EngineCore.step()` while there is work, put the `EngineCoreOutputs` on the output queue,
  and block on the input queue when idle;
- output thread: encodes `EngineCoreOutputs` onto the PUSH socket.

Start-up handshake: the first message on the output socket is a msgpack map, either
`{"status": "READY", "num_blocks": N, "pid": P}` or `{"status": "FAILED", "error": text}`.

Lifetime: the process exits on a SHUTDOWN message, on SIGTERM / SIGINT, and when its parent
dies (a watchdog thread polls the parent pid). If `step()` raises, the process sends a
dead-notice (a utility reply with call id `ENGINE_DEAD_CALL_ID`) and exits non-zero; the
client then fails every pending and new request with `EngineDeadError`. So does a dead worker
of a multi-process executor, even while the engine is idle: the executor's failure callback
wakes the busy loop, which raises.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import sys
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
    FinishReason,
)
from pagedllm.spawn import exit_process

logger = logging.getLogger(__name__)

ENGINE_DEAD_CALL_ID = -1
HANDSHAKE_READY = "READY"
HANDSHAKE_FAILED = "FAILED"
# How often the input thread and the parent watchdog wake up to check for shutdown.
_POLL_INTERVAL_S = 0.2
# Grace period for a clean exit after the parent died before the process is cut off hard.
_ORPHAN_EXIT_GRACE_S = 5.0

# Utility methods answered by EngineCoreProc itself; everything else goes to the EngineCore.
_PROC_UTILITIES = ("get_num_blocks",)


def _configure_child_logging() -> None:
    """A spawned process starts with no logging set up; match the front end's format."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
            format="%(levelname)s %(asctime)s [EngineCore pid=%(process)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )


class EngineCoreProc:
    """Owns one EngineCore inside the engine process and serves it over two ZMQ sockets.

    Contract: construct only inside the child (see `run_engine_core`); `run_busy_loop` returns
    when a shutdown was requested (message, signal or orphaning) and raises if the engine
    core fails. Messages to the core are handled in arrival order.
    """

    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        parent_pid: int,
        engine_core_cls: type | None = None,
    ) -> None:
        self.parent_pid = parent_pid
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[EngineCoreOutputs | bytes | None] = queue.Queue()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._out_socket = self._ctx.socket(zmq.PUSH)
        self._out_socket.setsockopt(zmq.SNDHWM, 0)
        self._out_socket.setsockopt(zmq.LINGER, 2000)
        self._out_socket.connect(output_address)
        self._input_address = input_address
        self._encoder = msgspec.msgpack.Encoder()
        threading.Thread(target=self._parent_watchdog, name="ParentWatchdog", daemon=True).start()

        try:
            if engine_core_cls is None:
                from pagedllm.engine.core import EngineCore

                engine_core_cls = EngineCore
            self.engine_core = engine_core_cls(config)
        except BaseException as e:
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            logger.error("EngineCore failed to start:\n%s", traceback.format_exc())
            self._out_socket.send(self._encoder.encode({"status": HANDSHAKE_FAILED, "error": text}))
            self._close_sockets()
            raise

        executor = getattr(self.engine_core, "executor", None)
        if executor is not None:
            executor.register_failure_callback(self._on_executor_failure)
        # Whether the stats the front end last saw may be stale (see _process_engine_step).
        self._stats_dirty = False
        self._input_thread = threading.Thread(
            target=self._process_input_socket, name="EngineCoreInput", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._process_output_socket, name="EngineCoreOutput", daemon=True
        )
        self._input_thread.start()
        self._out_socket.send(
            self._encoder.encode(
                {
                    "status": HANDSHAKE_READY,
                    "num_blocks": self.get_num_blocks(),
                    "pid": os.getpid(),
                }
            )
        )
        self._output_thread.start()

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
        if not has_work:
            # Idle: sleep until the client sends something (or shutdown is requested).
            self._handle_client_request(*self.input_queue.get())
        while not self.input_queue.empty() and not self._stop.is_set():
            self._handle_client_request(*self.input_queue.get_nowait())

    def _process_engine_step(self) -> None:
        """One step. When the last request has just left (finished or aborted), one more,
        idle, step is run so the front end's gauges (running, KV usage) drop back to 0."""
        had_work = self.engine_core.has_unfinished_requests()
        if not had_work and not self._stats_dirty:
            return
        outputs = self.engine_core.step()
        self._stats_dirty = had_work
        if outputs.outputs or outputs.scheduler_stats is not None:
            self.output_queue.put(outputs)

    def _handle_client_request(self, request_type: EngineCoreRequestType, message: Any) -> None:
        if request_type == EngineCoreRequestType.ADD:
            self._stats_dirty = True
            try:
                self.engine_core.add_request(message)
            except Exception as e:
                # The front end validates first, so this is rare; finish the request rather
                # than leave its caller waiting forever.
                logger.error("Rejected request %s: %s", message.request_id, e)
                self.output_queue.put(
                    EngineCoreOutputs(
                        outputs=[
                            EngineCoreOutput(
                                request_id=message.request_id,
                                new_token_ids=[],
                                finish_reason=FinishReason.ABORT,
                                stop_reason=str(e),
                            )
                        ]
                    )
                )
        elif request_type == EngineCoreRequestType.ABORT:
            self._stats_dirty = True
            self.engine_core.abort_requests(list(message))
        elif request_type == EngineCoreRequestType.UTILITY:
            call_id, method, args = message
            self.output_queue.put(
                EngineCoreOutputs(utility_output=self._call_utility(call_id, method, args))
            )
        elif request_type == EngineCoreRequestType.SHUTDOWN:
            self._stop.set()
        elif request_type == EngineCoreRequestType.EXECUTOR_FAILED:
            raise RuntimeError(f"the executor failed: {message}")
        else:
            logger.error("Unknown request type %r ignored", request_type)

    def _call_utility(self, call_id: int, method: str, args: Any) -> tuple[int, Any, str | None]:
        try:
            if method in _PROC_UTILITIES:
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

    def _process_input_socket(self) -> None:
        """Input thread: ZMQ frames -> decoded messages on the input queue."""
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.connect(self._input_address)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        any_decoder = msgspec.msgpack.Decoder()
        try:
            while not self._stop.is_set():
                if not sock.poll(int(_POLL_INTERVAL_S * 1000)):
                    continue
                frames = sock.recv_multipart(copy=False)
                request_type = EngineCoreRequestType(bytes(frames[0].buffer))
                if request_type == EngineCoreRequestType.ADD:
                    message = add_decoder.decode(frames[1].buffer)
                elif len(frames) > 1:
                    message = any_decoder.decode(frames[1].buffer)
                else:
                    message = None
                self.input_queue.put((request_type, message))
        except Exception:
            logger.exception("EngineCore input thread failed; shutting down")
            self.request_shutdown()
        finally:
            sock.close()

    def _process_output_socket(self) -> None:
        """Output thread: encodes what the busy loop produced; `None` ends it after a flush."""
        while True:
            item = self.output_queue.get()
            if item is None:
                return
            data = item if isinstance(item, bytes) else self._encoder.encode(item)
            self._out_socket.send(data, copy=False)

    def _parent_watchdog(self) -> None:
        """Exits the process once the front end that owns it is gone."""
        while not self._stop.wait(_POLL_INTERVAL_S):
            if os.getppid() != self.parent_pid:
                logger.warning("Parent process %d died; EngineCore shutting down", self.parent_pid)
                self.request_shutdown()
                # The parent cannot clean up its ipc socket directory any more.
                if self._input_address.startswith("ipc://"):
                    shutil.rmtree(os.path.dirname(self._input_address[6:]), ignore_errors=True)
                # A clean exit ends this daemon thread with the process; if the busy loop is
                # stuck (a long step, a hung kernel), cut the process off.
                time.sleep(_ORPHAN_EXIT_GRACE_S)
                os._exit(1)

    def _on_executor_failure(self, reason: str) -> None:
        """Executor callback (any thread): make the busy loop raise at its next turn."""
        self.input_queue.put((EngineCoreRequestType.EXECUTOR_FAILED, reason))

    def request_shutdown(self) -> None:
        """Thread-safe: makes the busy loop return at its next turn."""
        self._stop.set()
        self.input_queue.put((EngineCoreRequestType.SHUTDOWN, None))

    # ------------------------------------------------------------------------------ shutdown

    def send_dead_notice(self, error: str) -> None:
        self.output_queue.put(EngineCoreOutputs(utility_output=(ENGINE_DEAD_CALL_ID, None, error)))

    def shutdown(self) -> None:
        """Stops the engine core and the threads; outputs already queued are still sent."""
        self._stop.set()
        try:
            self.engine_core.shutdown()
        except Exception:
            logger.exception("EngineCore.shutdown failed")
        self.output_queue.put(None)
        self._output_thread.join(timeout=5.0)
        self._input_thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._out_socket.close()
        self._ctx.term()


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    parent_pid: int,
    engine_core_cls: type | None = None,
) -> None:
    """Entry point of the engine process (multiprocessing `spawn` target)."""
    _configure_child_logging()

    def _on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    proc: EngineCoreProc | None = None
    try:
        proc = EngineCoreProc(config, input_address, output_address, parent_pid, engine_core_cls)
        proc.run_busy_loop()
    except SystemExit:
        logger.info("EngineCore received a termination signal; shutting down")
    except BaseException as e:
        if proc is None:
            sys.exit(1)  # start-up failure, already reported in the handshake
        logger.error("EngineCore hit a fatal error:\n%s", traceback.format_exc())
        proc.send_dead_notice(f"{type(e).__name__}: {e}")
        proc.shutdown()
        exit_process(1)
    if proc is not None:
        # A second signal while shutting down should not interrupt the clean-up.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        proc.shutdown()
        exit_process(0)
