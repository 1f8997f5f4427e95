"""A model-free stand-in for `EngineCore`, for tests of the process boundary and AsyncLLM.

Each running request gets one token per step: the previous token + 1 (the first is the last
prompt token + 1). Special prompts steer failures: a first prompt token of 666 makes `step()`
raise; `config.fail_start` makes construction raise (`True`: in every engine; a rank: in that
data-parallel engine only); the others take `config.start_delay` seconds to construct. With
`config.starting_file` (a path), an engine that starts creates it, and a failing one waits for
it first: the failure then lands while another engine is mid-start. `config.worker_dies_after`
(seconds) makes its stand-in executor report a dead worker then, as a multi-process executor
would.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace

from pagedllm.config import DeviceConfig, ParallelConfig
from pagedllm.engine import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
)

CRASH_TOKEN = 666


def fake_config(parallel: dict | None = None, **kwargs) -> SimpleNamespace:
    """A config for FakeEngineCore; `parallel`: ParallelConfig fields (data parallelism)."""
    defaults = dict(
        num_blocks=42,
        step_delay=0.0,
        fail_start=False,
        worker_dies_after=None,
        start_delay=0.0,
        starting_file=None,
        parallel_config=ParallelConfig(**(parallel or {})),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=None,
        stall_timeout_s=60.0,  # no heartbeats come: the fake has no scheduler to watch
    )
    defaults.update(kwargs)
    return SimpleNamespace(**defaults)


class FakeEngineCore:
    def __init__(self, config) -> None:
        fail = config.fail_start
        if fail is True or (
            fail is not False and fail == config.parallel_config.data_parallel_rank
        ):
            deadline = time.monotonic() + 60
            while config.starting_file and not os.path.exists(config.starting_file):
                assert time.monotonic() < deadline, "no other engine started"
                time.sleep(0.05)
            raise RuntimeError("bad checkpoint: config.json is missing")
        if config.starting_file:
            open(config.starting_file, "w").close()
        time.sleep(config.start_delay)
        self.config = config
        self.num_blocks = config.num_blocks
        self.running: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        if config.worker_dies_after is not None:
            self.executor = _DyingExecutor(config.worker_dies_after)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.running:
            raise ValueError(f"request_id={request.request_id!r} is already running")
        self.running[request.request_id] = (request, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.running.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def _stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            kv_cache_usage=len(self.running) / self.num_blocks,
            num_blocks_total=self.num_blocks,
        )

    def step(self) -> EngineCoreOutputs:
        if self.config.step_delay and self.running:
            time.sleep(self.config.step_delay)
        outputs = []
        for rid, (req, out) in list(self.running.items()):
            if req.prompt_token_ids[0] == CRASH_TOKEN:
                raise RuntimeError("boom: simulated kernel failure")
            token = (out[-1] if out else req.prompt_token_ids[-1]) + 1
            out.append(token)
            finish = None
            if len(out) >= req.sampling_params.max_tokens:
                finish = FinishReason.LENGTH
                del self.running[rid]
            outputs.append(EngineCoreOutput(rid, [token], finish_reason=finish))
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self._stats())

    def reset_prefix_cache(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


class _DyingExecutor:
    """Calls the registered failure callback `delay` seconds after registration."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def register_failure_callback(self, callback) -> None:
        timer = threading.Timer(self.delay, callback, args=("worker rank 1 died (simulated)",))
        timer.daemon = True
        timer.start()
