"""`POST /v1/chat/completions`: messages rendered through the tokenizer's chat template, one
engine request with `n` choices. A stream sends, per choice, a role delta first, then content
deltas, the finish reason on the last delta, then (if asked) a usage chunk, then `[DONE]`."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    random_uuid,
)
from pagedllm.entrypoints.openai.serving_engine import OpenAIError, OpenAIServing, make_usage
from pagedllm.outputs import RequestOutput


def _flatten_content(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise OpenAIError(
                    f"message content part of type {kind!r} is not supported (text only)",
                    param="messages",
                )
        return "\n".join(texts)
    raise OpenAIError(f"message content must be a string or a list, got {content!r}")


class OpenAIServingChat(OpenAIServing):
    """Chat handler. `create_chat_completion` returns a `ChatCompletionResponse`, or for
    `stream=true` an async generator of server-sent-event strings ending in `[DONE]`."""

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text of a conversation; 400 for malformed messages or no template."""
        if not messages:
            raise OpenAIError("messages must be a non-empty list", param="messages")
        conversation = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise OpenAIError(
                    f"every message needs a string 'role', got {str(m)[:80]!r}", param="messages"
                )
            conversation.append({**m, "content": _flatten_content(m.get("content"))})
        if add_generation_prompt and continue_final_message:
            raise OpenAIError(
                "add_generation_prompt and continue_final_message cannot both be true"
            )
        try:
            return self.tokenizer.apply_chat_template(
                conversation,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
        except ValueError as e:
            raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from e
        except Exception as e:  # jinja2 errors from a user-supplied template
            raise OpenAIError(f"chat template failed: {type(e).__name__}: {e}") from e

    async def create_chat_completion(
        self, request: ChatCompletionRequest, request_id: str | None = None
    ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        self.check_request(request.model)
        request_id = f"chatcmpl-{request.request_id or request_id or random_uuid()}"
        created = int(time.time())
        prompt_text = self.render_messages(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            request.chat_template_kwargs,
        )
        ids = self.tokenize_text(prompt_text, add_special_tokens=request.add_special_tokens)
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens, "messages")
        engine_prompt = {"prompt_token_ids": ids, "prompt": prompt_text}
        params, processed = self.prepare(request_id, engine_prompt, request, max_tokens)
        generator = self.engine.generate(
            engine_prompt, params, request_id, priority=request.priority, processed=processed
        )
        if request.stream:
            return self._stream(request, request_id, created, len(ids), generator)
        final: RequestOutput | None = None
        try:
            async for res in generator:
                final = res
        except Exception as e:
            raise OpenAIError.from_exception(e) from e
        assert final is not None
        choices = []
        num_generated = 0
        for out in sorted(final.outputs, key=lambda o: o.index):
            num_generated += len(out.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(
                    list(out.token_ids), out.logprobs, request.top_logprobs or 0
                )
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=ChatMessage(role="assistant", content=out.text),
                    logprobs=logprobs,
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                )
            )
        usage = make_usage(len(ids), num_generated)
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices, usage=usage
        )

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        num_prompt_tokens: int,
        generator: AsyncGenerator[RequestOutput, None],
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list, usage: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.model_name, choices=choices
            )
            if usage is not None:
                response.usage = usage
            return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"

        num_generated = [0] * request.n
        try:
            for i in range(request.n):
                role = DeltaMessage(role="assistant", content="")
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=role)])
            async for res in generator:
                for out in res.outputs:
                    num_generated[out.index] += len(out.token_ids)
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs:
                        logprobs = self.chat_logprobs(
                            list(out.token_ids), out.logprobs, request.top_logprobs or 0
                        )
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index,
                        delta=DeltaMessage(content=out.text),
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                    )
                    usage = None
                    if request.continuous_usage:
                        usage = make_usage(num_prompt_tokens, num_generated[out.index])
                    yield chunk([choice], usage)
            if request.include_usage_in_stream:
                yield chunk([], make_usage(num_prompt_tokens, sum(num_generated)))
        except Exception as e:
            error = OpenAIError.from_exception(e).to_response()
            yield f"data: {error.model_dump_json()}\n\n"
        finally:
            await generator.aclose()
        yield "data: [DONE]\n\n"
