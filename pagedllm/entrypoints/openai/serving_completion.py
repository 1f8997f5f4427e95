"""`POST /v1/completions`: one engine request per prompt (string, strings, token ids, or lists
of token ids), `n` choices each; choice index = prompt index * n + output index."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from pagedllm.entrypoints.openai.request_checks import check_fields
from pagedllm.entrypoints.openai.serving_engine import (
    OpenAIError,
    OpenAIServing,
    make_usage,
    merge_async_iterators,
)
from pagedllm.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    """Completions handler. `create_completion` returns a `CompletionResponse`, or for
    `stream=true` an async generator of server-sent-event strings ending in `[DONE]`."""

    def _prompts(
        self, prompt: Any, add_special_tokens: bool = True
    ) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt, in request order."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or len(prompt) == 0:
            raise OpenAIError(
                "prompt must be a non-empty string, list or token list", param="prompt"
            )
        if all(isinstance(t, int) for t in prompt):
            prompt = [prompt]
        result: list[tuple[str | None, list[int]]] = []
        for p in prompt:
            if isinstance(p, str):
                result.append((p, self.tokenize_text(p, add_special_tokens=add_special_tokens)))
            elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                result.append((None, list(p)))
            else:
                raise OpenAIError(
                    "prompt must be a non-empty string, list of strings, list of token ids or "
                    f"list of token-id lists; got an element {str(p)[:50]!r}",
                    param="prompt",
                )
        return result

    async def create_completion(
        self,
        request: CompletionRequest,
        request_id: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> CompletionResponse | AsyncGenerator[str, None]:
        self.check_request(request.model)
        check_fields(request)
        request_id = f"cmpl-{request.request_id or request_id or random_uuid()}"
        created = int(time.time())
        prompts = []
        generators = []
        tokenized = await self.in_tokenizer_thread(
            self._prompts, request.prompt, request.add_special_tokens
        )
        if request.kv_transfer_params is not None and len(tokenized) > 1:
            raise OpenAIError(
                "kv_transfer_params describe one request's KV; send one prompt per request",
                param="kv_transfer_params",
            )
        for i, (text, ids) in enumerate(tokenized):
            # echo with max_tokens=0 scores the prompt: one token is generated, not returned.
            requested = 1 if request.echo_only else request.max_tokens
            max_tokens = self.resolve_max_tokens(len(ids), requested, "prompt")
            engine_prompt = self.engine_prompt(text, ids, request)
            prompts.append((engine_prompt["prompt"], engine_prompt["prompt_token_ids"]))
            generators.append(
                await self.generate(
                    f"{request_id}-{i}", engine_prompt, request, max_tokens, data_parallel_rank
                )
            )
        results = merge_async_iterators(*generators)
        if request.stream:
            return self._stream(request, request_id, created, prompts, results)
        final: list[RequestOutput | None] = [None] * len(prompts)
        try:
            async for i, res in results:
                final[i] = res
        except Exception as e:
            raise OpenAIError.from_exception(e) from e
        return self._full_response(request, request_id, created, prompts, final)

    def _full_response(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[tuple[str | None, list[int]]],
        final: list[RequestOutput | None],
    ) -> CompletionResponse:
        choices: list[CompletionResponseChoice] = []
        num_prompt_tokens = num_generated = 0
        for i, res in enumerate(final):
            assert res is not None
            prompt_text = prompts[i][0]
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(res.prompt_token_ids)
            num_prompt_tokens += len(res.prompt_token_ids)
            for out in sorted(res.outputs, key=lambda o: o.index):
                if request.echo_only:
                    out.text, out.token_ids, out.logprobs = "", [], []
                num_generated += len(out.token_ids)
                text, token_ids = out.text, list(out.token_ids)
                step_logprobs: list = list(out.logprobs or [])
                if request.echo:
                    text = prompt_text + text
                    token_ids = list(res.prompt_token_ids) + token_ids
                    step_logprobs = list(res.prompt_logprobs or [None] * len(res.prompt_token_ids))
                    step_logprobs += list(out.logprobs or [])
                logprobs = None
                if request.logprobs is not None:
                    logprobs = self.completion_logprobs(
                        token_ids,
                        step_logprobs,
                        request.logprobs,
                        as_ids=self.tokens_as_ids(request),
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=i * request.n + out.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        prompt_logprobs=(
                            res.prompt_logprobs if request.prompt_logprobs is not None else None
                        ),
                    )
                )
        cached = sum(res.num_cached_tokens for res in final if res is not None)
        usage = make_usage(num_prompt_tokens, num_generated, self.cached_tokens(cached))
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name,
            choices=choices,
            usage=usage,
            kv_transfer_params=final[0].kv_transfer_params if final[0] is not None else None,
        )

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[tuple[str | None, list[int]]],
        results: AsyncGenerator[tuple[int, RequestOutput], None],
    ) -> AsyncGenerator[str, None]:
        n = request.n
        echoed = [False] * (len(prompts) * n)
        text_offsets = [0] * (len(prompts) * n)
        num_generated = [0] * (len(prompts) * n)
        prompt_lens = [len(ids) for _, ids in prompts]
        cached = [0] * len(prompts)
        try:
            async for i, res in results:
                cached[i] = res.num_cached_tokens
                for out in res.outputs:
                    index = i * n + out.index
                    if request.echo_only:
                        out.text, out.token_ids, out.logprobs = "", [], []
                    text, token_ids = out.text, list(out.token_ids)
                    step_logprobs: list = list(out.logprobs or [])
                    if request.echo and not echoed[index]:
                        echoed[index] = True
                        prompt_text = prompts[i][0]
                        if prompt_text is None:
                            prompt_text = self.tokenizer.decode(res.prompt_token_ids)
                        text = prompt_text + text
                        token_ids = list(res.prompt_token_ids) + token_ids
                        prompt_lp = res.prompt_logprobs or [None] * len(res.prompt_token_ids)
                        step_logprobs = list(prompt_lp) + step_logprobs
                    num_generated[index] += len(out.token_ids)
                    if not text and not token_ids and out.finish_reason is None:
                        continue
                    logprobs = None
                    if request.logprobs is not None:
                        logprobs = self.completion_logprobs(
                            token_ids,
                            step_logprobs,
                            request.logprobs,
                            text_offsets[index],
                            as_ids=self.tokens_as_ids(request),
                        )
                    text_offsets[index] += len(text)
                    chunk = CompletionStreamResponse(
                        id=request_id,
                        object="text_completion",
                        created=created,
                        model=self.model_name,
                        choices=[
                            CompletionResponseStreamChoice(
                                index=index,
                                text=text,
                                logprobs=logprobs,
                                finish_reason=out.finish_reason,
                                stop_reason=out.stop_reason,
                            )
                        ],
                    )
                    if request.continuous_usage:
                        chunk.usage = make_usage(prompt_lens[i], num_generated[index])
                    yield f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"
            if self.include_usage(request):
                usage = make_usage(
                    sum(prompt_lens), sum(num_generated), self.cached_tokens(sum(cached))
                )
                final = CompletionStreamResponse(
                    id=request_id,
                    object="text_completion",
                    created=created,
                    model=self.model_name,
                    choices=[],
                    usage=usage,
                )
                yield f"data: {final.model_dump_json(exclude_unset=True)}\n\n"
        except Exception as e:
            error = OpenAIError.from_exception(e).to_response()
            yield f"data: {error.model_dump_json()}\n\n"
        finally:
            await results.aclose()
        yield "data: [DONE]\n\n"
