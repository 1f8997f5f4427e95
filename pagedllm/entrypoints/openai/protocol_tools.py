"""Pydantic models of tools and tool calls in the chat API (OpenAI's shapes): the request's
`tools` and `tool_choice`, the response's `tool_calls`, and their streamed deltas."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def make_tool_call_id() -> str:
    """vLLM's tool-call id: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(_Model):
    name: str


class ChatCompletionNamedToolChoiceParam(_Model):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None


class FunctionCall(_Model):
    name: str
    arguments: str


class ToolCall(_Model):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    """One streamed piece of a tool call: the first carries `id`, `type` and the name (with
    empty arguments), later ones argument fragments only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
