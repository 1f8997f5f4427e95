"""Specs shared by the structured-output tests, with checkers of their languages.

Every valid output of these specs is short enough for the tiny model's 512-token context, so a
random-weight model, constrained, always reaches the end of the grammar.
"""

from __future__ import annotations

import json
import re

import jsonschema

# Nested objects, arrays, enums, required fields and integer ranges; strings and arrays are
# length-bounded so that a random-weight model always reaches the end of the grammar.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 5},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "role", "address", "tags"],
}

# Small enough that even with the default whitespace (at most 20 characters per gap) every
# valid output fits in max_tokens.
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
}

EMAIL_REGEX = r"[a-z]{2,8}\.[a-z]{2,8}@(example|test)\.(com|org)"
CHOICES = ["yes", "no", "it depends", "42", 'naïve "quoted"']
# A bounded EBNF grammar (checked below with an equivalent regex): a small arithmetic sum.
SUM_GRAMMAR = """
root ::= term (" " op " " term){0,3} " = ?"
term ::= number | "(" number ")"
number ::= [1-9] [0-9]{0,2}
op ::= "+" | "-" | "*"
"""
_NUMBER = r"[1-9]\d{0,2}"
_TERM = rf"({_NUMBER}|\({_NUMBER}\))"
SUM_REGEX = rf"{_TERM}( [+\-*] {_TERM}){{0,3}} = \?"


def check_json(text: str, schema: dict) -> dict:
    """The parsed output; raises unless it is JSON valid against `schema`."""
    value = json.loads(text)
    jsonschema.validate(value, schema)
    return value


def in_sum_language(text: str) -> bool:
    return re.fullmatch(SUM_REGEX, text) is not None
