"""Starting engine cores: the socket layout, the engine processes of this node, and the
start-up handshake through which every engine, local or remote, gets its addresses.

Layout. Front end `i` (its client index; there are several with `--api-server-count`) binds
an input ROUTER at `addresses.inputs[i]` and an output PULL at `addresses.outputs[i]`. Every
engine connects a DEALER (routing id: its rank, 2 bytes little-endian) to every input and a
PUSH to every output, so each front end can send to any engine by rank, and each engine
answers the front end that asked. The sockets are ipc paths in a private temp dir when every
engine runs on this node, TCP on `data_parallel_address` when some run elsewhere (headless
nodes, Ray actors).

Handshake, on a ROUTER that `EngineLauncher` binds (on `data_parallel_address:
data_parallel_rpc_port` when engines on other nodes must reach it):

    engine -> head   {"status": "HELLO", "rank": r, "local": bool}   at once, before loading
    head -> engine   {"status": "ADDRESSES", "addresses": {...}}     (or "REJECT", "error")
    engine -> head   {"status": "READY", "rank": r, "num_blocks": N, "pid": P}
                  or {"status": "FAILED", "rank": r, "error": text}

`EngineLauncher.start_engines` returns once all `data_parallel_size` engines are READY.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq

from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.spawn import (
    engine_start_method,
    engines_started,
    get_open_port,
    main_module_hidden,
    model_process_env,
    start_process,
)

logger = logging.getLogger(__name__)

READY_TIMEOUT_ENV = "PAGEDLLM_ENGINE_READY_TIMEOUT_S"
HANDSHAKE_HELLO = "HELLO"
HANDSHAKE_ADDRESSES = "ADDRESSES"
HANDSHAKE_REJECT = "REJECT"
HANDSHAKE_READY = "READY"
HANDSHAKE_FAILED = "FAILED"
_POLL_MS = 100

# Called with (rank, reason) when an engine stops without being asked to.
DeathCallback = Callable[[int, str], None]


def engine_identity(rank: int) -> bytes:
    """The ZMQ routing id of engine `rank` on every front end's input ROUTER."""
    return rank.to_bytes(2, "little")


def ready_timeout_s() -> float:
    return float(os.environ.get(READY_TIMEOUT_ENV, "600"))


class EngineZmqAddresses(msgspec.Struct):
    """Where the engines connect: one input and one output per front end, and the DP
    coordinator's sockets where there is one."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None  # engines push their counts here
    coordinator_front: str | None = None  # front ends subscribe to the published counts
    coordinator_engines: str | None = None  # engines subscribe to SHUTDOWN / START_DP_WAVE


class ClientConfig(msgspec.Struct):
    """What a front end that did not launch the engines needs to reach them (one of several
    API servers): its index, the addresses and each engine's KV-cache size."""

    client_index: int
    addresses: EngineZmqAddresses
    num_blocks: list[int]


def needs_coordinator(parallel: ParallelConfig, num_clients: int) -> bool:
    """A coordinator runs unless there is one local engine behind one front end."""
    return parallel.data_parallel_size > 1 or num_clients > 1 or parallel.data_parallel_multi_node


def uses_tcp(parallel: ParallelConfig) -> bool:
    return parallel.data_parallel_multi_node or parallel.data_parallel_backend == "ray"


# --------------------------------------------------------------------------- engine processes


@contextlib.contextmanager
def _engine_process_env(extra: dict[str, str]) -> Iterator[None]:
    """Environment the spawned engine process starts with (spawn copies os.environ): the model
    processes' own (pagedllm/spawn.py) and `extra`."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        with model_process_env():
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _device_env(config: EngineConfig, local_rank: int) -> dict[str, str]:
    """With several engines on one GPU node, each sees only its own devices (as in vLLM)."""
    parallel = config.parallel_config
    if config.device_config.device != "cuda" or parallel.data_parallel_size_local <= 1:
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    import torch

    devices = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
    per_engine = parallel.world_size
    mine = devices[local_rank * per_engine : (local_rank + 1) * per_engine]
    if len(mine) < per_engine:
        raise ValueError(
            f"data_parallel_size_local={parallel.data_parallel_size_local} x "
            f"{per_engine} devices per engine needs more GPUs than the {len(devices)} visible"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}


class _ProcHandle:
    """Stops the processes; held apart from the manager so that a `Finalize` can run it at
    interpreter exit (before multiprocessing joins its non-daemon children) without keeping
    the manager alive."""

    def __init__(self) -> None:
        self.procs: dict[int, Any] = {}  # rank -> Process
        self.stopping = threading.Event()
        self.wake_r, self.wake_w = os.pipe()

    def __call__(self) -> None:
        """Idempotent: SIGTERM (a clean exit), then SIGKILL after a grace period."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        with contextlib.suppress(OSError):
            os.write(self.wake_w, b"x")  # the monitor closes its end
        os.close(self.wake_w)
        started = [p for p in self.procs.values() if p.pid is not None]
        for proc in started:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in started:
            proc.join(timeout=max(deadline - time.monotonic(), 0.0))
        for proc in started:
            if proc.is_alive():
                logger.warning("EngineCore pid=%s did not exit; killing it", proc.pid)
                proc.kill()
                proc.join(timeout=5.0)


