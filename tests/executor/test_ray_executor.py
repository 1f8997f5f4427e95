"""RayDistributedExecutor: greedy output identical to the single-process engine on a local Ray
instance the executor starts itself (TP=2 x PP=2) and on a two-node cluster built on this
machine (two Ray nodes of one CPU each, attached through RAY_ADDRESS) with TP=2 spanning both;
a killed actor fails the engine within seconds; no Ray process outlives the engine."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor.abstract import WorkerDiedError
from pagedllm.executor.ray_executor import RayDistributedExecutor
from tests.entrypoints.conftest import cmdline, descendant_pids, pid_alive

ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PROMPTS = [[5, 17, 99, 230, 31, 8, 77], [400, 12, 12, 301, 9], list(range(40, 90))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def _engine_core_in_process():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ENABLE_MULTIPROCESSING", "0")
        mp.delenv("RAY_ADDRESS", raising=False)
        yield


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=2 << 20)
    yield _tokens(llm)
    llm.shutdown()


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _executor(llm: LLM) -> RayDistributedExecutor:
    executor = llm.llm_engine.engine_core.engine_core.executor
    assert isinstance(executor, RayDistributedExecutor)
    return executor


def test_local_instance_identity_fault_and_cleanup(tiny_llama_dir, reference):
    """No cluster in use: the executor starts a local Ray instance, and stops it again."""
    before = set(descendant_pids(os.getpid()))
    llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=2 << 20,
              tensor_parallel_size=2, pipeline_parallel_size=2,
              distributed_executor_backend="ray")  # fmt: skip
    executor = _executor(llm)
    ray_procs = [p for p in descendant_pids(os.getpid()) if p not in before]
    assert any("raylet" in cmdline(p) for p in ray_procs)
    try:
        assert _tokens(llm) == reference
        engine = llm.llm_engine
        engine.add_request("long", {"prompt_token_ids": PROMPTS[0]}, _long())
        engine.step()
        os.kill(executor.pids[3], signal.SIGKILL)  # the driver rank, mid-generation
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 3"):
            for _ in range(1000):
                engine.step()
        assert time.monotonic() - t0 < 5
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in ray_procs):
        left = [cmdline(p)[:80] for p in ray_procs if pid_alive(p)]
        assert time.monotonic() < deadline, f"Ray processes outlived the engine: {left}"
        time.sleep(0.2)
    assert not ray.is_initialized()


def test_two_nodes_tp_spanning_both(tiny_llama_dir, reference, monkeypatch):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        # No backend named: RAY_ADDRESS makes 'ray' the default.
        llm = LLM(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=2 << 20,
                  tensor_parallel_size=2)  # fmt: skip
        try:
            executor = _executor(llm)
            assert len(set(executor.node_ids)) == 2  # one rank per node: gloo between them
            assert _tokens(llm) == reference
        finally:
            llm.shutdown()
        assert not ray.is_initialized()  # the engine detached; the cluster is the test's
    finally:
        cluster.shutdown()


def _long() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
