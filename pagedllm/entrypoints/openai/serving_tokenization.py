"""`POST /tokenize` and `POST /detokenize` (vLLM's extra endpoints), with the same tokenizer,
chat template, tokenizer thread and limits the generation endpoints use; `GET /tokenizer_info`
(vLLM's opt-in one, --enable-tokenizer-info-endpoint)."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from pagedllm.entrypoints.openai.request_checks import check_fields
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import OpenAIError


class OpenAIServingTokenization(OpenAIServingChat):
    """Tokenizes a prompt or a conversation; detokenizes token ids (400 if out of vocab)."""

    async def create_tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        self.check_request(request.model)
        check_fields(request)
        ids, token_strs = await self.in_tokenizer_thread(self._tokenize, request)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs
        )

    def _tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> tuple[list[int], list[str] | None]:
        if isinstance(request, TokenizeChatRequest):
            field = "messages"
            text = self.render_messages(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template,
                request.chat_template_kwargs,
                request.tools,
            )
        else:
            field, text = "prompt", request.prompt
        ids = self.tokenize_text(text, request.add_special_tokens, field)
        token_strs = None
        if request.return_token_strs:
            token_strs = self.tokenizer.convert_ids_to_tokens(ids)
        return ids, token_strs

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(request.model)
        check_fields(request)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:10]}", param="tokens"
            )
        text = await self.in_tokenizer_thread(self.tokenizer.decode, request.tokens)
        return DetokenizeResponse(prompt=text)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's `/tokenizer_info` body: the tokenizer's config (its `init_kwargs`, as in
        tokenizer_config.json) with `tokenizer_class`, the special tokens as strings and the
        chat template the server renders with (--chat-template, else the tokenizer's)."""
        tok = self.tokenizer
        config: dict[str, Any] = dict(getattr(tok, "init_kwargs", None) or {})
        config.pop("tokenizer_object", None)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if name in config or getattr(tok, name, None) is not None:
                config[name] = getattr(tok, name, None)
        config["tokenizer_class"] = type(tok).__name__
        template = self.options.chat_template or getattr(tok, "chat_template", None)
        if template:
            config["chat_template"] = template
        return _json_safe(config)


def _json_safe(value: Any) -> Any:
    """JSON values only: AddedToken-like objects become their text, others their repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    content = getattr(value, "content", None)
    return content if isinstance(content, str) else repr(value)
