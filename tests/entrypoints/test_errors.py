"""errors.py: the real app's middleware and handlers answer an unexpected error with a 500 in
OpenAI's shape that names a request id, and log the traceback under that id only."""

from __future__ import annotations

import argparse
import asyncio
import logging

import httpx

from pagedllm.entrypoints.openai.api_server import build_app


def _get(app, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def run() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(run())


def test_unexpected_error_is_a_500_whose_details_stay_in_the_log(caplog):
    # Without its lifespan the app has no engine: /v1/models fails in a way no handler expects.
    app = build_app(argparse.Namespace())
    with caplog.at_level(logging.ERROR, logger="pagedllm.entrypoints.openai.errors"):
        r = _get(app, "/v1/models", {"X-Request-Id": "req-42"})
    assert r.status_code == 500
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500
    assert "req-42" in error["message"] and error["type"] == "InternalServerError"
    assert "Traceback" not in r.text and "AttributeError" not in r.text
    assert "req-42" in caplog.text and "AttributeError" in caplog.text
    assert caplog.records[-1].exc_info is not None  # the traceback, in the log

    # Without X-Request-Id the server makes one up, and the log has the same one.
    r = _get(app, "/v1/models")
    generated = r.json()["error"]["message"].split("request id ")[1].split(")")[0]
    assert generated and generated in caplog.records[-1].getMessage()
