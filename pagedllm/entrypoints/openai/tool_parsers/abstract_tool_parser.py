"""What a tool-call parser is, and the registry of them (`--tool-call-parser NAME`).

A parser reads a model's tool-call format out of its generated text. It implements one
method, `parse(text, final)`, which returns the content and the calls found so far; the
contract that makes streaming work for every format is that the result only grows as text is
appended: the content and each call's arguments are prefixes of what a longer text gives, and
a call's name, once set, stays. Text that might still turn into a call marker (a partial
`<tool_` at the end) is held back until `final`.

From `parse` come both vLLM entry points: `extract_tool_calls` (a whole output) here, and the
streamed deltas in `ToolCallStreamer`. Parsers are looked up by vLLM's names through
`ToolParserManager.get_tool_parser`; the table is constant (name -> module, class).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.protocol_tools import (
    FunctionCall,
    ToolCall,
    make_tool_call_id,
)

# vLLM's parser names -> (module under this package, class).
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "hermes": ("hermes_tool_parser", "Hermes2ProToolParser"),
    "llama3_json": ("llama_tool_parser", "Llama3JsonToolParser"),
    "mistral": ("mistral_tool_parser", "MistralToolParser"),
    "pythonic": ("pythonic_tool_parser", "PythonicToolParser"),
}


@dataclass
class ParsedCall:
    """One call as read so far: `name` once whole, `arguments` the JSON text so far."""

    name: str | None = None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedToolCalls:
    """`parse`'s result. `valid` is False when the text cannot be read as the format's calls
    (then, once final, the whole text is plain content)."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    valid: bool = True


@dataclass
class ExtractedToolCallInformation:
    """vLLM's result of `extract_tool_calls`: content None when there is none."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None


def split_at_marker(text: str, marker: str, final: bool) -> tuple[ParsedToolCalls, int]:
    """The content before the first `marker` and the marker's position (-1 if absent: then
    the content is all the text, less a partial marker at its end while not `final`)."""
    at = text.find(marker)
    if at >= 0:
        return ParsedToolCalls(content=text[:at]), at
    keep = len(text) if final else len(text) - held_back_suffix(text, marker)
    return ParsedToolCalls(content=text[:keep]), -1


def held_back_suffix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (they are
    held back while streaming, in case the marker is being written)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Reads one tool-call format. Stateless: `parse` looks at the whole text each time, so
    one instance serves every request and choice."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def adjust_request(self, request: Any) -> Any:
        """Change what the request asks of the engine so the format survives detokenization
        (e.g. keep special tokens that mark calls); returns the request."""
        return request

    def make_tool_call_id(self) -> str:
        return make_tool_call_id()

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        """Content and calls of `text` (the output so far; `final`: all of it)."""
        raise NotImplementedError

    def extract_tool_calls(
        self, model_output: str, request: Any = None, max_calls: int | None = None
    ) -> ExtractedToolCallInformation:
        """The calls of a whole output, or none (and the output as content) when a call is
        malformed: cut short, not JSON, or without a name. At most `max_calls` are kept."""
        parsed = self.parse(model_output, final=True)
        calls = parsed.calls[:max_calls]
        if not parsed.valid or not calls or not all(_is_whole(c) for c in calls):
            return ExtractedToolCallInformation(False, [], model_output or None)
        tool_calls = [
            ToolCall(
                id=self.make_tool_call_id(),
                function=FunctionCall(name=c.name, arguments=c.arguments),
            )
            for c in calls
        ]
        return ExtractedToolCallInformation(True, tool_calls, parsed.content or None)


def _is_whole(call: ParsedCall) -> bool:
    if not call.complete or call.name is None:
        return False
    try:
        json.loads(call.arguments or "{}")
    except ValueError:
        return False
    return True


class ToolParserManager:
    """vLLM's lookup of tool parsers by name."""

    @staticmethod
    def get_tool_parser(name: str) -> type[ToolParser]:
        """The parser class registered as `name`; ValueError naming the valid ones."""
        if name not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser={name!r} is not available; choose one of {sorted(TOOL_PARSERS)}"
            )
        module, cls = TOOL_PARSERS[name]
        package = __name__.rsplit(".", 1)[0]
        return getattr(importlib.import_module(f"{package}.{module}"), cls)
