"""Routes that benchmark clients probe besides the API itself, on an app without an engine
(the lifespan never runs): aiperf checks `/metrics` with HEAD before it scrapes it with GET,
and vLLM's `/metrics` (prometheus_client's ASGI app, mounted) answers both."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from fastapi.testclient import TestClient

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import make_arg_parser

EXPOSITION = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"


def _client() -> TestClient:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="unused")
    make_arg_parser(parser)
    app = build_app(parser.parse_args([]))
    app.state.engine = SimpleNamespace(
        errored=False, stalled_engines={}, prometheus=SimpleNamespace(render=lambda: EXPOSITION)
    )
    return TestClient(app)


def test_metrics_answers_head_and_get():
    client = _client()
    get = client.get("/metrics")
    assert get.status_code == 200 and get.content == EXPOSITION
    assert get.headers["content-type"].startswith("text/plain")
    head = client.head("/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
