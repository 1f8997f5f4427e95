"""`POST /v1/chat/completions`: messages (and tools) rendered through the tokenizer's chat
template, one engine request with `n` choices. A stream sends, per choice, a role delta with
the first output, then content deltas (reasoning and tool-call deltas where a parser splits
them out, see chat_output.py), the finish reason on the last delta, then (if asked) a usage
chunk, then `[DONE]`."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from pagedllm.entrypoints.chat_utils import flatten_content, render_chat
from pagedllm.entrypoints.openai.chat_output import ChatOutputParser
from pagedllm.entrypoints.openai.limits import ServerLimits
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
from pagedllm.entrypoints.openai.request_checks import check_fields
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    ServingOptions,
    final_output,
    make_usage,
)
from pagedllm.entrypoints.openai.tool_choice import select_tool_parser
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, ToolParserManager
from pagedllm.outputs import RequestOutput
from pagedllm.reasoning import ReasoningParser, ReasoningParserManager


def _echoed_content(request: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: the reply starts with the last message's content when that
    message is the assistant's (a continued reply)."""
    if not request.echo or not request.messages:
        return ""
    last = request.messages[-1]
    if not isinstance(last, dict) or last.get("role") != "assistant":
        return ""
    return flatten_content(last.get("content"))


class OpenAIServingChat(OpenAIServing):
    """Chat handler. `create_chat_completion` returns a `ChatCompletionResponse`, or for
    `stream=true` an async generator of server-sent-event strings ending in `[DONE]`.
    `tool_call_parser` (with `enable_auto_tools`) reads "auto" tool calls; `reasoning_parser`
    splits reasoning from content."""

    def __init__(
        self,
        engine: Any,
        served_model_names: list[str],
        limits: ServerLimits | None = None,
        *,
        enable_auto_tools: bool = False,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        options: ServingOptions | None = None,
    ) -> None:
        super().__init__(engine, served_model_names, limits, options)
        self.auto_tool_parser: ToolParser | None = None
        if enable_auto_tools:
            if tool_call_parser is None:
                raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
            cls = ToolParserManager.get_tool_parser(tool_call_parser)
            self.auto_tool_parser = cls(self.tokenizer)
        self.reasoning_parser_cls: type[ReasoningParser] | None = None
        if reasoning_parser is not None:
            self.reasoning_parser_cls = ReasoningParserManager.get_reasoning_parser(
                reasoning_parser
            )
            self.reasoning_parser_cls(self.tokenizer)  # the tokenizer must have its tokens

    def template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        """A request's chat_template_kwargs over the server's --default-chat-template-kwargs."""
        defaults = self.options.default_chat_template_kwargs
        return {**defaults, **(kwargs or {})} if defaults else kwargs

    def response_role(self, request: ChatCompletionRequest) -> str:
        """The reply's role: --response-role after a generation prompt, else (a continued
        final message) that message's role, as vLLM's."""
        if request.add_generation_prompt or not request.messages:
            return self.options.response_role
        return request.messages[-1].get("role") or "assistant"

    def output_parsers(
        self, request: Any, prompt_token_ids: list[int], tool_parser: ToolParser | None
    ) -> list[ChatOutputParser]:
        """One output splitter per choice (reasoning, content, tool calls)."""
        reasoning = None
        if self.reasoning_parser_cls is not None:
            kwargs = self.template_kwargs(request.template_kwargs())
            reasoning = self.reasoning_parser_cls(self.tokenizer, kwargs)
        max_calls = 1 if request.parallel_tool_calls is False else None
        return [
            ChatOutputParser(
                reasoning, prompt_token_ids, tool_parser, max_calls, request.include_reasoning
            )
            for _ in range(request.n)
        ]

    def request_tool_parser(self, request: Any) -> ToolParser | None:
        """The parser of this request's tool calls (400 for a tool_choice it cannot honour);
        the auto parser may adjust the request (keep the special tokens marking calls)."""
        try:
            parser = select_tool_parser(
                request.tools, request.tool_choice, self.tokenizer, self.auto_tool_parser
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="tool_choice") from e
        if parser is not None and parser is self.auto_tool_parser:
            parser.adjust_request(request)
        return parser

    def render_messages(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[Any] | None = None,
        documents: list[dict[str, str]] | None = None,
    ) -> str:
        """The prompt text of a conversation, through the request's `chat_template` (only
        with --trust-request-chat-template: a 400 otherwise, as vLLM's) or the server's; 400
        for malformed messages or no template."""
        asked = chat_template is not None or (chat_template_kwargs or {}).get("chat_template")
        if asked and not self.options.trust_request_chat_template:
            raise OpenAIError(
                "chat_template is passed with the request, but the server runs without "
                "--trust-request-chat-template: refused",
                param="chat_template",
            )
        try:
            return render_chat(
                self.tokenizer,
                messages,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template or self.options.chat_template,
                chat_template_kwargs=self.template_kwargs(chat_template_kwargs),
                tools=[t.model_dump(exclude_none=True) for t in tools] if tools else None,
                documents=documents,
            )
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from e

    def _prepare_chat(self, request: ChatCompletionRequest) -> tuple[dict[str, Any], Any]:
        """Blocking (run on the tokenizer thread): the engine prompt, rendered and tokenized
        within the limits, and the request's tool parser."""
        tool_parser = self.request_tool_parser(request)
        tools = request.tools
        if request.tool_choice == "none" and self.options.exclude_tools_when_tool_choice_none:
            tools = None
        prompt_text = self.render_messages(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            request.template_kwargs(),
            tools,
            request.documents,
        )
        ids = self.tokenize_text(prompt_text, request.add_special_tokens, "messages")
        return self.engine_prompt(prompt_text, ids, request), tool_parser

    async def start_chat(
        self, request: ChatCompletionRequest, request_id: str, data_parallel_rank: int | None = None
    ) -> tuple[AsyncGenerator[RequestOutput, None], list[int], list[ChatOutputParser]]:
        """Render, tokenize (on the tokenizer thread) and submit a chat request (400s before
        anything runs): returns the engine's output generator, the prompt token ids and one
        output parser per choice. The Responses API shares it."""
        engine_prompt, tool_parser = await self.in_tokenizer_thread(self._prepare_chat, request)
        ids = engine_prompt["prompt_token_ids"]
        max_tokens = self.resolve_max_tokens(len(ids), request.requested_max_tokens, "messages")
        generator = await self.generate(
            request_id, engine_prompt, request, max_tokens, data_parallel_rank
        )
        return generator, ids, self.output_parsers(request, ids, tool_parser)

    async def create_chat_completion(
        self,
        request: ChatCompletionRequest,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        self.check_request(request.model)
        check_fields(request)
        request_id = f"chatcmpl-{request.request_id or request_id or random_uuid()}"
        created = int(time.time())
        generator, ids, parsers = await self.start_chat(request, request_id, data_parallel_rank)
        echo = _echoed_content(request)
        if request.stream:
            return self._stream(request, request_id, created, len(ids), generator, parsers, echo)
        final: RequestOutput = await final_output(generator)
        choices = []
        num_generated = 0
        for out in sorted(final.outputs, key=lambda o: o.index):
            num_generated += len(out.token_ids)
            logprobs = None
            if request.logprobs:
                logprobs = self.chat_logprobs(
                    list(out.token_ids),
                    out.logprobs,
                    request.top_logprobs or 0,
                    as_ids=self.tokens_as_ids(request),
                )
            parsed = parsers[out.index].parse(out.text)
            message = ChatMessage(
                role=self.response_role(request),
                content=echo + (parsed.content or "") if echo else parsed.content,
                reasoning_content=parsed.reasoning,
                reasoning=parsed.reasoning,
                tool_calls=parsed.tool_calls,
            )
            choices.append(
                ChatCompletionResponseChoice(
                    index=out.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=_finish_reason(out.finish_reason, bool(parsed.tool_calls)),
                    stop_reason=out.stop_reason,
                )
            )
        usage = make_usage(len(ids), num_generated, self.cached_tokens(final.num_cached_tokens))
        response = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=final.kv_transfer_params,
        )
        if request.prompt_logprobs is not None or request.echo:
            response.prompt_logprobs = final.prompt_logprobs
        return response

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        num_prompt_tokens: int,
        generator: AsyncGenerator[RequestOutput, None],
        parsers: list[ChatOutputParser],
        echo: str = "",
    ) -> AsyncGenerator[str, None]:
        def chunk(choices: list, usage: UsageInfo | None = None) -> str:
            response = ChatCompletionStreamResponse(
                id=request_id,
                object="chat.completion.chunk",
                created=created,
                model=self.model_name,
                choices=choices,
            )
            if usage is not None:
                response.usage = usage
            return f"data: {response.model_dump_json(exclude_unset=True)}\n\n"

        num_generated = [0] * request.n
        num_cached_tokens = 0
        first = True
        try:
            async for res in generator:
                num_cached_tokens = res.num_cached_tokens
                if first:
                    # The role (and echo) chunks go out with the first output, as vLLM's do:
                    # a client timing its first chunk then times the first token.
                    # With continuous usage they carry it too (no tokens generated yet), as
                    # vLLM's do: every chunk of such a stream has `usage`.
                    first = False
                    head_usage = (
                        make_usage(num_prompt_tokens, 0) if request.continuous_usage else None
                    )
                    for i in range(request.n):
                        role = DeltaMessage(role=self.response_role(request), content="")
                        role_choice = ChatCompletionResponseStreamChoice(index=i, delta=role)
                        yield chunk([role_choice], head_usage)
                        if echo:
                            delta = DeltaMessage(content=echo)
                            echo_choice = ChatCompletionResponseStreamChoice(index=i, delta=delta)
                            yield chunk([echo_choice], head_usage)
                for out in res.outputs:
                    num_generated[out.index] += len(out.token_ids)
                    if not out.text and not out.token_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs:
                        logprobs = self.chat_logprobs(
                            list(out.token_ids),
                            out.logprobs,
                            request.top_logprobs or 0,
                            as_ids=self.tokens_as_ids(request),
                        )
                    delta = parsers[out.index].feed(out.text, out.finish_reason is not None)
                    if delta is None and logprobs is None and out.finish_reason is None:
                        continue  # a parser holds the text back (a call marker may follow)
                    choice = ChatCompletionResponseStreamChoice(
                        index=out.index,
                        delta=delta or DeltaMessage(content=""),
                        logprobs=logprobs,
                        finish_reason=_finish_reason(
                            out.finish_reason, parsers[out.index].tools_called
                        ),
                        stop_reason=out.stop_reason,
                    )
                    usage = None
                    if request.continuous_usage:
                        usage = make_usage(num_prompt_tokens, num_generated[out.index])
                    yield chunk([choice], usage)
            if self.include_usage(request):
                cached = self.cached_tokens(num_cached_tokens)
                yield chunk([], make_usage(num_prompt_tokens, sum(num_generated), cached))
        except Exception as e:
            error = OpenAIError.from_exception(e).to_response()
            yield f"data: {error.model_dump_json()}\n\n"
        finally:
            await generator.aclose()
        yield "data: [DONE]\n\n"


def _finish_reason(finish_reason: str | None, tools_called: bool) -> str | None:
    """OpenAI's "tool_calls" for an output that ended by itself with calls in it."""
    return "tool_calls" if finish_reason == "stop" and tools_called else finish_reason
