"""SpeculativeConfig validation (ValueErrors naming field and value), method inference from the
checkpoint, and the `--speculative-config JSON` flag."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.spec_decode.config import SpeculativeConfig, get_speculative_config


def test_ngram_defaults_and_one_sided_sizes():
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = SpeculativeConfig.from_dict(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 5}'
    )
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        3,
        2,
        5,
    )


@pytest.mark.parametrize(
    "values, message",
    [
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method='lookahead'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2},
            "prompt_lookup_min=4",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "=0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "/x"}, "model='/x'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required"),
        (
            {"method": "eagle", "num_speculative_tokens": 2, "model": "/no/such/dir"},
            "model='/no/such/dir'",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, "unknown field"),
        ({"num_speculative_tokens": 2}, "method is required"),
        ("{not json", "not valid JSON"),
    ],
)  # fmt: skip
def test_invalid_values_are_value_errors(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        SpeculativeConfig.from_dict(values)


def test_method_is_inferred_from_the_checkpoint(target_dir, draft_dir, eagle_dir, medusa_dir):
    for model, method in [(draft_dir, "draft_model"), (eagle_dir, "eagle"), (medusa_dir, "medusa")]:
        spec = SpeculativeConfig.from_dict({"model": model, "num_speculative_tokens": 2})
        assert spec.method == method


def test_engine_config_validates_against_the_target(target_dir, draft_dir, medusa_dir, tmp_path):
    from pagedllm.testing import make_demo_model

    config = EngineArgs(
        model=target_dir,
        speculative_config={
            "method": "draft_model",
            "num_speculative_tokens": 2,
            "model": draft_dir,
        },
    ).create_engine_config()
    spec = get_speculative_config(config)
    assert spec.method == "draft_model"
    assert spec.draft_model_config.hf_config.num_hidden_layers == 1
    assert spec.draft_model_config.dtype == config.model_config.dtype
    assert spec.draft_model_config.max_model_len == config.model_config.max_model_len

    other_vocab = make_demo_model(tmp_path / "v", preset="tiny", vocab_size=600)
    with pytest.raises(ValueError, match="vocab_size=600"):
        EngineArgs(
            model=target_dir,
            speculative_config={"method": "draft_model", "num_speculative_tokens": 2,
                                "model": other_vocab},
        ).create_engine_config()  # fmt: skip
    with pytest.raises(ValueError, match="num_speculative_tokens=4 exceeds the 3 heads"):
        EngineArgs(
            model=target_dir,
            speculative_config={
                "method": "medusa",
                "num_speculative_tokens": 4,
                "model": medusa_dir,
            },
        ).create_engine_config()


def test_cli_flag_parses_json(target_dir):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}']
    )
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = target_dir
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    spec = get_speculative_config(engine_args.create_engine_config())
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 4)


def test_serve_parser_takes_the_flag():
    from pagedllm.entrypoints.cli.main import build_parser

    args = build_parser().parse_args(
        [
            "serve",
            "some-model",
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 2}',
        ]
    )
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