class CoreEngineProcManager:
    """Starts the engine-core processes of this node (`ranks`), watches them and stops them.

    Each process runs `core_proc.run_engine_core`, which does the handshake with `handshake_address`.
    Contract: `on_death(rank, reason)` is called from a monitor thread for every process that
    exits before `shutdown()`; `deaths` keeps what was reported. `shutdown()` is idempotent
    and also runs at interpreter exit."""

    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        ranks: list[int],
        local_handshake: bool,
        engine_core_cls: type | None = None,
        on_death: DeathCallback | None = None,
    ) -> None:
        from pagedllm.engine.core_proc import engine_process_main

        self.on_death = on_death
        self.deaths: dict[int, str] = {}
        self._handle = _ProcHandle()
        self._finalizer = multiprocessing.util.Finalize(self, self._handle, exitpriority=100)
        method = engine_start_method(config.device_config.device)
        ctx = multiprocessing.get_context(method)
        try:
            for local_rank, rank in enumerate(ranks):
                proc = ctx.Process(
                    target=engine_process_main,
                    name=f"EngineCore_DP{rank}",
                    kwargs=dict(
                        config=config,
                        handshake_address=handshake_address,
                        dp_rank=rank,
                        local_dp_rank=local_rank,
                        local=local_handshake,
                        parent_pid=os.getpid(),
                        engine_core_cls=engine_core_cls,
                        forked=method == "fork",
                    ),
                )
                self._handle.procs[rank] = proc
                env = _device_env(config, local_rank)
                with main_module_hidden(engine_core_cls), _engine_process_env(env):
                    start_process(proc, method)
        except BaseException:
            self.shutdown()
            raise
        threading.Thread(target=self._monitor, name="EngineCoreMonitor", daemon=True).start()

    @property
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._handle.procs.items()}

    def _monitor(self) -> None:
        handle = self._handle
        try:
            self._watch(handle)
        finally:
            os.close(handle.wake_r)

    def _watch(self, handle: _ProcHandle) -> None:
        waiting = {p.sentinel: rank for rank, p in handle.procs.items()}
        while waiting and not handle.stopping.is_set():
            ready = multiprocessing.connection.wait([*waiting, handle.wake_r])
            if handle.stopping.is_set():
                return
            for sentinel in ready:
                rank = waiting.pop(sentinel, None)
                if rank is None:
                    continue
                proc = handle.procs[rank]
                proc.join(timeout=1.0)
                reason = f"process exited with code {proc.exitcode}"
                self.deaths[rank] = reason
                if self.on_death is not None:
                    self.on_death(rank, reason)

    def shutdown(self) -> None:
        self._finalizer()


# --------------------------------------------------------------------------- launching


