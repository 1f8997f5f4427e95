"""Tool calling, reasoning output and the Responses API end to end, through the official
`openai` client and LangChain, against one live `pagedllm serve` of a tiny checkpoint trained
(tests/entrypoints/tool_model.py, ~40 s once per session) to think in `<think>` blocks and call
`get_weather` in the hermes format, served with `--enable-auto-tool-choice
--tool-call-parser hermes --reasoning-parser qwen3`. Every streamed chunk and event must
validate strictly as the SDK's type."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagedllm.testing.copy_model import train_format_model
from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS, build_tokenizer
from tests.entrypoints.conftest import API_KEY, RemoteServer, stream_chat_chunks
from tests.entrypoints.tool_model import (
    CITIES,
    MODEL_KWARGS,
    REPLY,
    TOOLS,
    after_tool_result,
    make_example,
    weather_question,
)

MODEL = "tool-model"
SERVER_ARGS = [
    "--served-model-name", MODEL,
    "--dtype", "float32",
    "--max-num-seqs", "8",
    "--kv-cache-memory", str(4 << 20),
    "--api-key", API_KEY,
    "--enable-auto-tool-choice",
    "--tool-call-parser", "hermes",
    "--reasoning-parser", "qwen3",
]  # fmt: skip
WEATHER_SCHEMA = TOOLS[0]["function"]["parameters"]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> str:
    tokenizer = build_tokenizer(512, added_tokens=THINK_AND_TOOL_TOKENS)
    path = tmp_path_factory.mktemp("tool-model")
    path, loss = train_format_model(
        path, make_example(tokenizer), steps=150, batch_size=8, lr=5e-3, **MODEL_KWARGS
    )
    assert loss < 0.1, loss
    return path


@pytest.fixture(scope="module")
def server(tool_model_dir):
    with RemoteServer(tool_model_dir, SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=80, temperature=0.0, **kwargs
    )


def assemble(chunks: list) -> dict:
    """A stream's reasoning, content, calls (name, arguments) and finish reason."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None}
    for chunk in chunks:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            delta = choice.delta
            out["reasoning"] += (delta.model_extra or {}).get("reasoning_content") or ""
            out["content"] += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.type == "function" and tc.function.arguments == ""
                    out["calls"][tc.index] = [tc.function.name, ""]
                else:
                    out["calls"][tc.index][1] += tc.function.arguments
            out["finish"] = choice.finish_reason or out["finish"]
    out["calls"] = [tuple(c) for c in out["calls"].values()]
    return out


def test_auto_tool_call_with_reasoning(server, client):
    out = chat(client, weather_question("Paris"))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert "weather in" in message.model_extra["reasoning_content"]
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"]
    assert "<think>" not in (message.content or "") and "<tool_call>" not in (message.content or "")
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    body = {"model": MODEL, "messages": weather_question("Paris"), "tools": TOOLS,
            "max_tokens": 80, "temperature": 0.0, "stream": True}  # fmt: skip
    streamed = assemble(stream_chat_chunks(server.url, body))
    assert streamed == {
        "reasoning": message.model_extra["reasoning_content"],
        "content": message.content or "",
        "calls": [(call.function.name, call.function.arguments)],
        "finish": "tool_calls",
    }


def test_auto_plain_reply_and_tool_results_in_history(client):
    out = chat(client, [{"role": "user", "content": "Hello!"}])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content.strip() == REPLY
    assert not out.choices[0].message.tool_calls
    # The tool's answer (a `tool` message after an assistant tool call) reaches the template.
    out = chat(client, after_tool_result("London"))
    assert out.choices[0].message.content.strip() == "It is sunny in London."


def test_enable_thinking_false_reaches_the_template(client):
    out = chat(client, weather_question("Tokyo"), extra_body=NO_THINKING)
    message = out.choices[0].message
    assert message.model_extra["reasoning_content"] is None
    assert message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments)["city"] in CITIES


