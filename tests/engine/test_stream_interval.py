"""`stream_interval` (vLLM's --stream-interval): a streamed request's outputs go out every N
tokens, the first and the last at once, and together they hold every token and all the text;
the default of 1 sends one output per step."""

from __future__ import annotations

import pytest

from pagedllm.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.testing.demo_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(512)


def _stream(tokenizer, interval: int, kind: RequestOutputKind, steps: list[list[int]]):
    processor = OutputProcessor(tokenizer, stream_interval=interval)
    params = SamplingParams(max_tokens=64, output_kind=kind)
    request = EngineCoreRequest("r", [5, 6, 7], params, arrival_time=0.0)
    processor.add_request(request, None)
    sent = []
    for i, ids in enumerate(steps):
        last = i == len(steps) - 1
        out = EngineCoreOutput("r", ids, finish_reason=FinishReason.LENGTH if last else None)
        sent += processor.process_outputs([out]).request_outputs
    return sent


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_outputs_every_n_tokens(tokenizer, kind):
    steps = [[20 + i] for i in range(10)] + [[40, 41, 42]]  # 13 tokens, a last step of 3
    every = _stream(tokenizer, 1, kind, steps)
    fours = _stream(tokenizer, 4, kind, steps)
    assert len(every) == 11
    # After the first token: 1+4, 1+8, then the end (12, 13 with the last step's three).
    counts = [len(o.outputs[0].token_ids) for o in fours]
    if kind == RequestOutputKind.DELTA:
        assert counts == [1, 4, 4, 4] and sum(counts) == 13
        tokens = [t for o in fours for t in o.outputs[0].token_ids]
        assert tokens == [t for step in steps for t in step]
        assert "".join(o.outputs[0].text for o in fours) == "".join(
            o.outputs[0].text for o in every
        )
    else:
        assert counts == [1, 5, 9, 13]
        assert fours[-1].outputs[0].text == every[-1].outputs[0].text
    assert fours[-1].finished and not any(o.finished for o in fours[:-1])


def test_final_only_is_one_output_whatever_the_interval(tokenizer):
    steps = [[20 + i] for i in range(6)]
    (out,) = _stream(tokenizer, 4, RequestOutputKind.FINAL_ONLY, steps)
    assert out.finished and len(out.outputs[0].token_ids) == 6


def test_a_bad_interval_is_refused_by_name(tiny_llama_dir):
    from pagedllm.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="stream_interval=0"):
        EngineArgs(model=tiny_llama_dir, stream_interval=0).create_engine_config()
