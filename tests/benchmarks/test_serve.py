"""`bench serve` pieces: the gamma arrival process, the streaming client's timings against a
fake server with known chunk delays, and the printed result block."""

from __future__ import annotations

import argparse
import asyncio
import json

import numpy as np
import pytest

from pagedllm.benchmarks import serve
from pagedllm.benchmarks.metrics import RequestFuncOutput, calculate_metrics
from pagedllm.entrypoints.cli.main import main as cli_main


def _gaps(n: int, rate: float, burstiness: float) -> list[float]:
    """The sleeps `arrivals` asks for, with asyncio.sleep replaced by a recorder."""
    slept: list[float] = []

    async def fake_sleep(s: float) -> None:
        slept.append(s)

    async def drain() -> list[int]:
        rng = np.random.default_rng(0)
        return [x async for x in serve.arrivals(list(range(n)), rate, burstiness, rng)]

    real_sleep = serve.asyncio.sleep
    serve.asyncio.sleep = fake_sleep
    try:
        items = asyncio.run(drain())
    finally:
        serve.asyncio.sleep = real_sleep
    assert items == list(range(n))
    return slept


def test_infinite_rate_sends_at_once():
    assert _gaps(50, float("inf"), 1.0) == []


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_arrivals_mean_rate_and_burstiness(burstiness):
    gaps = np.array(_gaps(4001, rate=10.0, burstiness=burstiness))
    assert len(gaps) == 4000
    # Mean gap 1 / rate whatever the burstiness; squared coefficient of variation 1 / shape.
    assert gaps.mean() == pytest.approx(0.1, rel=0.08)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1.0 / burstiness, rel=0.15)


def _input(fake, prompt, n: int, chat: bool = False) -> serve.RequestInput:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    return serve.RequestInput(fake.url + endpoint, "m", prompt, prompt_len=3, output_len=n)


async def _send(fake, prompt, n: int, chat: bool = False) -> RequestFuncOutput:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        return await serve.send_request(client, _input(fake, prompt, n, chat), chat)


@pytest.mark.parametrize("chat", [False, True])
def test_client_timings_against_known_chunks(fake_server, chat):
    out = asyncio.run(_send(fake_server, "hi" if chat else [5, 6, 7], 6, chat))
    assert out.success, out.error
    assert out.output_tokens == 6  # from the usage chunk
    assert out.generated_text == "x" * 6
    assert len(out.itl) == 5  # one gap per chunk after the first
    assert out.ttft >= fake_server.first_s
    # The gaps tile the time after the first token exactly. The server spaces chunks 20 ms
    # apart; a first chunk read late (a loaded machine) shortens the measured span by that
    # delay, so the bound only checks that the gaps are the server's, not zeros.
    assert sum(out.itl) == pytest.approx(out.latency - out.ttft)
    assert out.latency - out.ttft >= 2 * fake_server.gap_s
    body = fake_server.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body
    if chat:
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert body["max_completion_tokens"] == 6
    else:
        assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 6


def test_client_reports_http_errors(fake_server):
    out = asyncio.run(_send(fake_server, [0], 3))
    assert not out.success
    assert "HTTP 400" in out.error and "bad prompt" in out.error


def _args(**overrides) -> argparse.Namespace:
    base = dict(max_concurrency=None, request_rate=float("inf"))
    base.update(overrides)
    return argparse.Namespace(**base)


def test_result_block_format():
    outputs = [
        RequestFuncOutput(True, 10, 5, ttft=0.1, latency=0.5, itl=[0.1] * 4),
        RequestFuncOutput(True, 20, 4, ttft=0.3, latency=0.9, itl=[0.2] * 3),
    ]
    metrics = calculate_metrics(outputs, 2.0, [50, 99.9], {"ttft": 200})
    lines, result = serve.format_results(
        metrics, 2.0, _args(max_concurrency=4, request_rate=3.0), ["ttft", "itl"], goodput=True
    )
    assert lines[0] == "=" * 12 + " Serving Benchmark Result " + "=" * 12
    assert lines[-1] == "=" * 50
    text = "\n".join(lines)
    for expected in (
        "Successful requests:                     2",
        "Maximum request concurrency:             4",
        "Request rate configured (RPS):           3.00",
        "Benchmark duration (s):                  2.00",
        "Total input tokens:                      30",
        "Total generated tokens:                  9",
        "Request throughput (req/s):              1.00",
        "Request goodput (req/s):                 0.50",
        "Output token throughput (tok/s):         4.50",
        "Total Token throughput (tok/s):          19.50",
        "---------------Time to First Token----------------",
        "Mean TTFT (ms):                          200.00",
        "Median TTFT (ms):                        200.00",
        "P99.9 TTFT (ms):",
        "Mean ITL (ms):                           142.86",
    ):
        assert expected in text
    assert "TPOT" not in text  # not selected
    assert result["p50_ttft_ms"] == pytest.approx(200.0)
    assert result["request_goodput"] == pytest.approx(0.5)
    assert "mean_tpot_ms" not in result


