"""Structured-output fields of the OpenAI-compatible API, mapped to `StructuredOutputsParams`.

Accepted on both /v1/chat/completions and /v1/completions:
- OpenAI's `response_format`: `{"type": "text"}` (no constraint), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's older extra fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (with `guided_decoding_backend` / `guided_whitespace_pattern` checked, not used);
- vLLM's `structured_outputs` object: the fields of `StructuredOutputsParams`. Its options
  (e.g. `disable_any_whitespace`) also apply to a constraint given by one of the fields above.

A request sets at most one constraint; two are a 400 naming both. A schema, regex or grammar
the compiler rejects is a 400 with its message (checked by the engine's Processor).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedllm.structured_output.params import (
    BACKENDS,
    CONSTRAINT_FIELDS,
    StructuredOutputsParams,
    as_structured_outputs_params,
    is_set,
)


class JsonSchemaResponseFormat(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema (`schema` is the JSON schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class StructuredOutputsRequestMixin(BaseModel):
    """The request fields above and their translation (`to_structured_outputs`)."""

    model_config = ConfigDict(extra="allow")

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def to_structured_outputs(
        self, implied: dict[str, dict[str, Any]] | None = None
    ) -> StructuredOutputsParams | None:
        """The request's constraint, or None. `implied` adds constraints other fields imply
        (chat's tool_choice: {"tool_choice": {"json": schema}}). Raises ValueError for
        conflicting or malformed fields."""
        constraints: dict[str, dict[str, Any]] = dict(implied or {})
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            constraints["response_format"] = {"json_object": True}
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError(
                    "response_format of type 'json_schema' needs json_schema.schema (the JSON "
                    "schema of the output)"
                )
            constraints["response_format"] = {"json": fmt.json_schema.json_schema}
        for name, field in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                constraints[name] = {field: value}
        options = dict(self.structured_outputs or {})
        if any(is_set(options.get(f)) for f in CONSTRAINT_FIELDS):
            constraints["structured_outputs"] = {}
        if self.guided_whitespace_pattern is not None:
            options["whitespace_pattern"] = self.guided_whitespace_pattern
        if len(constraints) > 1:
            raise ValueError(
                "a request may set only one structured-output constraint, got "
                + " and ".join(constraints)
            )
        if self.guided_decoding_backend not in BACKENDS:
            raise ValueError(
                f"guided_decoding_backend={self.guided_decoding_backend!r} is not available; "
                "pagedllm uses 'xgrammar'"
            )
        if not constraints and not options:
            return None
        for constraint in constraints.values():
            options.update(constraint)
        return as_structured_outputs_params(options)
