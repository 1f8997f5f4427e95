"""A tiny checkpoint trained (`pagedllm.testing.copy_model.train_format_model`) to answer as
Qwen3 does with tools: think between `<think>` and `</think>`, then either call `get_weather`
in the hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`) or reply in
text. Prompts are rendered by the demo chat template with the tools, as the server renders
them, so the served model sees exactly what it was trained on."""

from __future__ import annotations

import json
import random

from pagedllm.testing.demo_model import THINK_AND_TOOL_TOKENS

CITIES = ["Paris", "Tokyo", "London", "Ottawa"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": CITIES}},
                "required": ["city"],
            },
        },
    }
]
GREETINGS = ["Hello!", "Good morning.", "Hi there."]
REPLY = "Hello! How can I help?"
MODEL_KWARGS = dict(preset="tiny", added_tokens=THINK_AND_TOOL_TOKENS)


def weather_question(city: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"}]


def tool_call_text(city: str) -> str:
    call = {"name": "get_weather", "arguments": {"city": city}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def thought(city: str | None) -> str:
    about = f"the weather in {city}" if city else "nothing, a greeting"
    return f"<think>\nThe user asks about {about}.\n</think>\n\n"


def after_tool_result(city: str) -> list[dict]:
    """A conversation whose last turn is the weather tool's answer."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
    }
    return weather_question(city) + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip


def make_example(tokenizer):
    """`make_example(rng) -> (prompt, completion)` for train_format_model."""

    def render(messages: list[dict], thinking: bool) -> str:
        extra = {} if thinking else {"enable_thinking": False}
        return tokenizer.apply_chat_template(
            messages, tools=TOOLS, add_generation_prompt=True, tokenize=False, **extra
        )

    def example(rng: random.Random) -> tuple[str, str]:
        city, thinking, kind = rng.choice(CITIES), rng.random() < 0.7, rng.random()
        if kind < 0.5:
            messages, answer = weather_question(city), tool_call_text(city)
            think = thought(city)
        elif kind < 0.75:
            messages, answer = after_tool_result(city), f"It is sunny in {city}."
            think = thought(city)
        else:
            messages, answer = [{"role": "user", "content": rng.choice(GREETINGS)}], REPLY
            think = thought(None)
        return render(messages, thinking), (think if thinking else "") + answer + "<|end|>"

    return example
