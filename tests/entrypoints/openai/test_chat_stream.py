"""The chat stream's role chunk goes out with the first output, not before it: a client that
times its first chunk (vLLM's `bench serve`, `pagedllm bench serve` against other servers)
then times the first token. With `stream_options.continuous_usage_stats` every chunk, the
role chunk included, carries the usage so far (as vLLM's do; guidellm and aiperf ask for it)."""

from __future__ import annotations

import asyncio
import json

from pagedllm.entrypoints.openai.chat_output import ChatOutputParser
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import ServingOptions
from pagedllm.outputs import CompletionOutput, RequestOutput


def _output(text: str, finish: str | None, n: int) -> RequestOutput:
    outs = [CompletionOutput(i, text, [7], None, None, finish) for i in range(n)]
    out = RequestOutput("r", None, [1, 2], None, outs, finished=finish is not None)
    out.num_cached_tokens = 16  # what the prefix cache served (with prompt tokens details)
    return out


def _chunks(
    n: int, echo: str, stream_options: dict | None = None, details: bool = False
) -> list[dict]:
    async def run() -> list[dict]:
        gate = asyncio.Event()

        async def engine():
            await gate.wait()  # the engine has produced nothing until the gate opens
            yield _output("a", None, n)
            yield _output("b", "length", n)

        request = ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            n=n,
            stream_options=stream_options,
        )
        parsers = [ChatOutputParser(None, [1, 2], None) for _ in range(n)]
        serving = OpenAIServingChat.__new__(OpenAIServingChat)  # no engine: options only
        serving.served_model_names = ["m"]
        serving.options = ServingOptions(enable_prompt_tokens_details=details)
        stream = OpenAIServingChat._stream(serving, request, "r", 0, 2, engine(), parsers, echo)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), "a chunk went out before the engine's first output"
        gate.set()
        lines = [await first] + [line async for line in stream]
        assert lines[-1] == "data: [DONE]\n\n"
        return [json.loads(line[len("data: ") :]) for line in lines[:-1]]

    return asyncio.run(run())


def test_role_chunk_waits_for_the_first_output():
    chunks = _chunks(1, "")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "a"}, {"content": "b"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_role_and_echo_per_choice_then_content():
    chunks = _chunks(2, "hi")
    heads = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks[:4]]
    assert heads == [
        (0, {"role": "assistant", "content": ""}),
        (0, {"content": "hi"}),
        (1, {"role": "assistant", "content": ""}),
        (1, {"content": "hi"}),
    ]
    content = [(c["choices"][0]["index"], c["choices"][0]["delta"]["content"]) for c in chunks[4:]]
    assert content == [(0, "a"), (1, "a"), (0, "b"), (1, "b")]


def test_continuous_usage_on_every_chunk_role_chunk_included():
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = _chunks(2, "hi", options)
    usages = [(c["choices"][0]["index"] if c["choices"] else None, c["usage"]) for c in chunks]
    head = {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    after = [{"prompt_tokens": 2, "completion_tokens": k, "total_tokens": 2 + k} for k in (1, 2)]
    assert usages == [
        (0, head), (0, head), (1, head), (1, head),  # role and echo chunks: nothing generated
        (0, after[0]), (1, after[0]), (0, after[1]), (1, after[1]),
        (None, {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}),  # the total
    ]  # fmt: skip


def test_usage_only_where_asked():
    chunks = _chunks(1, "", {"include_usage": True})
    assert [("usage" in c) for c in chunks] == [False, False, False, True]
    assert all("usage" not in c for c in _chunks(1, ""))


def test_prompt_tokens_details_only_with_the_flag():
    """--enable-prompt-tokens-details puts the cached prompt tokens in the final usage."""
    options = {"include_usage": True}
    assert "prompt_tokens_details" not in _chunks(1, "", options)[-1]["usage"]
    usage = _chunks(1, "", options, details=True)[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
