"""The xgrammar backend: spec -> grammar -> compiled grammar -> one matcher per request.

`build_grammar` turns a `StructuredOutputsParams` into an `xgrammar.Grammar` without any
tokenizer; the front end calls it to reject a bad schema, regex or grammar with the compiler's
message (`StructuredOutputValidator`), and the engine core compiles the very same grammar, so
what passed validation compiles there too.

`XgrammarBackend` holds the tokenizer's `TokenizerInfo` (sized to the model's vocabulary, which
may be padded past the tokenizer's: the padding ids are never allowed) and a `GrammarCompiler`.
Special tokens other than the stop tokens are hidden from the grammar (their text, such as
"<|user|>", would otherwise count as literal characters and then vanish on detokenization).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; users need what follows.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s+")
_CHECK_PREFIX = re.compile(r"^Check failed: .*? is false: ")
# Whitespace characters allowed in one gap of JSON output (between tokens of the JSON syntax).
# Enough for pretty-printing, yet a model that keeps choosing whitespace cannot run away.
JSON_MAX_WHITESPACE = 20
# How xgrammar prints a character of a JSON string (length-limited, then any), and what it
# should be (see _strict_json_strings).
_LOOSE_STRING_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_STRICT_STRING_CHARS = r"[^\0-\x1f\"\\\ud800-\udfff]"
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def compiler_message(error: BaseException) -> str:
    """xgrammar's error text without its source-location prefix."""
    text = str(error).strip()
    text = _CPP_PREFIX.sub("", text)
    return _CHECK_PREFIX.sub("", text)


def build_grammar(params: StructuredOutputsParams) -> xgr.Grammar:
    """The xgrammar `Grammar` of a spec. Raises ValueError with the compiler's message."""
    import xgrammar as xgr

    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = params.json_schema_text if kind == "json" else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(
                schema,
                any_whitespace=not params.disable_any_whitespace,
                max_whitespace_cnt=JSON_MAX_WHITESPACE,
                strict_mode=kind == "json",
            )
            return _strict_json_strings(grammar)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        if "::=" in params.grammar:
            return xgr.Grammar.from_ebnf(params.grammar)
        return xgr.Grammar.from_lark(params.grammar)
    except (RuntimeError, ValueError) as e:
        raise ValueError(
            f"invalid {_WHAT[kind]} in structured outputs: {compiler_message(e)}"
        ) from e


def _strict_json_strings(grammar: xgr.Grammar) -> xgr.Grammar:
    """xgrammar (0.2.x) lets two kinds of invalid JSON string characters through: raw control
    characters in length-limited strings (minLength / maxLength), and UTF-8-encoded UTF-16
    surrogates (invalid UTF-8, decoded as 3 replacement characters, so maxLength breaks) in
    all strings. Re-parse the grammar text with both excluded (this only ever removes invalid
    output); keep the original if the text does not round-trip."""
    import xgrammar as xgr

    text = str(grammar)
    fixed = text
    for loose in _LOOSE_STRING_CHARS:
        fixed = fixed.replace(loose, _STRICT_STRING_CHARS)
    if fixed == text:
        return grammar
    try:
        return xgr.Grammar.from_ebnf(fixed)
    except RuntimeError:
        return grammar


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choices` (JSON string escapes are valid EBNF
    string escapes for xgrammar)."""
    import json

    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class StructuredOutputValidator:
    """The front end's check of `SamplingParams.structured_outputs`: calling it raises
    ValueError unless the spec's grammar builds (no-op without structured outputs). The last
    `max_cached` specs that passed are remembered, so a server that sees one schema over and
    over pays a dict lookup, not a grammar build, per request."""

    def __init__(self, max_cached: int = 256) -> None:
        self.max_cached = max_cached
        self._valid: OrderedDict[tuple, None] = OrderedDict()

    def __call__(self, params: Any) -> None:
        spec = getattr(params, "structured_outputs", None)
        if spec is None:
            return
        key = spec.cache_key()
        if key in self._valid:
            self._valid.move_to_end(key)
            return
        build_grammar(spec)
        self._valid[key] = None
        if len(self._valid) > self.max_cached:
            self._valid.popitem(last=False)


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """TokenizerInfo over the model's `vocab_size` ids, with `stop_token_ids` as the stop tokens
    and every other special token blanked out (never allowed by a grammar)."""
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    stops = sorted({t for t in stop_token_ids if 0 <= t < vocab_size}) or None
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return info  # xgrammar decodes other vocabularies itself; keep its view
    # Special tokens are blanked, stop tokens among them: xgrammar 0.2.9 (not 0.2.8) also
    # matches a stop token's text as ordinary bytes ("<|end|>" inside a regex over "<|>a-z"),
    # which would let a grammar allow it mid-output; as stop_token_ids they stay allowed
    # exactly where the grammar may end.
    hidden = {i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if tok.special}
    hidden.update(getattr(tokenizer, "all_special_ids", []))
    hidden.update(stops or [])
    if not hidden:
        return info
    encoded = [""] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i < vocab_size and i not in hidden:
            encoded[i] = token
    return xgr.TokenizerInfo(
        encoded,
        info.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=stops,
        add_prefix_space=info.add_prefix_space,
    )


class XgrammarGrammar:
    """One request's position in its grammar (an xgrammar matcher, with unlimited rollback).
    Speculative decoding checks drafts with `validate_tokens` and walks them tentatively
    (`accept_token`, then `rollback`) to fill one bitmask row per draft position."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 bits, 1 = allowed)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        """Whether the grammar has accepted a stop token (nothing may follow)."""
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar accepts from here (state unchanged).
        Nothing is accepted after a stop token."""
        num_valid = 0
        for token_id in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token_id):
                break
            num_valid += 1
        self.rollback(num_valid)
        return token_ids[:num_valid]


class XgrammarBackend:
    """Compiles specs for one tokenizer and vocabulary. Thread-safe: compiles may run on
    several threads at once (xgrammar's compiler is)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 2
    ) -> None:
        import xgrammar as xgr

        self.tokenizer_info = build_tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # The manager keeps its own bounded cache; xgrammar's is unbounded by default.
        self.compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=max_threads, cache_enabled=False
        )

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """Compile a spec. Raises ValueError with the compiler's message."""
        grammar = build_grammar(params)
        try:
            return self.compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"cannot compile the grammar: {compiler_message(e)}") from e

    def new_grammar(self, compiled: xgr.CompiledGrammar) -> XgrammarGrammar:
        return XgrammarGrammar(compiled)
