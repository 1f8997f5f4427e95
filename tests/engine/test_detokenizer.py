"""IncrementalDetokenizer: token-by-token text equals a one-shot decode; stop strings."""

import random

import pytest

from pagedllm.engine.detokenizer import IncrementalDetokenizer, special_token_ids
from pagedllm.sampling_params import SamplingParams
from pagedllm.testing.demo_model import build_tokenizer

TEXT = "Hello world, ünïcode ✓ and emoji 🙂 in one line.\nSecond line: 3.14 x 2 = 6.28!"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(4096)  # trained vocab padded with special <extra_N> tokens


def _feed(tokenizer, ids, **params) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(**params))
    for token_id in ids:
        detok.update([token_id], stop_terminated=False)
    return detok


def _with_specials(tokenizer, ids: list[int], seed: int) -> list[int]:
    """`ids` with special tokens (long runs included) inserted at random places."""
    specials = sorted(special_token_ids(tokenizer.backend_tokenizer))
    rng = random.Random(seed)
    out: list[int] = []
    for token_id in ids:
        if rng.random() < 0.3:
            out.extend(rng.choice(specials) for _ in range(rng.choice([1, 2, 50])))
        out.append(token_id)
    return out


def test_special_ids_are_the_special_added_tokens(tokenizer):
    ids = special_token_ids(tokenizer.backend_tokenizer)
    assert tokenizer.convert_tokens_to_ids("</s>") in ids
    assert tokenizer.convert_tokens_to_ids("<extra_0>") in ids
    assert not ids & set(tokenizer.encode(TEXT, add_special_tokens=False))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_incremental_text_equals_one_shot_decode(tokenizer, seed):
    ids = _with_specials(tokenizer, tokenizer.encode(TEXT, add_special_tokens=False), seed)
    assert _feed(tokenizer, ids).output_text == TEXT
    shown = _feed(tokenizer, ids, skip_special_tokens=False).output_text
    assert shown == tokenizer.decode(ids, skip_special_tokens=False)
    assert "<extra_" in shown


def test_skipped_special_tokens_never_reach_the_stream(tokenizer):
    """A long run of skipped special tokens costs no stream work (the stream would re-decode
    its growing pending window on each one)."""

    class CountingStream:
        def __init__(self, stream):
            self.stream, self.calls = stream, 0

        def step(self, backend, token_id):
            self.calls += 1
            return self.stream.step(backend, token_id)

    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok._stream = counting = CountingStream(detok._stream)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    extra = tokenizer.convert_tokens_to_ids("<extra_7>")
    for token_id in [extra] * 2000 + text_ids:
        detok.update([token_id], stop_terminated=False)
    assert detok.output_text == TEXT
    assert counting.calls == len(text_ids)
    assert len(detok.token_ids) == 2000 + len(text_ids)


def test_stop_string_split_over_steps_is_held_back_and_cut(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "Second line"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    sent, shown, found = 0, "", None
    for token_id in ids:
        found = detok.update([token_id], stop_terminated=False)
        if found is not None:
            break
        delta, sent = detok.get_text(finished=False, delta=True, sent=sent)
        shown += delta
        assert stop not in shown
    assert found == stop
    final, _ = detok.get_text(finished=True, delta=True, sent=sent)
    assert shown + final == TEXT[: TEXT.index(stop)]
