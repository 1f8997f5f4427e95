"""Reading JSON that may still be arriving: where a value ends (if it has ended yet), and the
`{"name": ..., "arguments": ...}` objects that tool-call formats are made of.

Tool-call arguments are streamed as the model wrote them: the raw text of the arguments value,
cut where the value ends. Raw text only ever grows while tokens arrive, so what was sent is
always a prefix of what comes next (re-serialising a partial parse would not be).
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.tool_parsers.abstract_tool_parser import ParsedCall

_WHITESPACE = " \t\r\n"


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def scan_value(text: str, pos: int) -> int | None:
    """The end (exclusive) of the JSON value starting at `text[pos]`, or None if the text
    ends inside it. Strings and nesting are respected; scalars end at a delimiter."""
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        return _scan_string(text, pos)
    if first in "{[":
        depth, i = 0, pos
        while i < len(text):
            c = text[i]
            if c == '"':
                end = _scan_string(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos
    while i < len(text) and text[i] not in ",}] \t\r\n":
        i += 1
    return i if i < len(text) else None  # a number may still be growing


def _scan_string(text: str, pos: int) -> int | None:
    i = pos + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i + 1
        i += 1
    return None


class MalformedToolCall(ValueError):
    """The text cannot become a tool call, whatever follows."""


def scan_call_object(
    text: str, pos: int, argument_keys: tuple[str, ...]
) -> tuple[ParsedCall, int | None]:
    """Read the `{"name": ..., "arguments": ...}` object that starts at `text[pos]`; returns
    the call and the index after its closing brace (None while it is not closed). The name is
    set once its string is whole; `arguments` is the raw JSON text of the arguments value,
    growing with the text (a JSON-encoded string value is decoded, once whole). Raises
    MalformedToolCall for text that is not such an object; other keys are skipped."""
    if pos >= len(text) or text[pos] != "{":
        raise MalformedToolCall(f"expected '{{' at {text[pos : pos + 20]!r}")
    call = ParsedCall()
    i = pos + 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call, None
        if text[i] == "}":
            call.complete = True
            call.arguments = call.arguments or "{}"  # a call without arguments
            return call, i + 1
        if text[i] == ",":
            i += 1
            continue
        key_end = scan_value(text, i) if text[i] == '"' else -1
        if key_end is None:
            return call, None
        if key_end < 0:
            raise MalformedToolCall(f"expected a key at {text[i : i + 20]!r}")
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return call, None
        if text[i] != ":":
            raise MalformedToolCall(f"expected ':' after key {key!r}")
        i = skip_ws(text, i + 1)
        value_end = scan_value(text, i)
        if key == "name":
            if value_end is None:
                return call, None
            name = json.loads(text[i:value_end])
            if not isinstance(name, str):
                raise MalformedToolCall(f"the tool name must be a string, got {name!r}")
            call.name = name
        elif key in argument_keys:
            if text[i : i + 1] == '"':  # arguments given as a JSON-encoded string
                if value_end is None:
                    return call, None
                call.arguments = json.loads(text[i:value_end])
            else:
                call.arguments = text[i:value_end] if value_end is not None else text[i:]
        if value_end is None:
            return call, None
        i = value_end


def scan_call_array(
    text: str, pos: int, argument_keys: tuple[str, ...]
) -> tuple[list[ParsedCall], bool]:
    """Read a JSON array of call objects starting at `text[pos]` ("["); returns the calls
    so far and whether the text is still such an array (False: malformed)."""
    calls: list[ParsedCall] = []
    if pos >= len(text):
        return calls, True
    if text[pos] != "[":
        return calls, False
    pos = skip_ws(text, pos + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            call, end = scan_call_object(text, pos, argument_keys)
        except MalformedToolCall:
            return calls, False
        calls.append(call)
        if end is None:
            break
        pos = skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos = skip_ws(text, pos + 1)
        elif pos < len(text) and text[pos] != "]":
            return calls, False
    return calls, True
