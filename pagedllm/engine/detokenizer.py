"""Incremental detokenization and stop-string handling, per request, in the front end.

Fast tokenizers decode through `tokenizers.decoders.DecodeStream`, primed with the last few
prompt tokens so the first output token decodes in context (leading-space rules, multi-byte
characters split over tokens). Other tokenizers re-decode the output and emit the new suffix.

Stop strings are searched only in the window the new text can have completed. While a request
runs, the last `len(longest stop) - 1` characters are held back from the visible text, so a
stop string split over two steps never leaks into a streamed delta.
"""

from __future__ import annotations

import weakref
from typing import Any

from pagedllm.sampling_params import SamplingParams

# Prompt tokens fed to the stream before the first output token (context for decoding).
_PROMPT_CONTEXT_TOKENS = 6

# tokenizer backend -> ids of its special added tokens (computed once per tokenizer).
_SPECIAL_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def special_token_ids(backend: Any) -> frozenset[int]:
    """Ids of a `tokenizers.Tokenizer`'s special added tokens: what `skip_special_tokens`
    drops from the text."""
    ids = _SPECIAL_IDS.get(backend)
    if ids is None:
        added = backend.get_added_tokens_decoder()
        ids = frozenset(i for i, token in added.items() if token.special)
        _SPECIAL_IDS[backend] = ids
    return ids


class IncrementalDetokenizer:
    """Holds one request's output text; `update` appends tokens and reports a stop string."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = list(params.stop or ())
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        if self.include_stop:
            self.hold_back = 0
        self.output_text = ""
        self.token_ids: list[int] = []
        self._stream = None
        # Special tokens skipped from the text bypass the stream: they add no text, and the
        # stream re-decodes its whole pending window on each one (quadratic over a long run).
        self._skipped_ids: frozenset[int] = frozenset()
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(
            tokenizer, "_tokenizer", None
        )
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            if self.skip_special_tokens:
                self._skipped_ids = special_token_ids(backend)
            self._stream = DecodeStream(
                ids=self._clean_context(prompt_token_ids),
                skip_special_tokens=self.skip_special_tokens,
            )

    def _clean_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last few tokens, unless they end inside a multi-byte character (a
        token-id prompt can): the stream would then emit that dangling tail in front of the
        first output token, so it starts without context instead."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        try:
            text = self.tokenizer.decode(context, skip_special_tokens=self.skip_special_tokens)
        except Exception:
            return []
        return [] if text.endswith("\ufffd") else context

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Append tokens; return the stop string that ended the text, if any.

        `stop_terminated` means the last token already stopped the request (EOS / stop id):
        its text is shown only with include_stop_str_in_output (vLLM's rule); its id is kept."""
        if self.include_stop:
            stop_terminated = False
        start = len(self.output_text)
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            if stop_terminated and i == len(new_token_ids) - 1:
                break
            self.output_text += self._decode_next(token_id)
        if not self.stop:
            return None
        return self._check_stop_strings(start)

    def _decode_next(self, token_id: int) -> str:
        if token_id in self._skipped_ids:
            return ""
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:
                # An id the tokenizer cannot decode (e.g. padding rows of the embedding).
                return ""
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        # The previous text is a prefix of the new decode except across a split character.
        new = full[len(self.output_text) :] if full.startswith(self.output_text) else ""
        return new

    def _check_stop_strings(self, new_text_start: int) -> str | None:
        text = self.output_text
        for stop in self.stop:
            # A stop string completed by the new text starts at most len(stop)-1 before it.
            idx = text.find(stop, max(0, new_text_start - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.include_stop else idx
                self.output_text = text[:end]
                return stop
        return None

    def get_text(self, finished: bool, delta: bool, sent: int) -> tuple[str, int]:
        """Visible text (or the part after `sent` chars when `delta`), and the new `sent`."""
        text = self.output_text
        if not finished and self.hold_back:
            text = text[: max(len(text) - self.hold_back, sent)]
        if delta:
            return text[sent:], len(text)
        return text, len(text)


def decode_token(tokenizer: Any, token_id: int) -> str:
    """A single token's text for logprobs entries (vLLM shows each token on its own)."""
    try:
        return tokenizer.decode([token_id])
    except Exception:
        return ""
