"""EngineCore with a pipeline-parallel executor (`max_concurrent_batches = 2`): the batch queue
keeps two batches in flight, never with a request in both, and the output is the synchronous
engine's."""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import Future

from pagedllm.engine import EngineCoreRequest
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import EngineCore
from pagedllm.executor.uniproc_executor import UniProcExecutor
from pagedllm.sampling_params import SamplingParams


class _Deferred(Future):
    """Runs its batch only when a result is first asked for (after every earlier batch), so a
    submitted batch stays in flight like one travelling down a pipeline."""

    def __init__(self, executor: _TwoStageExecutor, so) -> None:
        super().__init__()
        self.executor, self.so = executor, so

    def result(self, timeout=None):
        while not self.done():
            self.executor.run_oldest()
        return super().result(timeout)


class _TwoStageExecutor(UniProcExecutor):
    def _init_executor(self) -> None:
        super()._init_executor()
        self.pending: deque[_Deferred] = deque()
        self.max_in_flight = 0

    @property
    def max_concurrent_batches(self) -> int:
        return 2

    def execute_model(self, so, non_block=False):
        assert non_block
        in_flight = set().union(*(f.so.num_scheduled_tokens for f in self.pending))
        assert not in_flight & set(so.num_scheduled_tokens), "a request in two batches"
        future = _Deferred(self, so)
        self.pending.append(future)
        self.max_in_flight = max(self.max_in_flight, len(self.pending))
        return future

    def run_oldest(self) -> None:
        future = self.pending.popleft()
        future.set_result(self.worker.execute_model(future.so))


def _run(core: EngineCore, requests: list[EngineCoreRequest]) -> dict[str, list[int]]:
    for r in requests:
        core.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
    return tokens


def _requests(seed: int = 0) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [
        EngineCoreRequest(
            request_id=f"r{i}",
            prompt_token_ids=[rng.randrange(10, 500) for _ in range(n)],
            sampling_params=params,
            arrival_time=float(i),
        )
        for i, n in enumerate((5, 40, 17, 70, 3))
    ]


def test_batch_queue_keeps_two_batches_in_flight(tiny_llama_dir):
    args = dict(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=4 << 20,
                max_num_batched_tokens=32, max_num_seqs=3)  # fmt: skip
    sync = EngineCore(EngineArgs(**args).create_engine_config())
    expected = _run(sync, _requests())
    piped = EngineCore(EngineArgs(**args).create_engine_config(), _TwoStageExecutor)
    assert _run(piped, _requests()) == expected
    assert piped.executor.max_in_flight == 2
    assert not piped.batch_queue and not piped.executor.pending