class EngineLauncher:
    """Launches the engines of a deployment from the head: the coordinator where one is
    needed, the engines of this node, and the handshake with every engine.

    Use: construct (the addresses are then known, so the front ends can bind), then
    `start_engines()`, which returns each engine's number of KV blocks. `shutdown()` stops
    everything this launcher started; idempotent."""

    def __init__(self, config: EngineConfig, num_clients: int = 1) -> None:
        parallel = config.parallel_config
        self.config = config
        self.num_engines = parallel.data_parallel_size
        self.tmpdir = tempfile.mkdtemp(prefix="pagedllm-")
        self.coordinator = None
        self.engine_manager: CoreEngineProcManager | Any = None
        host = parallel.data_parallel_address if uses_tcp(parallel) else None
        try:
            if needs_coordinator(parallel, num_clients):
                from pagedllm.engine.coordinator import DPCoordinator

                self.coordinator = DPCoordinator(self.num_engines, host, self.tmpdir)
            self.addresses = EngineZmqAddresses(
                inputs=[self._address(host, f"input{i}") for i in range(num_clients)],
                outputs=[self._address(host, f"output{i}") for i in range(num_clients)],
            )
            if self.coordinator is not None:
                self.addresses.coordinator_input = self.coordinator.input_address
                self.addresses.coordinator_front = self.coordinator.front_publish_address
                self.addresses.coordinator_engines = self.coordinator.engine_publish_address
        except BaseException:
            self.shutdown()
            raise

    def _address(self, host: str | None, name: str) -> str:
        if host is None:
            return f"ipc://{self.tmpdir}/{name}"
        return f"tcp://{host}:{get_open_port(host)}"

    def start_engines(
        self, engine_core_cls: type | None = None, on_death: DeathCallback | None = None
    ) -> list[int]:
        """Start this node's engines and wait until all engines (also remote ones) are
        ready. Raises RuntimeError naming the engine and the cause when one fails."""
        parallel = self.config.parallel_config
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        try:
            if parallel.data_parallel_multi_node:
                port = parallel.data_parallel_handshake_port
                sock.bind(f"tcp://{parallel.data_parallel_address}:{port}")
            elif uses_tcp(parallel):
                sock.bind(f"tcp://{parallel.data_parallel_address}:*")
            else:
                sock.bind(f"ipc://{self.tmpdir}/handshake")
            address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            local_ranks = list(range(parallel.data_parallel_size_local))
            if parallel.data_parallel_backend == "ray":
                from pagedllm.engine.ray_utils import CoreEngineActorManager

                self.engine_manager = CoreEngineActorManager(
                    self.config, address, local_ranks, engine_core_cls, on_death
                )
            elif local_ranks:
                self.engine_manager = CoreEngineProcManager(
                    self.config, address, local_ranks, True, engine_core_cls, on_death
                )
            engines_started()
            return self._wait_for_engines(sock, set(local_ranks))
        finally:
            sock.close()  # lingers until the last replies are out
            ctx.term()

    def _wait_for_engines(self, sock: zmq.Socket, local_ranks: set[int]) -> list[int]:
        timeout_s = ready_timeout_s()
        deadline = time.monotonic() + timeout_s
        encoder = msgspec.msgpack.Encoder()
        greeted: set[int] = set()
        num_blocks: dict[int, int] = {}
        while len(num_blocks) < self.num_engines:
            deaths = getattr(self.engine_manager, "deaths", {})
            for rank, reason in deaths.items():
                raise RuntimeError(
                    f"Engine core initialization failed: engine {rank} stopped before it was "
                    f"ready ({reason}); see its log above for the root cause"
                )
            if time.monotonic() > deadline:
                missing = sorted(set(range(self.num_engines)) - set(num_blocks))
                raise RuntimeError(
                    f"Engine core initialization failed: engines {missing} not ready within "
                    f"{timeout_s:.0f}s (set {READY_TIMEOUT_ENV} to wait longer)"
                )
            if not sock.poll(_POLL_MS):
                continue
            identity, payload = sock.recv_multipart()
            msg = msgspec.msgpack.decode(payload)
            rank, status = msg.get("rank"), msg.get("status")
            if status == HANDSHAKE_HELLO:
                error = self._check_hello(rank, msg.get("local"), local_ranks, greeted)
                reply = (
                    {"status": HANDSHAKE_REJECT, "error": error}
                    if error
                    else {"status": HANDSHAKE_ADDRESSES, "addresses": self.addresses}
                )
                sock.send_multipart([identity, encoder.encode(reply)])
                if error:
                    logger.error("Rejected an engine: %s", error)
                else:
                    greeted.add(rank)
            elif status == HANDSHAKE_READY and rank in greeted:
                num_blocks[rank] = int(msg["num_blocks"])
                logger.info(
                    "Engine core %d ready (pid %s, %d KV blocks)", rank, msg.get("pid"),
                    num_blocks[rank],
                )  # fmt: skip
            elif status == HANDSHAKE_FAILED:
                raise RuntimeError(f"Engine core initialization failed: {msg.get('error')}")
            else:
                logger.error("Unexpected handshake message %r ignored", msg)
        return [num_blocks[r] for r in range(self.num_engines)]

    def _check_hello(
        self, rank: Any, local: Any, local_ranks: set[int], greeted: set[int]
    ) -> str | None:
        if not isinstance(rank, int) or not 0 <= rank < self.num_engines:
            return f"engine rank {rank!r} is outside data_parallel_size={self.num_engines}"
        if rank in greeted:
            return f"two engines claim data-parallel rank {rank}"
        if (
            bool(local) != (rank in local_ranks)
            and self.config.parallel_config.data_parallel_backend == "mp"
        ):
            where = "this node" if rank in local_ranks else "another node"
            return f"data-parallel rank {rank} belongs to {where}; check --data-parallel-start-rank"
        return None

    def shutdown(self) -> None:
        if self.engine_manager is not None:
            self.engine_manager.shutdown()
        if self.coordinator is not None:
            self.coordinator.shutdown()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
