"""Tool-call parsers (`--tool-call-parser`): read a model's tool-call format out of its text.
One parser a file; `ToolParserManager` looks them up by vLLM's names."""

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    TOOL_PARSERS,
    ExtractedToolCallInformation,
    ToolParser,
    ToolParserManager,
)
from pagedllm.entrypoints.openai.tool_parsers.tool_call_streamer import ToolCallStreamer

__all__ = [
    "TOOL_PARSERS",
    "ExtractedToolCallInformation",
    "ToolCallStreamer",
    "ToolParser",
    "ToolParserManager",
]
