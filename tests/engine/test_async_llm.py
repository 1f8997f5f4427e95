"""AsyncLLM on a tiny Llama in an engine process: output kinds, n > 1, abort and
cancellation free the request, bad input, and a dead engine fails requests at once."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 42, 99, 7]}


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, loop):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.async_llm import AsyncLLM

    args = EngineArgs(
        model=tiny_llama_dir, dtype="float32", max_model_len=128, kv_cache_memory=2 << 20
    )
    engine = AsyncLLM.from_engine_args(args, log_stats=True)
    yield engine
    engine.shutdown()
    loop.run_until_complete(asyncio.sleep(0))  # let the cancelled tasks finish


def _greedy(kind: RequestOutputKind, max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=kind, **kw
    )


async def _collect(engine, params, request_id, prompt=PROMPT):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_output_kinds_agree(engine, loop):
    final = loop.run_until_complete(_collect(engine, _greedy(RequestOutputKind.FINAL_ONLY), "f"))
    assert len(final) == 1 and final[0].finished
    tokens = final[0].outputs[0].token_ids
    assert len(tokens) == 8
    delta = loop.run_until_complete(_collect(engine, _greedy(RequestOutputKind.DELTA), "d"))
    assert [t for o in delta for t in o.outputs[0].token_ids] == tokens
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    cumulative = loop.run_until_complete(
        _collect(engine, _greedy(RequestOutputKind.CUMULATIVE), "c")
    )
    assert cumulative[-1].outputs[0].token_ids == tokens and cumulative[-1].finished
    lens = [len(o.outputs[0].token_ids) for o in cumulative]
    assert lens == sorted(lens)


def test_n_greater_than_one(engine, loop):
    params = SamplingParams(
        n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )  # fmt: skip
    (out,) = loop.run_until_complete(_collect(engine, params, "n3"))
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(len(c.token_ids) == 4 for c in out.outputs)


def test_abort_and_cancel_free_the_engine(engine, loop):
    async def run():
        params = _greedy(RequestOutputKind.DELTA, max_tokens=100)
        gen = engine.generate(PROMPT, params, "to-abort")
        await gen.__anext__()
        await engine.abort("to-abort")
        await gen.aclose()

        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, long_params, "to-cancel"):
                started.set()

        # Long enough that it is still running when cancelled, once it has started.
        long_params = _greedy(RequestOutputKind.DELTA, max_tokens=400)
        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            stats = engine.prometheus.for_engine(0)
            if not engine.output_processor.has_unfinished_requests() and (
                stats.running._value.get() == 0 and stats.kv_usage._value.get() == 0
            ):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("aborted requests still hold the engine")

    loop.run_until_complete(run())
    # The engine still serves afterwards.
    out = loop.run_until_complete(_collect(engine, _greedy(RequestOutputKind.FINAL_ONLY), "ok"))
    assert out[-1].finished


def test_reused_request_id_never_reaches_the_other_request(engine, loop):
    """Requests added under one caller id (n = 2) run apart; one that fails half-added is
    cleaned up without touching the other, and the engine core is left idle."""

    async def run():
        params = _greedy(RequestOutputKind.FINAL_ONLY, max_tokens=6, n=2)
        a, b = await asyncio.gather(
            _collect(engine, params, "same"), _collect(engine, params, "same")
        )
        for out in (a[-1], b[-1]):
            assert out.request_id == "same" and out.finished
            assert sorted(len(c.token_ids) for c in out.outputs) == [6, 6]

        gen = engine.generate(PROMPT, _greedy(RequestOutputKind.DELTA, 30, n=2), "dup")
        await gen.__anext__()
        real_add = engine.engine_core.add_request_async
        sent: list[str] = []

        async def second_child_fails(request):
            sent.append(request.request_id)
            if len(sent) == 2:
                raise RuntimeError("injected failure")
            await real_add(request)

        engine.engine_core.add_request_async = second_child_fails
        try:
            with pytest.raises(RuntimeError, match="injected"):
                await engine.add_request("dup", PROMPT, params)
        finally:
            del engine.engine_core.add_request_async  # the class's method again
        rest = [out async for out in gen]
        assert rest[-1].finished
        assert engine.output_processor.request_states == {}
        assert engine.output_processor.parents == {}
        # The child that reached the core was aborted there (in order, before this call).
        assert not await engine.engine_core.call_utility_async("has_unfinished_requests")

    loop.run_until_complete(asyncio.wait_for(run(), 60))


def test_bad_input_is_a_value_error(engine, loop):
    with pytest.raises(ValueError, match="max_model_len"):
        loop.run_until_complete(
            _collect(
                engine,
                _greedy(RequestOutputKind.FINAL_ONLY),
                "long",
                {"prompt_token_ids": [1] * 200},
            )
        )
    loop.run_until_complete(engine.check_health())


def test_dead_engine_fails_fast(engine, loop):
    async def run():
        gen = engine.generate(PROMPT, _greedy(RequestOutputKind.DELTA, max_tokens=100), "dies")
        await gen.__anext__()
        os.kill(engine.engine_core.engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await _collect(engine, _greedy(RequestOutputKind.FINAL_ONLY), "after")

    loop.run_until_complete(asyncio.wait_for(run(), 10))
