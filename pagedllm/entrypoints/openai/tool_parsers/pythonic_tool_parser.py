"""Pythonic tool calls (`--tool-call-parser pythonic`; Llama 3.2 / 4, ToolACE): the whole
output is a Python list of calls with literal keyword arguments,

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

optionally between `<|python_start|>` and `<|python_end|>`. Arguments become JSON objects.
While streaming, a call's name is sent once its `(` is written and its arguments once its
`)` closes (a partial Python call cannot be turned into a JSON prefix). An output that does
not start with `[` is plain content.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedCall,
    ParsedToolCalls,
    ToolParser,
)
from pagedllm.entrypoints.openai.tool_parsers.partial_json import skip_ws

_IDENTIFIER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")


class PythonicToolParser(ToolParser):
    """A Python list of calls `[f(a=1), g(b="x")]`."""

    start_token = "<|python_start|>"
    end_token = "<|python_end|>"

    def adjust_request(self, request: Any) -> Any:
        request.skip_special_tokens = False  # <|python_start|> is a special token
        return request

    def parse(self, text: str, final: bool) -> ParsedToolCalls:
        body = text.replace(self.start_token, "").replace(self.end_token, "")
        pos = skip_ws(body, 0)
        if not final and self.start_token.startswith(body[pos:]):
            return ParsedToolCalls()  # nothing yet, or the start of <|python_start|>
        if pos >= len(body):
            return ParsedToolCalls(content=text)
        if body[pos] != "[":
            return ParsedToolCalls(content=text, valid=False)
        result = ParsedToolCalls()
        pos += 1
        while True:
            pos = skip_ws(body, pos)
            if pos >= len(body) or body[pos] == "]":
                break
            open_at = pos
            while open_at < len(body) and body[open_at] in _IDENTIFIER_CHARS:
                open_at += 1
            if open_at >= len(body):
                break  # the name is still being written
            if body[open_at] != "(" or open_at == pos:
                result.valid = False
                break
            call = ParsedCall(name=body[pos:open_at])
            result.calls.append(call)
            close = _matching_paren(body, open_at)
            if close is None:
                break
            try:
                call.arguments = _call_arguments(body[pos : close + 1])
            except (SyntaxError, ValueError):
                result.valid = False
                break
            call.complete = True
            pos = skip_ws(body, close + 1)
            if pos < len(body) and body[pos] == ",":
                pos += 1
            elif pos < len(body) and body[pos] != "]":
                result.valid = False
                break
        if final and (not result.calls or not result.calls[-1].complete):
            result.valid = False
        return result


def _matching_paren(text: str, open_at: int) -> int | None:
    """Index of the `)` closing `text[open_at]`, skipping Python strings; None if not yet."""
    depth, i, quote = 0, open_at, None
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _call_arguments(source: str) -> str:
    """`f(a=1, b="x")` -> '{"a": 1, "b": "x"}'; only keyword arguments with literal values."""
    call = ast.parse(source, mode="eval").body
    if not isinstance(call, ast.Call) or call.args:
        raise ValueError(f"not a call with keyword arguments: {source!r}")
    arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    if None in arguments:
        raise ValueError(f"**kwargs in a tool call: {source!r}")
    return json.dumps(arguments, ensure_ascii=False)
