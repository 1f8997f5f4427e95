"""`pagedllm tune`: the SLO grammar and its errors, the choice of the best point, the report
and plot of every configuration (no configuration meeting an impossible SLO included), and a
short real sweep on the tiny checkpoint whose chosen `--config` meets the SLO again when a
fresh `pagedllm serve --config` is measured."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from pagedllm.benchmarks.tune_report import (
    Point,
    SLOTerm,
    best_point,
    config_label,
    markdown_report,
    parse_slo,
    plot_frontier,
)
from pagedllm.entrypoints.cli.main import main as cli_main

# Loose enough to be met on a 2-core machine other jobs load; the tiny model's requests take
# tens to hundreds of milliseconds.
LOOSE_SLO = "ttft_p99<=30s,tpot_p99<=5s"


def test_parse_slo():
    terms = parse_slo("ttft_p99<=500ms, tpot_p99.0<0.05s,e2el_median<=2s,itl_mean<=40")
    assert terms == [
        SLOTerm("ttft", "p99", 500.0),
        SLOTerm("tpot", "p99", 50.0),
        SLOTerm("e2el", "median", 2000.0),
        SLOTerm("itl", "mean", 40.0),
    ]
    assert terms[0].key == "p99_ttft_ms" and terms[0].percentile == 99.0


@pytest.mark.parametrize(
    "text, named, why",
    [
        ("ttft_p99<=500ms,tpot_p99<=5xs", "tpot_p99<=5xs", "unknown unit"),
        ("latency_p99<=5ms", "latency_p99<=5ms", "unknown metric"),
        ("ttft_p200<=5ms", "ttft_p200<=5ms", "outside"),
        ("ttft_q99<=5ms", "ttft_q99<=5ms", "unknown statistic"),
        ("ttft_p99>=5ms", "ttft_p99>=5ms", "METRIC_STAT<=LIMIT"),
        ("ttft_p99<=0ms", "ttft_p99<=0ms", "positive"),
        ("ttft_p99<=1..2ms", "ttft_p99<=1..2ms", "not a number"),
    ],
)
def test_bad_slo_terms_are_named(text, named, why):
    with pytest.raises(ValueError) as info:
        parse_slo(text)
    assert repr(named) in str(info.value) and why in str(info.value)


def test_bad_slo_is_a_cli_error(capsys):
    assert cli_main(["tune", "--model", "x", "--slo", "ttft<=5ms"]) == 2
    assert "'ttft<=5ms'" in capsys.readouterr().err


def _point(seqs: int, rate: float, ttft: float, goodput: float) -> Point:
    config = {
        "max_num_seqs": seqs,
        "max_num_batched_tokens": 512,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
    }
    return Point(config, rate, 10, 0, 5.0, rate, goodput, 10 * rate, {"p99_ttft_ms": ttft})


def test_best_point_report_and_plot(tmp_path):
    terms = parse_slo("ttft_p99<=100ms")
    points = [
        _point(8, 1, 50, 1.0),
        _point(8, 2, 90, 1.9),
        _point(8, 4, 400, 2.5),  # the most goodput, but misses the SLO
        _point(32, 1, 40, 1.0),
        _point(32, 2, 60, 2.0),
    ]
    best = best_point(points, terms)
    assert best is points[4]
    drawn = plot_frontier(points, terms, best, str(tmp_path / "f.png"))
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == {
        config_label(points[0].config): [(10.0, 50), (20.0, 90), (40.0, 400)],
        config_label(points[3].config): [(10.0, 40), (20.0, 60)],
    }
    configs = [points[0].config, points[3].config]
    report = markdown_report("cmd", terms, points, best, configs, [], "grid done", 10, 60)
    assert "## Result: best configuration" in report
    assert "no: ttft_p99=400.0ms > 100ms" in report

    impossible = parse_slo("ttft_p99<=1ms")
    assert best_point(points, impossible) is None
    report = markdown_report("cmd", impossible, points, None, configs, [], "grid done", 10, 60)
    assert "## Result: no configuration met the SLO" in report
    assert report.count("| no: ttft_p99=") == len(points)


@pytest.mark.slow
def test_tune_finds_a_config_that_meets_the_slo_again(tiny_model_dir, tmp_path):
    from pagedllm.benchmarks.datasets import sample_random_requests
    from pagedllm.benchmarks.server_process import ServerProcess
    from pagedllm.benchmarks.tune import measure_point
    from pagedllm.benchmarks.tune_report import Point as P

    out = tmp_path / "tune"
    budget = 50.0
    serve_args = "--dtype float32 --kv-cache-memory-bytes 8M --max-model-len 256"
    argv = ["tune", "--model", tiny_model_dir, "--dataset", "random", "--slo", LOOSE_SLO]
    argv += ["--input-len", "16", "--output-len", "8", "--num-prompts", "6"]
    argv += ["--max-num-seqs", "2,16", "--max-num-batched-tokens", "64"]
    argv += ["--enable-chunked-prefill", "true", "--request-rates", "4,16"]
    argv += ["--time-budget-s", str(budget), "--serve-args", serve_args, "--output-dir", str(out)]
    start = time.monotonic()
    assert cli_main(argv) == 0
    assert time.monotonic() - start < budget + 15  # the budget, plus the start-up before it

    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    tried = {config_label(p["config"]) for p in results["points"]}
    assert tried  # at least the first configuration was measured
    # The plot got every configuration tried, each with all its points.
    assert set(results["plotted"]) == tried
    assert sum(len(v) for v in results["plotted"].values()) == len(results["points"])
    for label in tried:
        assert f"- tried: `{label}`" in report
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same measurements against an impossible SLO: nothing is chosen, and the report says so.
    measured = [P(**p) for p in results["points"]]
    impossible = parse_slo("ttft_p99<=0.001ms")
    assert best_point(measured, impossible) is None
    text = markdown_report("cmd", impossible, measured, None, [], [], "grid done", 1, 1)
    assert "no configuration met the SLO" in text

    # The chosen configuration, served fresh from its YAML, meets the SLO again.
    best = P(**results["best"])
    terms = parse_slo(LOOSE_SLO)
    with ServerProcess(None, ["--config", str(out / "best_config.yaml")]) as server:
        models = httpx.get(f"{server.url}/v1/models").json()["data"]
        requests = sample_random_requests(6, 16, 8, vocab_size=500, seed=0)
        again = measure_point(
            server.url, models[0]["id"], requests, best.config, best.request_rate, terms
        )
    assert again.meets(terms), again.violations(terms)
    # The YAML holds the model and the chosen knobs.
    yaml_text = (out / "best_config.yaml").read_text()
    assert f"max_num_seqs: {best.config['max_num_seqs']}" in yaml_text
    assert Path(tiny_model_dir).name in yaml_text


@pytest.mark.slow
def test_a_server_that_does_not_start_ends_the_sweep_with_a_report(tiny_model_dir, tmp_path):
    out = tmp_path / "tune"
    argv = ["tune", "--model", tiny_model_dir, "--slo", LOOSE_SLO, "--num-prompts", "2"]
    argv += ["--max-num-seqs", "2,4", "--max-num-batched-tokens", "64"]
    argv += ["--enable-chunked-prefill", "true", "--serve-args", "--no-such-flag 1"]
    argv += ["--time-budget-s", "120", "--output-dir", str(out)]
    assert cli_main(argv) == 1
    report = (out / "report.md").read_text()
    assert "a server did not start" in report and "server-1.log" in report
    assert "## Result: no configuration met the SLO" in report
    assert report.count("- not tried (stopped: a server did not start") == 2
    assert not (out / "best_config.yaml").exists()
    assert "--no-such-flag" in (out / "server-1.log").read_text()


@pytest.mark.slow
def test_sigterm_stops_the_sweep_and_its_server(tiny_model_dir, tmp_path):
    """The tuner owns its servers: SIGTERM mid-benchmark unwinds like Ctrl-C, the server and
    its engine go with it, and the report is still written."""
    import signal
    import subprocess
    import sys

    from tests.entrypoints.conftest import cmdline, descendant_pids, pid_alive

    out = tmp_path / "tune"
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "tune"]
    cmd += ["--model", tiny_model_dir, "--slo", LOOSE_SLO, "--num-prompts", "200"]
    cmd += ["--input-len", "16", "--output-len", "8", "--request-rates", "0.5"]
    cmd += ["--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
    cmd += ["--enable-chunked-prefill", "true", "--time-budget-s", "600"]
    cmd += ["--serve-args", "--dtype float32 --max-model-len 256", "--output-dir", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        url = None
        while url is None and time.monotonic() < deadline:
            for pid in descendant_pids(proc.pid):
                seen.add(pid)
                line = cmdline(pid).split()
                if "serve" in line and "--port" in line:
                    url = f"http://127.0.0.1:{line[line.index('--port') + 1]}"
            time.sleep(0.2)
        assert url is not None, "the tuner started no server"
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        time.sleep(2.0)  # the benchmark is sending requests now
        seen.update(descendant_pids(proc.pid))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 1  # nothing measured, nothing chosen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 30
    while any(pid_alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in seen if pid_alive(p)]
    assert "(interrupted)" in (out / "report.md").read_text()
