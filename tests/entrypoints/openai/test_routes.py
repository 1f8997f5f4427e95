"""Routes besides the API itself, on an app without an engine (the lifespan never runs):
- aiperf checks `/metrics` with HEAD before it scrapes it with GET, and vLLM's `/metrics`
  (prometheus_client's ASGI app, mounted) answers both;
- `GET /tokenizer_info`, vLLM's opt-in route (--enable-tokenizer-info-endpoint): lm-eval's
  `tokenizer_backend=remote` reads the eos/bos tokens and the chat template from it (and
  tokenizes through /tokenize). Without the flag the route does not exist (404), as in vLLM."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.entrypoints.openai.cli_args import make_arg_parser
from pagedllm.entrypoints.openai.serving_engine import ServingOptions
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

EXPOSITION = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _client(flags: list[str] = (), tokenizer=None, chat_template: str | None = None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="unused")
    make_arg_parser(parser)
    app = build_app(parser.parse_args(list(flags)))
    app.state.engine = SimpleNamespace(
        errored=False, stalled_engines={}, prometheus=SimpleNamespace(render=lambda: EXPOSITION)
    )
    handler = OpenAIServingTokenization.__new__(OpenAIServingTokenization)
    handler.tokenizer = tokenizer
    handler.options = ServingOptions(chat_template=chat_template)
    app.state.serving_tokenization = handler
    return TestClient(app)


def test_metrics_answers_head_and_get():
    client = _client()
    get = client.get("/metrics")
    assert get.status_code == 200 and get.content == EXPOSITION
    assert get.headers["content-type"].startswith("text/plain")
    head = client.head("/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]


def test_tokenizer_info_is_opt_in_and_serves_what_lm_eval_reads(tiny_llama_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert _client([], tokenizer).get("/tokenizer_info").status_code == 404

    info = _client(["--enable-tokenizer-info-endpoint"], tokenizer).get("/tokenizer_info")
    assert info.status_code == 200, info.text
    body = info.json()
    assert body["tokenizer_class"] == type(tokenizer).__name__
    assert body["eos_token"] == tokenizer.eos_token
    assert body["bos_token"] == tokenizer.bos_token
    json.dumps(body)  # plain JSON throughout (no AddedToken reprs leaking as objects)

    # The template the server renders with: --chat-template wins over the tokenizer's.
    served = _client(["--enable-tokenizer-info-endpoint"], tokenizer, TEMPLATE)
    assert served.get("/tokenizer_info").json()["chat_template"] == TEMPLATE
