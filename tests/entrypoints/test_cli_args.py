"""Server and engine flags: `--config` YAML files, aliases, vLLM's size syntax, several served
names, `--generation-config`. (A live server configured by a YAML file: test_openai_surface.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pagedllm.engine.arg_utils import EngineArgs, human_readable_int
from pagedllm.entrypoints.openai.cli_args import expand_config_file, make_arg_parser


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    return make_arg_parser(parser)


def _parse(tmp_path: Path, yaml_text: str, cli: list[str]) -> argparse.Namespace:
    path = tmp_path / "config.yaml"
    path.write_text(yaml_text)
    parser = _parser()
    return parser.parse_args(expand_config_file(parser, ["--config", str(path), *cli]))


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    args = _parse(
        tmp_path,
        "max-model-len: 256\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
        "enable-log-requests: true\nserved-model-name: [a, b]\n"
        'allowed-origins: ["http://x"]\nspeculative-config: {method: ngram}\nport: 9000\n',
        ["MODEL", "--port", "9001", "--max-num-seqs", "4"],
    )
    assert args.model_tag == "MODEL" and args.max_model_len == 256
    assert args.port == 9001 and args.max_num_seqs == 4  # the command line wins
    assert args.enable_prefix_caching is False and args.enable_log_requests is True
    assert args.served_model_name == ["a", "b"] and args.allowed_origins == ["http://x"]
    assert args.speculative_config == {"method": "ngram"}


def test_config_file_errors(tmp_path):
    with pytest.raises(ValueError, match="'no-such-flag' is not a flag"):
        _parse(tmp_path, "no-such-flag: 1\n", [])
    with pytest.raises(ValueError, match="mapping"):
        _parse(tmp_path, "- a\n- b\n", [])


def test_kv_cache_memory_bytes_and_its_alias():
    assert human_readable_int("4G") == 4 << 30 and human_readable_int("25.6k") == 25600
    assert human_readable_int("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int("lots")
    for flag in ("--kv-cache-memory-bytes", "--kv-cache-memory"):
        assert _parser().parse_args([flag, "512M"]).kv_cache_memory_bytes == 512 << 20
    assert EngineArgs.from_kwargs(kv_cache_memory=5).kv_cache_memory_bytes == 5
    with pytest.raises(ValueError, match="same argument"):
        EngineArgs.from_kwargs(kv_cache_memory=5, kv_cache_memory_bytes=6)


def test_generation_config_modes(tiny_llama_dir, tmp_path):
    def defaults(generation_config: str) -> dict:
        args = EngineArgs(model=tiny_llama_dir, device="cpu", generation_config=generation_config)
        return args.create_engine_config().model_config.get_diff_sampling_param()

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7}))
    assert defaults(str(folder)) == {"temperature": 0.25, "top_k": 7}
    assert defaults("vllm") == {}
    model_own = json.loads((Path(tiny_llama_dir) / "generation_config.json").read_text())
    auto = defaults("auto")
    assert all(model_own[k] == v for k, v in auto.items() if k in model_own)
    with pytest.raises(ValueError, match="generation_config"):
        defaults(str(tmp_path))  # a folder without the file
