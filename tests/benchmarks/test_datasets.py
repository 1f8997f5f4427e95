"""Benchmark workloads: random-dataset lengths, range ratio, prefix sharing, seeding, and
ShareGPT parsing and filtering."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest

from pagedllm.benchmarks.datasets import (
    add_dataset_args,
    get_requests,
    load_sharegpt_requests,
    sample_random_requests,
    uniform_range,
)


class WordTokenizer:
    """One token per whitespace-separated word (ids are positions), so counts are obvious."""

    all_special_ids = [0, 1]

    def __len__(self) -> int:
        return 50

    def __call__(self, text: str) -> SimpleNamespace:
        return SimpleNamespace(input_ids=list(range(2, 2 + len(text.split()))))


def test_fixed_lengths_without_range():
    reqs = sample_random_requests(20, input_len=30, output_len=7, vocab_size=100, prefix_len=5)
    assert len(reqs) == 20
    assert all(r.prompt_len == 35 for r in reqs)
    assert all(r.expected_output_len == 7 for r in reqs)


def test_range_ratio_bounds():
    assert uniform_range(100, 0.5) == (50, 150)
    assert uniform_range(10, 0.95, minimum=1) == (1, 19)
    reqs = sample_random_requests(
        400, input_len=100, output_len=20, vocab_size=100, range_ratio=0.5, seed=3
    )
    in_lens = [r.prompt_len for r in reqs]
    out_lens = [r.expected_output_len for r in reqs]
    assert min(in_lens) >= 50 and max(in_lens) <= 150
    assert min(out_lens) >= 10 and max(out_lens) <= 30
    # Uniform: 400 draws cover the range's ends and centre on the nominal length.
    assert min(in_lens) <= 55 and max(in_lens) >= 145
    assert 90 <= sum(in_lens) / len(in_lens) <= 110


@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5])
def test_range_ratio_must_be_below_one(ratio):
    with pytest.raises(ValueError, match="random_range_ratio"):
        sample_random_requests(2, 10, 10, vocab_size=100, range_ratio=ratio)


def test_prefix_is_shared_and_bodies_differ():
    reqs = sample_random_requests(8, input_len=16, output_len=4, vocab_size=1000, prefix_len=12)
    prefix = reqs[0].prompt_token_ids[:12]
    assert all(r.prompt_token_ids[:12] == prefix for r in reqs)
    bodies = {tuple(r.prompt_token_ids[12:]) for r in reqs}
    assert len(bodies) == 8


def test_seeded_reproducibility():
    def make(seed):
        reqs = sample_random_requests(
            10, 40, 10, vocab_size=500, range_ratio=0.3, prefix_len=4, seed=seed
        )
        return [(r.prompt_token_ids, r.expected_output_len) for r in reqs]

    assert make(7) == make(7)
    assert make(7) != make(8)


def test_special_tokens_and_vocab_bounds():
    reqs = sample_random_requests(5, 200, 3, vocab_size=10, special_ids=[0, 1, 2], seed=1)
    ids = {t for r in reqs for t in r.prompt_token_ids}
    assert ids <= set(range(3, 10))
    assert len(ids) == 7  # 1000 draws hit every allowed id


def test_empty_body_only_with_prefix():
    assert sample_random_requests(3, 0, 5, vocab_size=10)[0].prompt_len == 1
    assert sample_random_requests(3, 0, 5, vocab_size=10, prefix_len=4)[0].prompt_len == 4


def test_invalid_counts():
    with pytest.raises(ValueError, match="num_prompts"):
        sample_random_requests(0, 10, 10, vocab_size=10)
    with pytest.raises(ValueError, match="output_len"):
        sample_random_requests(1, 10, 0, vocab_size=10)


def _conv(prompt_words: int, reply_words: int) -> dict:
    return {
        "conversations": [
            {"from": "human", "value": " ".join(["q"] * prompt_words)},
            {"from": "gpt", "value": " ".join(["a"] * reply_words)},
        ]
    }


@pytest.fixture
def sharegpt_file(tmp_path):
    data = [
        _conv(5, 10),
        _conv(6, 12),
        _conv(3, 10),  # prompt too short
        _conv(5, 2),  # reply too short
        _conv(1100, 10),  # prompt too long
        {"conversations": [{"from": "human", "value": "only one turn here"}]},
        _conv(8, 20),
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_sharegpt_first_turn_and_reply_length(sharegpt_file):
    reqs = load_sharegpt_requests(sharegpt_file, 100, WordTokenizer(), seed=0)
    pairs = sorted((r.prompt_len, r.expected_output_len) for r in reqs)
    assert pairs == [(5, 10), (6, 12), (8, 20)]
    assert all(r.prompt == " ".join(["q"] * r.prompt_len) for r in reqs)


def test_sharegpt_fixed_output_len_and_limits(sharegpt_file):
    reqs = load_sharegpt_requests(sharegpt_file, 100, WordTokenizer(), output_len=3)
    # A fixed output length also admits the short reply.
    assert sorted(r.prompt_len for r in reqs) == [5, 5, 6, 8]
    assert all(r.expected_output_len == 3 for r in reqs)
    reqs = load_sharegpt_requests(sharegpt_file, 100, WordTokenizer(), max_model_len=18)
    assert sorted((r.prompt_len, r.expected_output_len) for r in reqs) == [(5, 10), (6, 12)]
    assert len(load_sharegpt_requests(sharegpt_file, 2, WordTokenizer())) == 2


def test_sharegpt_seeded_shuffle(sharegpt_file):
    def order(seed):
        return [
            r.prompt_len for r in load_sharegpt_requests(sharegpt_file, 3, WordTokenizer(), seed)
        ]

    assert order(1) == order(1)
    assert {tuple(order(s)) for s in range(10)} != {tuple(order(1))}


def test_get_requests_from_flags(sharegpt_file):
    parser = argparse.ArgumentParser()
    add_dataset_args(parser)
    args = parser.parse_args(
        ["--num-prompts", "4", "--random-input-len", "9", "--output-len", "2", "--prefix-len", "3"]
    )
    args.seed = 0
    reqs = get_requests(args, WordTokenizer())
    assert [r.prompt_len for r in reqs] == [12] * 4
    assert all(t >= 2 and t < 50 for r in reqs for t in r.prompt_token_ids)
    args = parser.parse_args(["--dataset-name", "sharegpt", "--dataset-path", sharegpt_file])
    assert len(get_requests(args, WordTokenizer())) == 3
    args = parser.parse_args(["--dataset-name", "sharegpt"])
    with pytest.raises(ValueError, match="--dataset-path"):
        get_requests(args, WordTokenizer())


def test_sharegpt_missing_or_unreadable_file_names_the_flag(tmp_path):
    missing = str(tmp_path / "none.json")
    with pytest.raises(ValueError, match=r"--dataset-path=.*none\.json.*No such file"):
        load_sharegpt_requests(missing, 4, WordTokenizer())
    not_json = tmp_path / "notes.txt"
    not_json.write_text("not a dataset")
    with pytest.raises(ValueError, match=r"--dataset-path=.*notes\.txt.* is not JSON"):
        load_sharegpt_requests(str(not_json), 4, WordTokenizer())
