"""RayDistributedExecutor: the workers are Ray actors, so one model can span several machines.

It attaches to the Ray cluster in use (`RAY_ADDRESS`, the latest `ray start` on this machine,
or a `ray.init()` the caller already made) or starts a local one. A placement group reserves one
bundle per rank (a GPU each on CUDA, a CPU each otherwise; PACK: as few nodes as fit); rank i's
actor runs in bundle i and holds the same `Worker` the other executors use. The ranks meet in
`torch.distributed` at rank 0's node; ranks of one group that share a node use shared memory
for their collectives, others gloo (NCCL on GPUs).

Each call goes to every actor as a Ray task (the `SchedulerOutput` is put in the object store
once); the driver rank's result is returned. Calls are answered in submission order (an
actor runs one at a time), so `non_block=True` returns a Future and pipeline stages can hold
several batches. Faults: every actor also runs a never-ending `sentinel` task in a separate
concurrency group; a death-watch thread waits on them, and the first to end (the actor died)
fails the executor, kills the other actors and runs the failure callback.

Ray is optional (`pip install pagedllm[ray]`); nothing else imports it.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.executor.abstract import DistributedExecutor, WorkerDiedError

logger = logging.getLogger(__name__)

PG_TIMEOUT_ENV = "PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S"
_POLL_S = 0.1


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'"
        ) from None
    return ray


class RayWorkerWrapper:
    """The actor body: a `Worker` built on request, and a sentinel for the death watch."""

    def __init__(self) -> None:
        self.worker = None
        self._stop = threading.Event()

    def node_info(self) -> tuple[str, str, int]:
        """(Ray node id, node IP, pid) of this actor."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def open_port(self) -> int:
        from pagedllm.spawn import get_open_port

        return get_open_port("0.0.0.0")

    def init_worker(
        self,
        config: EngineConfig,
        rank: int,
        local_rank: int,
        local_world_size: int,
        distributed_init_method: str,
        node_id: str,
    ) -> None:
        from pagedllm.worker.cpu_binding import bind_threads, plan_cpu_binding
        from pagedllm.worker.worker import Worker

        if config.device_config.device == "cpu":
            plan = plan_cpu_binding(local_world_size)
            bind_threads(plan[local_rank] if plan else None)
        self.worker = Worker(config, rank, local_rank, distributed_init_method, node_id)
        self.worker.init_device()
        self.worker.load_model()

    def execute_method(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)

    def sentinel(self) -> None:
        """Never returns while the actor lives (the death watch waits on it)."""
        self._stop.wait()