def test_bench_serve_cli_end_to_end(fake_server, tmp_path, capsys):
    path = tmp_path / "serve.json"
    rc = cli_main(
        ["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "6",
         "--input-len", "8", "--output-len", "4", "--max-concurrency", "3",
         "--goodput", "ttft:60000", "tpot:60000", "--percentile-metrics", "ttft,tpot,itl,e2el",
         "--metric-percentiles", "50,99", "--ignore-eos", "--output-json", str(path),
         "--disable-tqdm"]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in text
    assert "Successful requests:                     6" in text
    assert "Total input tokens:                      48" in text
    assert "Total generated tokens:                  24" in text
    for line in ("Mean TPOT (ms):", "P99 ITL (ms):", "Median E2EL (ms):", "Request goodput"):
        assert line in text
    result = json.loads(path.read_text())
    assert result["completed"] == 6 and result["total_output_tokens"] == 24
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["model_id"] == fake_server.model_id  # found through /v1/models
    assert result["request_rate"] == "inf"
    assert len(result["itls"]) == 6 and all(len(g) == 3 for g in result["itls"])
    assert result["mean_tpot_ms"] >= fake_server.gap_s * 1000 * 0.95
    sent = fake_server.bodies[-6:]
    assert all(b["ignore_eos"] is True and len(b["prompt"]) == 8 for b in sent)


def test_bench_serve_api_key_and_save_result(fake_server, tmp_path, monkeypatch, capsys):
    """--api-key (or $OPENAI_API_KEY) reaches every request; --save-result writes vLLM's file
    name in --result-dir, per-request fields only with --save-detailed."""
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    args = ["bench", "serve", "--base-url", fake_server.url, "--num-prompts", "2",
            "--input-len", "4", "--output-len", "2", "--disable-tqdm", "--save-result",
            "--result-dir", str(tmp_path), "--metadata", "run=a", "--max-concurrency", "2"]  # fmt: skip
    seen = len(fake_server.authorizations)
    assert cli_main(args) == 0
    assert set(fake_server.authorizations[seen:]) == {"Bearer from-env"}
    (path,) = tmp_path.glob("pagedllm-infqps-concurrency2-*.json")
    result = json.loads(path.read_text())
    assert result["completed"] == 2 and result["run"] == "a" and "ttfts" not in result
    seen = len(fake_server.authorizations)
    detailed = tmp_path / "d.json"
    rc = cli_main([*args, "--api-key", "flag", "--save-detailed", "--result-filename", "d.json"])
    assert rc == 0
    assert set(fake_server.authorizations[seen:]) == {"Bearer flag"}
    assert len(json.loads(detailed.read_text())["ttfts"]) == 2
    capsys.readouterr()


def test_bench_serve_chat_sends_text(fake_server, capsys):
    rc = cli_main(
        ["bench", "serve", "--base-url", fake_server.url, "--endpoint", "/v1/chat/completions",
         "--model", fake_server.model_id, "--num-prompts", "2", "--input-len", "4",
         "--output-len", "3", "--disable-tqdm"]
    )  # fmt: skip
    assert rc == 0
    assert "Total generated tokens:                  6" in capsys.readouterr().out
    sent = fake_server.bodies[-2:]
    assert all(isinstance(b["messages"][0]["content"], str) for b in sent)
    assert all(b["max_completion_tokens"] == 3 for b in sent)


def test_bench_serve_fails_fast_without_a_server(tiny_model_dir, capsys):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = cli_main(
        ["bench", "serve", "--port", str(port), "--model", tiny_model_dir,
         "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    )  # fmt: skip
    assert rc == 2  # a ValueError, reported on stderr
    assert "initial test request failed" in capsys.readouterr().err


def test_bench_serve_without_model_names_an_unreachable_server(capsys):
    """Without --model the first call lists the server's models: no server there is a clear
    error (exit status 2), not a traceback."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli_main(["bench", "serve", "--port", str(port), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach a server at http://127.0.0.1:{port}" in err and "Traceback" not in err


def test_bench_serve_without_model_reports_the_models_listing_status(fake_server, capsys):
    argv = ["bench", "serve", "--base-url", fake_server.url + "/nowhere", "--num-prompts", "2"]
    assert cli_main(argv) == 2
    assert "/nowhere/v1/models answered HTTP 404" in capsys.readouterr().err


@pytest.fixture(scope="module")
def live_server(tiny_model_dir):
    """`pagedllm serve` on the tiny model, on a free port (skipped if the server is absent)."""
    import socket
    import subprocess
    import sys
    import time

    import httpx

    pytest.importorskip("pagedllm.entrypoints.cli.serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli.main", "serve", tiny_model_dir,
           "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", str(4 << 20)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pagedllm serve exited early: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("pagedllm serve did not become healthy in 180 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_bench_serve_against_live_server(live_server, tiny_model_dir, tmp_path, capsys):
    path = tmp_path / "live.json"
    rc = cli_main(
        ["bench", "serve", "--base-url", live_server, "--model", tiny_model_dir,
         "--num-prompts", "8", "--input-len", "16", "--output-len", "6", "--prefix-len", "16",
         "--ignore-eos", "--request-rate", "40", "--burstiness", "0.5",
         "--output-json", str(path), "--disable-tqdm"]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "Successful requests:                     8" in text
    assert "Total input tokens:                      256" in text
    assert "Total generated tokens:                  48" in text  # EOS ignored: exact
    result = json.loads(path.read_text())
    assert result["output_lens"] == [6] * 8
    assert all(e == "" for e in result["errors"])
    assert 0 < result["mean_ttft_ms"] and 0 < result["mean_tpot_ms"]


def _bench(fake_server, *flags: str, n: int = 3) -> int:
    argv = ["bench", "serve", "--base-url", fake_server.url, "--num-prompts", str(n),
            "--input-len", "4", "--output-len", "2", "--disable-tqdm", *flags]  # fmt: skip
    return cli_main(argv)


def test_bench_serve_backend_names_the_endpoint(fake_server, capsys):
    """vLLM's --backend: openai-chat sends chat messages, vllm / openai completions; a
    --backend that contradicts --endpoint is an error naming both."""
    assert _bench(fake_server, "--backend", "openai-chat", n=2) == 0
    assert all("messages" in b for b in fake_server.bodies[-2:])
    assert _bench(fake_server, "--backend", "vllm", n=2) == 0
    assert all("prompt" in b for b in fake_server.bodies[-2:])
    capsys.readouterr()
    argv = ["--backend", "openai-chat", "--endpoint", "/v1/completions"]
    assert _bench(fake_server, *argv) == 2
    assert "--backend openai-chat sends to /v1/chat/completions" in capsys.readouterr().err


def test_bench_serve_sampling_flags_extra_body_and_headers(fake_server, capsys):
    """vLLM's sampling flags and --extra-body reach every body (and nothing unasked does);
    --header every request; --request-id-prefix the measured requests as X-Request-Id."""
    assert _bench(fake_server, n=2) == 0
    assert not {"top_p", "top_k", "min_p", "min_tokens"} & set(fake_server.bodies[-1])
    flags = ["--top-p", "0.9", "--top-k", "5", "--min-p", "0.1", "--frequency-penalty", "0.5",
             "--presence-penalty", "0.2", "--repetition-penalty", "1.1",
             "--extra-body", '{"min_tokens": 2, "top_k": 7}', "--header", "X-A=1", "X-B=two",
             "--request-id-prefix", "run1-"]  # fmt: skip
    seen = len(fake_server.bodies)
    assert _bench(fake_server, *flags, n=3) == 0
    bodies, headers = fake_server.bodies[seen:], fake_server.headers[seen:]
    assert len(bodies) == 4  # the test request, then the three measured
    for body in bodies:
        assert body["top_p"] == 0.9 and body["min_p"] == 0.1 and body["min_tokens"] == 2
        assert body["top_k"] == 7  # --extra-body wins
        assert body["frequency_penalty"] == 0.5 and body["presence_penalty"] == 0.2
        assert body["repetition_penalty"] == 1.1
    assert all(h["x-a"] == "1" and h["x-b"] == "two" for h in headers)
    assert "x-request-id" not in headers[0]  # the test request reuses request 0's input
    assert sorted(h["x-request-id"] for h in headers[1:]) == ["run1-0", "run1-1", "run1-2"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:  # argparse's usage error
        _bench(fake_server, "--extra-body", "[1]")
    assert exit_info.value.code == 2
    assert "--extra-body: '[1]' is not a JSON object" in capsys.readouterr().err
    assert _bench(fake_server, "--header", "novalue") == 2
    assert "--header 'novalue' is not KEY=VALUE" in capsys.readouterr().err


def test_bench_serve_warmups_and_label(fake_server, tmp_path, capsys):
    """--num-warmups sends that many requests before the run, outside its figures; --label
    names the result's backend and file."""
    seen = len(fake_server.bodies)
    flags = ["--num-warmups", "4", "--save-result", "--result-dir", str(tmp_path),
             "--label", "mine"]  # fmt: skip
    assert _bench(fake_server, *flags, n=3) == 0
    assert len(fake_server.bodies) - seen == 1 + 4 + 3
    (path,) = tmp_path.glob("mine-infqps-*.json")
    result = json.loads(path.read_text())
    assert result["backend"] == "mine" and result["completed"] == 3
    capsys.readouterr()


def test_bench_serve_ready_check_waits_then_reports(capsys):
    """--ready-check-timeout-sec polls the server that long before the clear error."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    argv = ["bench", "serve", "--port", str(port), "--num-prompts", "2",
            "--ready-check-timeout-sec", "1.5"]  # fmt: skip
    assert cli_main(argv) == 2
    assert time.monotonic() - start >= 1.4
    captured = capsys.readouterr()
    assert "Waiting up to 1.5 s" in captured.out
    assert f"cannot reach a server at http://127.0.0.1:{port}" in captured.err
