"""`POST /tokenize` and `POST /detokenize` (vLLM's extra endpoints), with the same tokenizer
and chat template the generation endpoints use."""

from __future__ import annotations

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
        if isinstance(request, TokenizeChatRequest):
            text = self.render_messages(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template,
                request.chat_template_kwargs,
                request.tools,
            )
        else:
            text = request.prompt
        ids = self.tokenize_text(text, add_special_tokens=request.add_special_tokens)
        token_strs = None
        if request.return_token_strs:
            token_strs = self.tokenizer.convert_ids_to_tokens(ids)
        return TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=token_strs
        )

    async def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_request(request.model)
        check_fields(request)
        vocab = self.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(
                f"token ids out of the vocabulary (0..{vocab - 1}): {bad[:10]}", param="tokens"
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
