"""Llama 3.1 / 3.2 JSON tool calls (`--tool-call-parser llama3_json`): the whole output is

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

(`<|python_tag|>` optional, `arguments` accepted for `parameters`, calls separated by `;`).
An output that does not start with a call is plain content.
"""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedToolCalls,
    ToolParser,
    held_back_suffix,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import (
    MalformedToolCall,
    scan_call_object,
    skip_ws,
)


class Llama3JsonToolParser(ToolParser):
    """JSON objects with `name` and `parameters`, `;`-separated."""

    bot_token = "<|python_tag|>"

    def adjust_request(self, request: Any) -> Any:
        request.skip_special_tokens = False  # <|python_tag|> is a special token
        return request

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        pos = skip_ws(text, 0)
        if text.startswith(self.bot_token, pos):
            pos = skip_ws(text, pos + len(self.bot_token))
        elif not final and held_back_suffix(text[pos:], self.bot_token) == len(text) - pos:
            return ParsedToolCalls()  # nothing yet, or the start of <|python_tag|>
        if pos >= len(text):
            return ParsedToolCalls(content=text if final else "")
        if text[pos] != "{":
            return ParsedToolCalls(content=text, valid=False)
        result = ParsedToolCalls()
        while pos < len(text):
            try:
                call, end = scan_call_object(text, pos, ("parameters", "arguments"))
            except MalformedToolCall:
                result.valid = False
                break
            result.calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if pos < len(text) and text[pos] == ";":
                pos = skip_ws(text, pos + 1)
            elif pos < len(text):
                result.valid = False
                break
        if final and (not result.calls or not result.calls[-1].complete):
            result.valid = False
        return result
