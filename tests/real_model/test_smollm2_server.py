"""`pagedllm serve SmolLM2-135M-Instruct.Q4_1.gguf`: the original quantized file served
directly, used through the official `openai` client (one server for the module)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.entrypoints.conftest import RemoteServer
from tests.real_model.conftest import PARIS_QUESTION
from tests.real_model.test_smollm2 import CAPITAL_SCHEMA

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def client(smollm2_gguf):
    args = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "1024"]
    args += ["--kv-cache-memory", str(64 << 20), "--seed", "0"]
    with RemoteServer(smollm2_gguf, args) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _ask(client, **kwargs):
    messages = [{"role": "user", "content": PARIS_QUESTION}]
    return client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=32, **kwargs
    )


def test_chat_answers_in_english(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = _ask(client)
    choice = out.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    # Streamed, the same answer arrives in pieces.
    stream = _ask(client, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2 and "".join(pieces) == choice.message.content


def test_json_schema_response_format(client):
    messages = [
        {
            "role": "user",
            "content": "Give the capital of France as JSON with keys country and capital.",
        }
    ]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        temperature=0.0,
        max_tokens=48,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA, "strict": True},
        },
    )
    value = json.loads(out.choices[0].message.content)
    jsonschema.validate(value, CAPITAL_SCHEMA)
    assert value["capital"] == "Paris"


def test_completion_stop_string(client):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0.0, stop=["."]
    )
    choice = out.choices[0]
    assert choice.text.strip() == "Paris" and choice.finish_reason == "stop"