def test_reasoning_effort_reaches_the_template(client):
    """`reasoning_effort` (the SDK's own argument) as vLLM passes it: "none" turns thinking
    off, any other effort on; the request's own chat_template_kwargs win."""
    off = chat(client, weather_question("Tokyo"), reasoning_effort="none").choices[0].message
    assert off.model_extra["reasoning_content"] is None
    assert off.tool_calls[0].function.name == "get_weather"
    on = chat(client, weather_question("Tokyo"), reasoning_effort="low").choices[0].message
    assert "weather in" in on.model_extra["reasoning_content"]
    both = (
        chat(
            client,
            weather_question("Tokyo"),
            reasoning_effort="none",
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        .choices[0]
        .message
    )
    assert both.model_extra["reasoning_content"] == on.model_extra["reasoning_content"]
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat(client, weather_question("Tokyo"), reasoning_effort="extreme")


def test_structured_output_starts_after_the_reasoning(client):
    schema = {"type": "object", "properties": {"city": {"enum": CITIES}}, "required": ["city"]}
    # The trained model would call the tool here; "none" leaves the schema to decide.
    out = chat(
        client,
        weather_question("Paris"),
        tool_choice="none",
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    message = out.choices[0].message
    assert "weather in" in message.model_extra["reasoning_content"]  # thought freely
    jsonschema.validate(json.loads(message.content), schema)  # then followed the schema


def test_named_and_required_choices_on_the_trained_model(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    # A greeting: the model would not call a tool, but the constraint makes it. (Without
    # parallel_tool_calls=false this model goes on adding calls to the array.)
    for choice in (named, "required"):
        out = chat(
            client,
            [{"role": "user", "content": "Hello!"}],
            tool_choice=choice,
            parallel_tool_calls=False,
        )
        [call] = out.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
        assert out.choices[0].finish_reason == "tool_calls"


def test_langchain_bind_tools_and_structured_output(server):
    from typing import Literal

    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0, max_tokens=80
    )
    reply = llm.bind_tools(TOOLS).invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in CITIES

    class Weather(BaseModel):
        """Weather in a city"""

        city: Literal["Paris", "Tokyo", "London", "Ottawa"]

    # Thinking off: on an untrained request shape the tiny model's reasoning (free text,
    # before the forced call's grammar applies) can ramble past max_tokens.
    quiet = ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=0,
        max_tokens=80, extra_body=NO_THINKING,
    )  # fmt: skip
    structured = quiet.with_structured_output(Weather, method="function_calling")
    assert structured.invoke("What is the weather in Tokyo?").city in CITIES


def test_responses_api_tools_reasoning_and_stream(server, client):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    out = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=tools, max_output_tokens=80,
        temperature=0.0,
    )  # fmt: skip
    Response.model_validate(out.model_dump(), strict=True)
    assert out.status == "completed"
    kinds = [item.type for item in out.output]
    assert kinds[0] == "reasoning" and kinds[-1] == "function_call"
    call = out.output[-1]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert out.usage.output_tokens_details.reasoning_tokens > 0
    # The call's result goes back as a function_call_output item.
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in London?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": '{"city": "London"}'},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
        tools=tools, max_output_tokens=80, temperature=0.0,
    )  # fmt: skip
    assert follow.output_text.strip() == "It is sunny in London."
    events = list(
        client.responses.create(
            model=MODEL, input="What is the weather in Paris?", tools=tools,
            max_output_tokens=80, temperature=0.0, stream=True,
        )
    )  # fmt: skip
    for event in events:
        EVENTS.validate_python(event.model_dump(), strict=True)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert [i.type for i in final.output] == kinds
    assert final.output[-1].arguments == call.arguments
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert arguments == call.arguments
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == out.output[0].content[0].text


def test_responses_api_reasoning_effort(client):
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    out = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=tools, max_output_tokens=80,
        temperature=0.0, reasoning={"effort": "none"},
    )  # fmt: skip
    assert [item.type for item in out.output] == ["function_call"]
    assert out.reasoning.effort == "none"
    with pytest.raises(openai.BadRequestError, match="reasoning.summary"):
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=8, reasoning={"summary": "auto"}
        )
