"""What the server refuses early, each as a 400 that names the limit or the field.

- `ServerLimits`: the configurable limits (`--max-request-body-bytes`, `--max-prompt-chars`,
  `--max-n-sequences`) resolved for one model, with the checks the handlers call.
- `RequestBodyLimitMiddleware`: a body over the limit is refused from its Content-Length, or
  once the streamed body passes it, before any of it is parsed.
- `CheckedJSONRoute`: the app's route class. A JSON body must be UTF-8; once parsed it is
  walked (off the event loop) for what pydantic lets through but the engine cannot take:
  lone UTF-16 surrogates in strings, integers that do not fit in 64 bits, non-finite numbers
  (`NaN`, `Infinity`, `1e400`) and nesting deeper than `MAX_JSON_DEPTH`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from pagedllm.entrypoints.openai.errors import OpenAIError, error_response

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
# OpenAI's own limit on `n`; vLLM's VLLM_MAX_N_SEQUENCES defaults to 16384.
DEFAULT_MAX_N_SEQUENCES = 128
# No request field needs more (a JSON schema in response_format, tools, chat content parts);
# deeper input would only recurse through pydantic, Jinja and the grammar compiler.
MAX_JSON_DEPTH = 64
# Integers the engine can carry (msgpack, torch.Generator seeds): int64 or uint64.
_MIN_INT, _MAX_INT = -(1 << 63), (1 << 64) - 1


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest entry of the vocabulary (added tokens included). One token
    never stands for more characters of the prompt than its own entry holds (a byte-level
    entry has one character per byte, and a prompt character is at least one byte), so a
    prompt of more than max_model_len times this many characters cannot fit."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of one server. `max_prompt_chars` None: no character check."""

    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_prompt_chars: int | None = None
    max_n_sequences: int = DEFAULT_MAX_N_SEQUENCES
    # Why max_prompt_chars is what it is, for its error message.
    prompt_chars_reason: str = "--max-prompt-chars"

    @classmethod
    def from_args(cls, args: Any) -> ServerLimits:
        """The limits the server flags in `args` set (None or a flag not given: defaults);
        an unset `--max-prompt-chars` stays None until `for_model`."""

        def flag(name: str, default: int | None) -> int | None:
            value = getattr(args, name, None)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value} must be at least 1")
            return default if value is None else value

        return cls(
            max_request_body_bytes=flag("max_request_body_bytes", DEFAULT_MAX_REQUEST_BODY_BYTES),
            max_prompt_chars=flag("max_prompt_chars", None),
            max_n_sequences=flag("max_n_sequences", DEFAULT_MAX_N_SEQUENCES),
        )

    def for_model(self, tokenizer: Any, max_model_len: int) -> ServerLimits:
        """These limits with an unset `max_prompt_chars` made max_model_len times the longest
        token's characters."""
        if self.max_prompt_chars is not None:
            return self
        longest = longest_token_chars(tokenizer)
        return dataclasses.replace(
            self,
            max_prompt_chars=max_model_len * longest,
            prompt_chars_reason=(
                f"a longer prompt cannot fit in max_model_len={max_model_len} tokens of at "
                f"most {longest} characters; --max-prompt-chars"
            ),
        )

    def check_prompt_chars(self, text: str, field: str) -> None:
        """400 before tokenizing a text longer than `max_prompt_chars`."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise OpenAIError(
                f"{field} has {len(text)} characters, more than this server takes "
                f"({self.max_prompt_chars}: {self.prompt_chars_reason})",
                param=field,
            )

    def check_n(self, n: int) -> None:
        if n > self.max_n_sequences:
            raise OpenAIError(
                f"n={n} is more than this server allows ({self.max_n_sequences}; "
                "--max-n-sequences)",
                param="n",
            )


class RequestBodyLimitMiddleware:
    """Pure ASGI: reads the whole body before the app runs and refuses one over `max_bytes`
    (400) before any of it is parsed; the app then gets the body in one message.

    A body found too large (from its Content-Length, or once the stream passes the limit) is
    still read, and dropped, for up to `max_bytes` more bytes, so that the client gets to
    read the answer instead of a connection reset; past that the connection is closed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        declared = int(length) if length.isdigit() else None
        chunks: list[bytes] = []
        received, more = 0, True
        while more and received <= 2 * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it sent its request
            body = message.get("body", b"")
            more = message.get("more_body", False)
            received += len(body)
            if received <= self.max_bytes and (declared or 0) <= self.max_bytes:
                chunks.append(body)
        if received > self.max_bytes or (declared or 0) > self.max_bytes:
            size = declared if declared is not None else f"over {self.max_bytes}"
            error = OpenAIError(
                f"the request body is {size} bytes, more than this server takes "
                f"({self.max_bytes}; --max-request-body-bytes)"
            )
            headers = {"Connection": "close"} if more else None
            await error_response(error, headers)(scope, receive, send)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()  # a disconnect, for handlers that watch for one
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)


def _field(path: tuple) -> str:
    """`("messages", 0, "content")` -> "messages[0].content"."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def _check_text(text: str, path: tuple) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        field = _field(path)
        raise OpenAIError(
            f"{field} contains a lone UTF-16 surrogate (U+{ord(text[e.start]):04X} at index "
            f"{e.start}); text must be valid Unicode",
            param=field,
        ) from None


def _check_scalar(value: Any, path: tuple) -> None:
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, int) and not _MIN_INT <= value <= _MAX_INT:
        field = _field(path)
        raise OpenAIError(f"{field}={value} does not fit in 64 bits", param=field)
    elif isinstance(value, float) and not math.isfinite(value):
        field = _field(path)
        raise OpenAIError(f"{field}={value} is not a finite number", param=field)


def check_json_value(value: Any) -> None:
    """Raise OpenAIError (400, naming the field) for what the engine cannot take: lone
    surrogates, integers beyond 64 bits, non-finite floats, nesting deeper than
    MAX_JSON_DEPTH. Iterative, so no input can exhaust the stack."""
    stack: list[tuple[Any, tuple, int]] = [(value, (), 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, dict):
            children = list(item.items())
            for key, _ in children:
                _check_text(key, path)
        elif isinstance(item, list):
            if set(map(type, item)) <= {int}:  # token ids: check the range in C
                if item and not (_MIN_INT <= min(item) and max(item) <= _MAX_INT):
                    bad = next(x for x in item if not _MIN_INT <= x <= _MAX_INT)
                    _check_scalar(bad, (*path, item.index(bad)))
                continue
            children = list(enumerate(item))
        else:
            _check_scalar(item, path)
            continue
        if depth >= MAX_JSON_DEPTH:
            raise OpenAIError(
                f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels (at "
                f"{_field(path)})"
            )
        for key, child in children:
            if isinstance(child, (dict, list)):
                stack.append((child, (*path, key), depth + 1))
            else:
                _check_scalar(child, (*path, key))


def parse_json_body(body: bytes) -> Any:
    """UTF-8 JSON -> Python value, checked by `check_json_value`. Malformed JSON raises
    json.JSONDecodeError (FastAPI answers it as a validation error)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise OpenAIError(
            f"the request body is not valid UTF-8 (byte 0x{body[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise OpenAIError(
            f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    check_json_value(value)
    return value


class _CheckedJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            # The walk is Python code: on a thread, the event loop keeps its turns.
            self._json = await asyncio.to_thread(parse_json_body, await self.body())
        return self._json


class CheckedJSONRoute(APIRoute):
    """Every route of the app reads its JSON body through `parse_json_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked_handler(request: Request) -> Response:
            return await handler(_CheckedJSONRequest(request.scope, request.receive))

        return checked_handler
