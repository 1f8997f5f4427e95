"""Hermes 2 Pro / Qwen 2.5 / Qwen 3 (`--tool-call-parser hermes`):

    optional content<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>

Content is the text before the first `<tool_call>`; text between and after calls is dropped.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolCalls,
    ToolParser,
    split_at_marker,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import (
    MalformedToolCall,
    scan_call_object,
    skip_ws,
)


class Hermes2ProToolParser(ToolParser):
    """`<tool_call>` JSON `</tool_call>` blocks."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def adjust_request(self, request: Any) -> Any:
        # Some tokenizers mark <tool_call> special; it must reach the text to be parsed.
        request.skip_special_tokens = False
        return request

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        result, at = split_at_marker(text, self.start_tag, final)
        while at >= 0:
            pos = skip_ws(text, at + len(self.start_tag))
            if pos >= len(text):
                result.calls.append(ParsedCall())
                break
            try:
                call, end = scan_call_object(text, pos, ("arguments", "parameters"))
            except MalformedToolCall:
                result.valid = False
                break
            result.calls.append(call)
            if end is None:
                break
            at = text.find(self.start_tag, end)
        if final and result.calls and not result.calls[-1].complete:
            result.valid = False
        return result
