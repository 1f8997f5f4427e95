"""Pydantic models of the Responses API (`POST /v1/responses`), text in and out: the request,
and its translation into the chat request the engine runs (`to_chat_request`).

`input` is a string or a list of items: messages (`role` + string or `input_text` /
`output_text` parts; `developer` is a system message), and, for tool use, `function_call` and
`function_call_output` items (an assistant message with `tool_calls` and a `tool` message).
`instructions` become a system message first. Fields of OpenAI's API that need state or
features pagedllm does not have (`previous_response_id`, `store`, `background`,
`conversation`, `include`, ...) are a 400 naming the field when set, and so is a field no
Responses API defines; vLLM's sampling extras (`CHAT_EXTRAS`) pass to the chat request.
`reasoning.effort` becomes the chat request's `reasoning_effort` and `text.format` its
`response_format`; their other keys (a reasoning summary, a verbosity) are refused by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

# Request fields that must stay unset (or at the value that means "off"): name -> that value.
UNSUPPORTED = {
    "previous_response_id": None,
    "conversation": None,
    "store": False,
    "background": False,
    "include": None,
    "prompt": None,
    "max_tool_calls": None,
    "top_logprobs": None,
    "truncation": "disabled",
}

# vLLM's sampling and template extras of its Responses request: they go to the chat request
# as they are, which checks them as its own.
CHAT_EXTRAS = (
    "min_p", "stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "skip_special_tokens", "include_stop_str_in_output",
    "include_reasoning", "cache_salt", "chat_template_kwargs", "structured_outputs",
)  # fmt: skip


class ResponsesFunctionTool(BaseModel):
    """A Responses function tool (flat: no `function` wrapper, unlike chat's)."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    seed: int | None = None
    request_id: str | None = None
    priority: int = 0

    def check_supported(self) -> None:
        """ValueError naming the first field set that pagedllm cannot honour, or the first
        field that no Responses API defines."""
        unknown = sorted((self.model_extra or {}).keys() - UNSUPPORTED.keys() - set(CHAT_EXTRAS))
        if unknown:
            raise ValueError(
                f"unknown field {unknown[0]!r}: pagedllm's Responses API accepts the fields it "
                "honours, and no others"
            )
        for name, off in UNSUPPORTED.items():
            value = getattr(self, name, off)
            if value != off and not (name == "include" and value == []):
                raise ValueError(
                    f"{name}={value!r} is not supported by pagedllm's Responses API "
                    f"(it keeps no stored responses and supports text and function tools)"
                )

    def to_chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (messages, tools, limits, format)."""
        self.check_supported()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": _messages(self.input, self.instructions),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "user": self.user,
            "prompt_cache_key": self.prompt_cache_key,
            "top_k": self.top_k,
            "seed": self.seed,
            "request_id": self.request_id,
            "priority": self.priority,
            "reasoning_effort": _only_key(
                "reasoning", self.reasoning, "effort", "the reasoning item carries the whole text"
            ),
        }
        chat.update((k, v) for k, v in (self.model_extra or {}).items() if k in CHAT_EXTRAS)
        if self.tools:
            chat["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        text_format = _only_key("text", self.text, "format", "pagedllm has no verbosity control")
        if text_format:
            chat["response_format"] = _chat_response_format(text_format)
        return ChatCompletionRequest.model_validate(chat)


def _only_key(field: str, value: dict[str, Any] | None, key: str, why: str) -> Any:
    """`value[key]` of an object field such as `reasoning` or `text` (None when absent); a
    ValueError naming any other key that is set (`why` pagedllm cannot honour it)."""
    for other, setting in (value or {}).items():
        if other != key and setting is not None:
            raise ValueError(
                f"{field}.{other}={setting!r} is not supported by pagedllm's Responses API "
                f"(only {field}.{key}: {why})"
            )
    return (value or {}).get(key)


def _chat_tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f"tool_choice={choice!r} is not supported (function tools only)")


def _chat_response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    kind = fmt.get("type")
    if kind == "json_schema":
        schema = {k: fmt.get(k) for k in ("name", "schema", "strict", "description")}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ValueError(f"text.format.type={kind!r} is not one of text, json_schema, json_object")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise ValueError(f"{where}: content parts of type {kind!r} are not supported")
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}.{key} must be a string")
    return value


def _messages(input: str | list[dict[str, Any]], instructions: str | None) -> list[dict]:
    """Chat messages of a Responses input. Consecutive function calls become one assistant
    message with several tool calls; reasoning items are dropped (templates drop past
    reasoning too)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(input, str):
        return messages + [{"role": "user", "content": input}]
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role={role!r} is not a message role")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": item.get("arguments", "{}"),
                },
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _text_of(output, where),
                }
            )
        elif kind != "reasoning":
            raise ValueError(f"{where}.type={kind!r} is not supported")
    return messages
