"""MultiProcExecutor: one worker process per rank on this machine (vLLM V1's design).

The executor broadcasts every call `(method, args, reply_rank)` to all workers through one
shared-memory `MessageQueue`; each `WorkerProc` runs it on its `Worker` and answers on its own
response queue (for `execute_model`, only the driver rank answers: the others return None).
Replies are read by one I/O thread, in call order, so `execute_model(..., non_block=True)`
returns a Future and pipeline stages can hold several batches at once.

Start-up: the workers are spawned together (they meet in `torch.distributed`), each loads its
shard, then sends READY (with its response queue's handle) or FAILED (with the error) over a
pipe. Faults: a death-watch thread waits on the workers' process sentinels; when one dies it
kills the others (so none hangs in a collective), fails every pending and later call, and
runs the failure callback. A worker whose call raises logs the traceback and exits, which
the watch then reports. Each worker holds the read end of a pipe whose write end only the
executor has: when the executor's process dies, however, the workers see EOF and exit.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed.shm_broadcast import Handle, MessageQueue
from pagedllm.executor.abstract import DistributedExecutor, WorkerDiedError
from pagedllm.spawn import exit_process, get_open_port, main_module_hidden, model_process_env
from pagedllm.worker.cpu_binding import bind_threads, plan_cpu_binding

logger = logging.getLogger(__name__)

READY_TIMEOUT_ENV = "PAGEDLLM_WORKER_READY_TIMEOUT_S"
WORKER_METHOD_ENV = "PAGEDLLM_WORKER_MULTIPROC_METHOD"
# What the fork server imports once for every worker it forks (never the user's __main__).
_FORKSERVER_PRELOAD = ["transformers.modeling_rope_utils", "pagedllm.worker.worker", __name__]
_SUCCESS, _FAILURE = "SUCCESS", "FAILURE"
_POLL_S = 0.1  # how often a waiting reader checks whether a worker died


@dataclass
class _WorkerHandle:
    rank: int
    proc: Any  # multiprocessing.Process
    ready_pipe: Any  # Connection (read end)
    death_writer: Any  # Connection (write end; closing it tells the worker to exit)
    response_mq: MessageQueue | None = None


class MultiProcExecutor(DistributedExecutor):
    """Runs `tensor_parallel_size x pipeline_parallel_size` worker processes (see the module
    docstring); returns the driver rank's outputs (the first rank of the last stage)."""

    def _init_executor(self) -> None:
        self._failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ExecutorIO")
        self.rpc_broadcast_mq = MessageQueue(self.world_size)
        self.workers: list[_WorkerHandle] = []
        try:
            self._start_workers()
            self.rpc_broadcast_mq.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self._watch = threading.Thread(target=self._watch_workers, name="WorkerWatch", daemon=True)
        self._watch.start()
        # An engine in the user's own process (no engine process) may never be shut down
        # explicitly (Ctrl-C): stop the workers at interpreter exit, before its slow teardown.
        atexit.register(_shutdown_at_exit, weakref.ref(self))

    # ---- start-up ------------------------------------------------------------------------

    def _start_workers(self) -> None:
        # The config's classes too: unpickling them in each worker would import them there.
        ctx = worker_mp_context(type(self.config.model_config.hf_config).__module__)
        init_method = f"tcp://127.0.0.1:{get_open_port()}"
        handle = self.rpc_broadcast_mq.export_handle()
        cores = None
        if self.config.device_config.device == "cpu":
            cores = plan_cpu_binding(self.world_size)
        for rank in range(self.world_size):
            ready_reader, ready_writer = ctx.Pipe(duplex=False)
            death_reader, death_writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=WorkerProc.worker_main,
                name=f"Worker-{rank}",
                kwargs=dict(
                    config=self.config,
                    rank=rank,
                    distributed_init_method=init_method,
                    broadcast_handle=handle,
                    cores=cores[rank] if cores else None,
                    ready_pipe=ready_writer,
                    death_pipe=death_reader,
                ),
                daemon=True,
            )
            self.workers.append(_WorkerHandle(rank, proc, ready_reader, death_writer))
            with main_module_hidden(), model_process_env():
                proc.start()
            ready_writer.close()
            death_reader.close()
        timeout_s = float(os.environ.get(READY_TIMEOUT_ENV, "600"))
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            # A reply takes a whole step: sleep at once rather than take a core from the ranks.
            handle = self._wait_ready(w, deadline)
            w.response_mq = MessageQueue.create_from_handle(handle, 0, spin_s=0.0)

    @staticmethod
    def _wait_ready(w: _WorkerHandle, deadline: float) -> Handle:
        ready = multiprocessing.connection.wait(
            [w.ready_pipe, w.proc.sentinel], max(deadline - time.monotonic(), 0)
        )
        if w.ready_pipe in ready:
            try:
                reply = w.ready_pipe.recv()
            except EOFError:
                reply = {"status": "FAILED", "error": "it exited during start-up"}
            if reply["status"] == "READY":
                return reply["handle"]
            raise RuntimeError(f"worker rank {w.rank} failed to start: {reply['error']}")
        if ready:
            w.proc.join(1.0)
            raise RuntimeError(
                f"worker rank {w.rank} exited with code {w.proc.exitcode} during start-up; "
                "see its log above"
            )
        raise RuntimeError(f"worker rank {w.rank} was not ready in time (set {READY_TIMEOUT_ENV})")

    # ---- calls ---------------------------------------------------------------------------

    def collective_rpc(
        self,
        method: str,
        args: tuple = (),
        unique_reply_rank: int | None = None,
        non_block: bool = False,
    ) -> Any:
        if self._failure is not None:
            raise WorkerDiedError(self._failure)
        self.rpc_broadcast_mq.enqueue((method, args, unique_reply_rank))
        if unique_reply_rank is not None:
            future = self._io.submit(self._get_response, unique_reply_rank)
        else:
            future = self._io.submit(
                lambda: [self._get_response(r) for r in range(self.world_size)]
            )
        return future if non_block else future.result()

    def _get_response(self, rank: int) -> Any:
        mq = self.workers[rank].response_mq
        while True:
            if self._failure is not None:
                raise WorkerDiedError(self._failure)
            if self._closing:
                raise WorkerDiedError("the executor was shut down")
            try:
                status, result = mq.dequeue(timeout_s=_POLL_S)
            except TimeoutError:
                continue
            if status == _FAILURE:
                raise WorkerDiedError(f"worker rank {rank} failed: {result}")
            return result

    # ---- faults and shutdown -------------------------------------------------------------

    def _watch_workers(self) -> None:
        """Death watch: the first worker to exit while the executor is open fails it."""
        sentinels = {w.proc.sentinel: w for w in self.workers}
        dead = multiprocessing.connection.wait(list(sentinels))
        if self._closing:
            return
        w = sentinels[dead[0]]
        w.proc.join(1.0)
        reason = f"worker rank {w.rank} (pid {w.proc.pid}) died with exit code {w.proc.exitcode}"
        logger.error("%s; stopping the other workers", reason)
        self._failure = reason
        self._kill_workers()
        self._report_failure(reason)

    def _kill_workers(self) -> None:
        for w in self.workers:
            if w.proc.is_alive():
                w.proc.kill()
        for w in self.workers:
            w.proc.join(5.0)

    def shutdown(self) -> None:
        """Ask the workers to exit, then terminate, then kill them; free the queues.
        Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        alive = [w for w in self.workers if w.proc.is_alive()]
        if alive and self._failure is None and all(w.response_mq for w in self.workers):
            try:
                self.rpc_broadcast_mq.enqueue(("shutdown", (), None), timeout_s=1.0)
            except TimeoutError:
                pass
        deadline = time.monotonic() + 5.0
        for w in alive:
            w.proc.join(max(deadline - time.monotonic(), 0))
        for w in alive:
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(2.0)
        self._kill_workers()
        for w in self.workers:
            w.death_writer.close()
            if w.response_mq is not None:
                w.response_mq.close()
        self.rpc_broadcast_mq.close()
        self._io.shutdown(wait=False, cancel_futures=True)


class WorkerProc:
    """A worker process: a `Worker` and the loop that answers the executor's broadcasts."""

    def __init__(
        self, config: EngineConfig, rank: int, distributed_init_method: str,
        broadcast_handle: Handle,
    ) -> None:  # fmt: skip
        from pagedllm.worker.worker import Worker

        self.rank = rank
        self.rpc_broadcast_mq = MessageQueue.create_from_handle(broadcast_handle, rank)
        self.worker = Worker(
            config, rank=rank, local_rank=rank, distributed_init_method=distributed_init_method
        )
        self.worker.init_device()
        self.worker.load_model()
        self.response_mq = MessageQueue(1)

    @staticmethod
    def worker_main(
        config: EngineConfig,
        rank: int,
        distributed_init_method: str,
        broadcast_handle: Handle,
        cores: set[int] | None,
        ready_pipe: Any,
        death_pipe: Any,
    ) -> None:
        """Entry point of a worker process (multiprocessing `spawn` target)."""
        _configure_worker_logging(rank)
        # Ctrl-C reaches the whole process group: the engine handles it and stops us.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, _exit_on_signal)
        bind_threads(cores)
        threading.Thread(
            target=_exit_when_parent_dies, args=(death_pipe,), name="DeathPipe", daemon=True
        ).start()
        try:
            proc = WorkerProc(config, rank, distributed_init_method, broadcast_handle)
        except BaseException as e:
            logger.error("worker failed to start:\n%s", traceback.format_exc())
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            ready_pipe.send({"status": "FAILED", "error": text})
            raise SystemExit(1) from None
        ready_pipe.send({"status": "READY", "handle": proc.response_mq.export_handle()})
        ready_pipe.close()
        proc.response_mq.wait_until_ready()
        try:
            proc.busy_loop()
        finally:
            proc.worker.shutdown()
            proc.response_mq.close()
            proc.rpc_broadcast_mq.close()
        exit_process(0)

    def busy_loop(self) -> None:
        """Run broadcast calls until `shutdown`; a call that raises ends the process."""
        while True:
            method, args, reply_rank = self.rpc_broadcast_mq.dequeue()
            if method == "shutdown":
                return
            try:
                result = getattr(self.worker, method)(*args)
            except BaseException as e:
                logger.error("worker call %s failed:\n%s", method, traceback.format_exc())
                self.response_mq.enqueue((_FAILURE, f"{type(e).__name__}: {e}"))
                raise SystemExit(1) from None
            if reply_rank is None or reply_rank == self.rank:
                self.response_mq.enqueue((_SUCCESS, result))


