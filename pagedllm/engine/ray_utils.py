"""Engine cores as Ray actors (`--data-parallel-backend ray`, needs `pagedllm[ray]`).

Each data-parallel engine is a `DPEngineCoreActor` that Ray places on its cluster (one joined
with `ray start`, found through `RAY_ADDRESS`, or a local one started here). An actor runs
the same `run_engine_core` as an engine process: it does the ZMQ handshake with the head and
then talks ZMQ to the front ends, so only the placement differs. The sockets are TCP on
`data_parallel_address`, which every Ray node must reach.
"""

from __future__ import annotations

import logging
import os
import threading

from pagedllm.config import EngineConfig
from pagedllm.engine.utils import DeathCallback

logger = logging.getLogger(__name__)

_POLL_S = 0.5


class DPEngineCoreActor:
    """A Ray actor that runs one engine core until it is stopped."""

    def run(
        self,
        config: EngineConfig,
        handshake_address: str,
        dp_rank: int,
        engine_core_cls: type | None,
    ) -> int:
        from pagedllm.engine.core_proc import run_engine_core

        return run_engine_core(
            config=config,
            handshake_address=handshake_address,
            dp_rank=dp_rank,
            local_dp_rank=0,
            local=False,
            parent_pid=None,  # Ray ends an actor whose owner is gone
            engine_core_cls=engine_core_cls,
        )


class CoreEngineActorManager:
    """The Ray counterpart of `CoreEngineProcManager`: same contract (`on_death`, `deaths`,
    idempotent `shutdown`), engines placed by Ray."""

    def __init__(
        self,
        config: EngineConfig,
        handshake_address: str,
        ranks: list[int],
        engine_core_cls: type | None = None,
        on_death: DeathCallback | None = None,
    ) -> None:
        try:
            import ray
        except ImportError:
            raise ValueError(
                "data_parallel_backend='ray' needs Ray: pip install 'pagedllm[ray]'"
            ) from None
        self._ray = ray
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
        self.on_death = on_death
        self.deaths: dict[int, str] = {}
        self._stopping = threading.Event()
        gpus = config.parallel_config.world_size if config.device_config.device == "cuda" else 0
        actor_cls = ray.remote(num_cpus=1, num_gpus=gpus)(DPEngineCoreActor)
        self.actors = {rank: actor_cls.remote() for rank in ranks}
        self._runs = {
            actor.run.remote(config, handshake_address, rank, engine_core_cls): rank
            for rank, actor in self.actors.items()
        }
        threading.Thread(target=self._monitor, name="EngineActorMonitor", daemon=True).start()

    def _monitor(self) -> None:
        pending = dict(self._runs)
        while pending and not self._stopping.is_set():
            done, _ = self._ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            if self._stopping.is_set():
                return
            for ref in done:
                rank = pending.pop(ref)
                try:
                    reason = f"actor returned with code {self._ray.get(ref)}"
                except Exception as e:  # the actor died
                    reason = f"actor died: {type(e).__name__}"
                self.deaths[rank] = reason
                if self.on_death is not None:
                    self.on_death(rank, reason)

    def shutdown(self) -> None:
        """Idempotent: kill the actors (the coordinator has told the engines to stop)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        for actor in self.actors.values():
            try:
                self._ray.kill(actor)
            except Exception:  # already gone
                logger.debug("Ray actor already gone", exc_info=True)