class RayDistributedExecutor(DistributedExecutor):
    """Runs the ranks as Ray actors (see the module docstring)."""

    def _init_executor(self) -> None:
        ray = self._ray = _import_ray()
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._closing = False
        self._started_ray = False
        self._pg = None
        self.workers: list[Any] = []
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="RayExecutorIO")
        try:
            self._connect()
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._sentinels = [w.sentinel.remote() for w in self.workers]
        threading.Thread(target=self._watch_workers, name="RayWorkerWatch", daemon=True).start()
        logger.info("Ray executor: %d actors on %s", self.world_size, ray.get_runtime_context())

    # ---- start-up ------------------------------------------------------------------------

    def _connect(self) -> None:
        """Attach to the cluster in use, or start a local one sized for the world (ranks may
        share cores, as the mp executor's do)."""
        ray = self._ray
        if ray.is_initialized():
            return
        # ray.init installs its own SIGTERM handler; the engine process keeps its own.
        saved = signal.getsignal(signal.SIGTERM)
        kwargs: dict[str, Any] = {"ignore_reinit_error": True, "include_dashboard": False}
        if not os.environ.get("RAY_ADDRESS") and self.config.device_config.device == "cpu":
            kwargs["num_cpus"] = max(os.cpu_count() or 1, self.world_size)
        try:
            ray.init(**kwargs)
        except ValueError:  # an existing cluster: its resources are not ours to set
            kwargs.pop("num_cpus", None)
            ray.init(**kwargs)
        self._started_ray = True
        if threading.current_thread() is threading.main_thread() and saved is not None:
            signal.signal(signal.SIGTERM, saved)

    def _start_workers(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = self.config.device_config.device == "cuda"
        bundle = {"GPU": 1.0} if gpu else {"CPU": 1.0}
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        timeout_s = float(os.environ.get(PG_TIMEOUT_ENV, "120"))
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} workers of {bundle} within "
                f"{timeout_s:.0f}s (cluster resources: {ray.cluster_resources()}); set "
                f"{PG_TIMEOUT_ENV} to wait longer"
            )
        actor_cls = _actor_class(ray)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank
            )
            self.workers.append(
                actor_cls.options(
                    num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0,
                    scheduling_strategy=strategy,
                ).remote()
            )  # fmt: skip
        nodes = ray.get([w.node_info.remote() for w in self.workers])
        port = ray.get(self.workers[0].open_port.remote())
        init_method = f"tcp://{nodes[0][1]}:{port}"
        refs = []
        for rank, (node_id, _, _) in enumerate(nodes):
            same_node = [r for r, (n, _, _) in enumerate(nodes) if n == node_id]
            refs.append(
                self.workers[rank].init_worker.remote(
                    self.config, rank, same_node.index(rank), len(same_node), init_method,
                    node_id,
                )
            )  # fmt: skip
        ray.get(refs)
        self.node_ids = [n for n, _, _ in nodes]
        self.pids = [pid for _, _, pid in nodes]

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
        ray = self._ray
        args = tuple(ray.put(a) if isinstance(a, SchedulerOutput) else a for a in args)
        refs = [w.execute_method.remote(method, *args) for w in self.workers]
        future = self._io.submit(self._wait_all, refs)
        if unique_reply_rank is not None:
            result: Future = Future()
            future.add_done_callback(lambda f: _chain(f, result, unique_reply_rank))
            future = result
        return future if non_block else future.result()

    def _wait_all(self, refs: list[Any]) -> list[Any]:
        """Every rank's result (all ranks finish a step together; the driver's stage last);
        WorkerDiedError as soon as one fails or dies, with the others stopped."""
        ray = self._ray
        pending = list(refs)
        while pending:
            if self._failure is not None:
                raise WorkerDiedError(self._failure)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as e:
                    rank = refs.index(ref)
                    self._fail(f"worker rank {rank} failed: {type(e).__name__}: {e}")
                    raise WorkerDiedError(self._failure) from None
        return ray.get(refs)

    # ---- faults and shutdown -------------------------------------------------------------

    def _watch_workers(self) -> None:
        ray = self._ray
        done, _ = ray.wait(self._sentinels, num_returns=1)
        if self._closing:
            return
        rank = self._sentinels.index(done[0])
        self._fail(
            f"worker rank {rank} (Ray actor pid {self.pids[rank]} on node "
            f"{self.node_ids[rank]}) died"
        )

    def _fail(self, reason: str) -> None:
        """Mark the executor failed (once), stop every actor, tell the engine."""
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
        logger.error("%s; stopping the other workers", reason)
        self._kill_workers()
        self._report_failure(reason)

    def _kill_workers(self) -> None:
        for w in self.workers:
            try:
                self._ray.kill(w)
            except Exception:  # already gone
                pass

    def shutdown(self) -> None:
        """Kill the actors, free the placement group, and stop Ray if this executor started
        it. Idempotent."""
        if self._closing:
            return
        self._closing = True
        ray = self._ray
        self._kill_workers()
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:
                pass
        self._io.shutdown(wait=False, cancel_futures=True)
        if self._started_ray and ray.is_initialized():
            ray.shutdown()


def _actor_class(ray: Any) -> Any:
    """`RayWorkerWrapper` as a Ray actor class whose sentinel runs beside the calls (its own
    concurrency group), built here because Ray is imported only when this backend is used."""

    class RayWorker(RayWorkerWrapper):
        @ray.method(concurrency_group="watch")
        def sentinel(self) -> None:
            super().sentinel()

    return ray.remote(concurrency_groups={"watch": 1})(RayWorker)


def _chain(source: Future, target: Future, index: int) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result()[index])
