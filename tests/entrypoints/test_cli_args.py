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


def test_override_generation_config_merges_over_each_mode(tiny_llama_dir, tmp_path):
    """--override-generation-config (vLLM's): its keys win over the generation config's, in
    every --generation-config mode; anything but a JSON object is refused."""

    def defaults(generation_config: str, override: dict | None) -> dict:
        args = EngineArgs(
            model=tiny_llama_dir,
            device="cpu",
            generation_config=generation_config,
            override_generation_config=override,
        )
        return args.create_engine_config().model_config.get_diff_sampling_param()

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.25, "top_k": 7}))
    assert defaults(str(folder), {"temperature": 0.5}) == {"temperature": 0.5, "top_k": 7}
    assert defaults("vllm", {"top_p": 0.9}) == {"top_p": 0.9}
    assert defaults("auto", {"min_p": 0.05})["min_p"] == 0.05
    args = _parser().parse_args(["--override-generation-config", '{"temperature": 0.1}'])
    assert args.override_generation_config == {"temperature": 0.1}
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        _parser().parse_args(["--override-generation-config", "[0.1]"])


@pytest.mark.parametrize("value", ["fp8_inc", "fp8_ds_mla", "float16", "int8"])
def test_kv_cache_dtype_other_than_the_models_or_fp8_is_refused_by_name(tiny_llama_dir, value):
    """The cache is kept in the model's dtype ("auto" or that dtype's name) or in fp8; any
    other kv_cache_dtype is an error naming it, never ignored."""
    args = EngineArgs(model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_dtype=value)
    with pytest.raises(ValueError, match=f"kv_cache_dtype='{value}' is not supported"):
        args.create_engine_config()
    for ok, dtype in [("auto", "float32"), ("float32", "float32"), ("fp8", "float8_e4m3fn")]:
        config = EngineArgs(
            model=tiny_llama_dir, device="cpu", dtype="float32", kv_cache_dtype=ok
        ).create_engine_config()
        assert str(config.model_config.dtype) == "torch.float32"
        assert str(config.kv_cache_torch_dtype) == f"torch.{dtype}"


def test_kv_cache_dtype_flag(tiny_llama_dir):
    """`pagedllm serve --kv-cache-dtype fp8_e5m2` reaches the engine config as vLLM's string."""
    cli = ["--model", tiny_llama_dir, "--kv-cache-dtype", "fp8_e5m2", "--device", "cpu"]
    args = _parser().parse_args(cli)
    assert args.kv_cache_dtype == "fp8_e5m2"
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.cache_config.cache_dtype == "fp8_e5m2"
    assert str(config.kv_cache_torch_dtype) == "torch.float8_e5m2"
    assert _parser().parse_args(["--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"


def test_log_output_flags_are_checked():
    from pagedllm.entrypoints.openai.serving_engine import ServingOptions

    args = _parser().parse_args(["--enable-log-outputs", "--max-log-len", "0"])
    with pytest.raises(ValueError, match="--enable-log-outputs needs --enable-log-requests"):
        ServingOptions.from_args(args)
    args = _parser().parse_args(["--enable-log-outputs", "--enable-log-requests"])
    assert ServingOptions.from_args(args).enable_log_outputs
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["--max-log-len", bad])


def test_a_repeatable_flag_from_a_config_file(tmp_path):
    args = _parse(tmp_path, "middleware: [m.A, m.b]\nuds: /tmp/s.sock\n", [])
    assert args.middleware == ["m.A", "m.b"] and args.uds == "/tmp/s.sock"
    assert _parse(tmp_path, "middleware: [m.A]\n", ["--middleware", "m.C"]).middleware == [
        "m.A",
        "m.C",
    ]


def test_shutdown_timeout_is_the_graceful_shutdown_time():
    assert _parser().parse_args(["--shutdown-timeout", "0"]).timeout_graceful_shutdown == 0
    assert _parser().parse_args([]).timeout_graceful_shutdown == 10.0
