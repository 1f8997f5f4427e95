"""`StructuredOutputsParams`: one constraint per request, vLLM's old name, the msgpack round
trip inside SamplingParams, and the OpenAI request fields that map onto it."""

from __future__ import annotations

import msgspec
import pytest

from pagedllm import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from pagedllm.engine import EngineCoreRequest
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(json=SCHEMA),
        dict(json='{"type": "string"}'),
        dict(regex="[0-9]+"),
        dict(choice=["a", "b"]),
        dict(grammar='root ::= "x"'),
        dict(json_object=True),
    ],
)
def test_exactly_one_constraint(kwargs):
    params = StructuredOutputsParams(**kwargs)
    assert params.kind == next(iter(kwargs))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "exactly one of json, regex, choice, grammar, json_object .* got none"),
        (dict(json=SCHEMA, regex="a"), "got json and regex"),
        (dict(json_object=False), "got none"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", 1]), "choice must be a non-empty list"),
        (dict(regex=""), "regex must be a non-empty string"),
        (dict(json="{not json"), "json is not valid JSON"),
        (dict(json=[1]), "must be a JSON schema"),
        (dict(regex="a", whitespace_pattern=" *"), "whitespace_pattern is not supported"),
    ],
)
def test_invalid_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_accepts_old_name_and_dicts():
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+", backend="xgrammar"))
    assert old.structured_outputs.regex == "a+"
    as_dict = SamplingParams(structured_outputs={"choice": ["x", "y"]})
    assert as_dict.structured_outputs == StructuredOutputsParams(choice=["x", "y"])
    with pytest.raises(ValueError, match="not available"):
        GuidedDecodingParams(regex="a", backend="outlines")
    with pytest.raises(ValueError, match="unknown fields \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(ValueError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_msgpack_round_trip_inside_engine_core_request():
    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    )
    request = EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling_params=params, arrival_time=0.0
    )
    decoded = msgspec.msgpack.Decoder(EngineCoreRequest).decode(msgspec.msgpack.encode(request))
    spec = decoded.sampling_params.structured_outputs
    assert isinstance(spec, StructuredOutputsParams)
    assert spec == params.structured_outputs
    assert list(spec.json["properties"]) == ["b", "a"]  # property order survives
    assert spec.cache_key() == params.structured_outputs.cache_key()
    assert params.clone().structured_outputs == spec


def test_cache_key_separates_specs():
    keys = {
        StructuredOutputsParams(json=SCHEMA).cache_key(),
        StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True).cache_key(),
        StructuredOutputsParams(regex="a").cache_key(),
        StructuredOutputsParams(grammar="a").cache_key(),
        StructuredOutputsParams(choice=["a"]).cache_key(),
    }
    assert len(keys) == 5
    assert (
        StructuredOutputsParams(regex="a", disable_any_whitespace=True).cache_key()
        == StructuredOutputsParams(regex="a").cache_key()
    )


# ---- the OpenAI request fields -------------------------------------------------------------


def _spec(**fields):
    request = CompletionRequest(prompt="hi", **fields)
    return request.to_sampling_params(16, {}).structured_outputs


def test_response_format_maps_to_params():
    schema_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    assert _spec(response_format=schema_format) == StructuredOutputsParams(json=SCHEMA)
    assert _spec(response_format={"type": "json_object"}).json_object is True
    assert _spec(response_format={"type": "text"}) is None
    assert _spec() is None
    chat = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        response_format={**schema_format, "json_schema": {**schema_format["json_schema"],
                                                           "strict": True}},
        structured_outputs={"disable_any_whitespace": True},
    )  # fmt: skip
    spec = chat.to_sampling_params(16, {}).structured_outputs
    assert spec == StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


def test_vllm_extra_fields_map_to_params():
    assert _spec(guided_json=SCHEMA).json == SCHEMA
    assert _spec(guided_regex="a+").regex == "a+"
    assert _spec(guided_choice=["a", "b"]).choice == ["a", "b"]
    assert _spec(guided_grammar='root ::= "a"').grammar == 'root ::= "a"'
    assert _spec(structured_outputs={"regex": "b"}).regex == "b"
    assert _spec(guided_regex="a", guided_decoding_backend="xgrammar").regex == "a"


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(guided_regex="a", guided_json=SCHEMA), "only one .* guided_json and guided_regex"),
        (
            dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
            "response_format and structured_outputs",
        ),
        (dict(response_format={"type": "json_schema"}), "needs json_schema.schema"),
        (dict(structured_outputs={"regex": "a", "foo": 1}), "unknown fields \\['foo'\\]"),
        (dict(guided_regex="a", guided_decoding_backend="outlines"), "not available"),
        (dict(structured_outputs={"disable_any_whitespace": True}), "exactly one of"),
    ],
)
def test_conflicting_or_malformed_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        _spec(**fields)