def worker_mp_context(*preload: str) -> Any:
    """How worker processes start (`PAGEDLLM_WORKER_MULTIPROC_METHOD`, like vLLM's
    VLLM_WORKER_MULTIPROC_METHOD): `forkserver` (default) forks each worker from a server
    process that imported torch, transformers, the worker code and `preload` once (when it
    started: later engines reuse it), so workers skip those imports; `spawn` starts each from
    scratch. Plain
    `fork` is not offered: a child of a process that already ran OpenMP-parallel torch ops can
    hang in its first parallel region."""
    method = os.environ.get(WORKER_METHOD_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{WORKER_METHOD_ENV}={method!r} must be 'forkserver' or 'spawn'")
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload([*_FORKSERVER_PRELOAD, *preload])
    return ctx


def _shutdown_at_exit(ref: weakref.ref[MultiProcExecutor]) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _exit_when_parent_dies(death_pipe: Any) -> None:
    """Blocks until the executor closes its end (or its process dies), then ends this
    process at once: it may be blocked in a collective that will never complete."""
    try:
        death_pipe.recv()
    except (EOFError, OSError):
        pass
    os._exit(1)


def _configure_worker_logging(rank: int) -> None:
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper(),
            format=f"%(levelname)s %(asctime)s [Worker rank={rank} pid=%(process)d] %(message)s",
            datefmt="%m-%d %H:%M:%S",
        )
