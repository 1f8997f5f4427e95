"""Ctrl-C in the terminal running `pagedllm serve`: SIGINT reaches the whole process group
(the API server and its engine core at once). The server stops cleanly and its log reports
no engine death and no error: the engine was stopped, it did not fail. With
`--api-server-count 2` the API server processes see their engine stop too, and say nothing
of a death either."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer


@pytest.mark.parametrize("extra", [[], ["--api-server-count", "2"]], ids=["one", "two-servers"])
def test_ctrl_c_stops_quietly(tiny_llama_dir, extra):
    args = ["--max-model-len", "128", *extra]
    with RemoteServer(tiny_llama_dir, args, own_group=True) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        os.killpg(server.proc.pid, signal.SIGINT)
        server.proc.wait(timeout=60)
        log = server.logs()
    for alarm in ("Traceback", "ERROR", "is dead", "fatal error"):
        assert alarm not in log, log
