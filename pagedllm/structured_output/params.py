"""What a user asks structured outputs for: `StructuredOutputsParams` (vLLM's name and fields).

Exactly one constraint is set per request: a JSON schema (`json`), any JSON object
(`json_object`), a regular expression (`regex`), one of several strings (`choice`) or a grammar
(`grammar`, EBNF/GBNF as xgrammar reads it, or Lark). The struct is plain msgspec data, so it
rides inside `SamplingParams` through the msgpack boundary to the engine core unchanged.
`GuidedDecodingParams` is vLLM's older name for the same thing (with its `backend` field).

Only cheap, local checks happen here (types, one constraint, the JSON text parses); whether the
schema, regex or grammar compiles is checked by the front end (`StructuredOutputValidator`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

# The constraint fields, in the order error messages name them.
CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object")
BACKENDS = (None, "auto", "xgrammar")


class StructuredOutputsParams(
    msgspec.Struct,
    omit_defaults=True,  # type: ignore[call-arg]
    repr_omit_defaults=True,  # type: ignore[call-arg]
    kw_only=True,  # type: ignore[call-arg]
):
    """One output constraint. Raises `ValueError` naming the fields unless exactly one of
    `json`, `regex`, `choice`, `grammar`, `json_object` is set.

    `json` is a JSON schema as a dict or as JSON text. `disable_any_whitespace` makes JSON
    output compact (no optional whitespace between tokens). `disable_fallback` and
    `disable_additional_properties` are accepted for vLLM compatibility: there is one backend,
    and JSON schemas are compiled strictly (no properties beyond the schema's) either way.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [f for f in CONSTRAINT_FIELDS if is_set(getattr(self, f))]
        if len(given) != 1:
            what = " and ".join(given) if given else "none"
            raise ValueError(
                "structured outputs need exactly one of "
                f"{', '.join(CONSTRAINT_FIELDS)} to be set, got {what}"
            )
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    parsed = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from e
                if not isinstance(parsed, (dict, bool)):
                    raise ValueError(
                        f"structured_outputs.json must be a JSON schema object, got {self.json!r}"
                    )
            elif not isinstance(self.json, dict):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema (a dict or JSON text), got "
                    f"{type(self.json).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got "
                f"{self.choice!r}"
            )
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar "
                "backend; use disable_any_whitespace=True for compact JSON"
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_FIELDS."""
        return next(f for f in CONSTRAINT_FIELDS if is_set(getattr(self, f)))

    @property
    def json_schema_text(self) -> str:
        """The JSON schema as JSON text, for `json` specs. Key order is kept: it is the order in
        which properties are generated."""
        if isinstance(self.json, str):
            return self.json
        return json.dumps(self.json, ensure_ascii=False)

    def cache_key(self) -> tuple[str, str, bool]:
        """Equal for specs that compile to the same grammar: (kind, spec text, compact)."""
        kind = self.kind
        if kind == "json":
            text = self.json_schema_text
        elif kind == "choice":
            text = json.dumps(self.choice, ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = getattr(self, kind)
        compact = self.disable_any_whitespace and kind in ("json", "json_object")
        return kind, text, compact


class GuidedDecodingParams(StructuredOutputsParams, kw_only=True):  # type: ignore[call-arg]
    """vLLM's older name for `StructuredOutputsParams`; `backend` may only name xgrammar."""

    backend: str | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"guided decoding backend={self.backend!r} is not available; pagedllm uses "
                "'xgrammar'"
            )
        super().__post_init__()


def as_structured_outputs_params(value: Any) -> StructuredOutputsParams | None:
    """`SamplingParams.structured_outputs` as given -> the struct: None and structs pass through,
    a dict of the struct's fields is converted (unknown keys are a ValueError)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(StructuredOutputsParams.__struct_fields__))
        if unknown:
            raise ValueError(
                f"structured_outputs has unknown fields {unknown}; allowed: "
                f"{', '.join(StructuredOutputsParams.__struct_fields__)}"
            )
        return StructuredOutputsParams(**value)
    raise ValueError(
        "structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
        f"{type(value).__name__}"
    )


def is_set(value: Any) -> bool:
    return value is not None and value is not False
