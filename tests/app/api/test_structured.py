"""app/api/structured.py: every way a client asks for a constraint becomes one
StructuredOutput naming the field it came from; malformed ones are a 400 naming the field."""

from __future__ import annotations

import json

import pytest

from app.api.errors import APIError
from app.api.requests import Limits, parse_chat, parse_completion
from app.api.structured import MAX_SPEC_BYTES

LIMITS = Limits(max_model_len=512, max_tokens=512)
CHAT = {"messages": [{"role": "user", "content": "x"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def _chat(**fields):
    return parse_chat({**CHAT, **fields}, LIMITS).sampling.structured


def _completion(**fields):
    return parse_completion({"prompt": "x", **fields}, LIMITS).sampling.structured


@pytest.mark.parametrize(
    ("fields", "kind", "spec", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "thing", "schema": SCHEMA, "strict": True, "description": "d"}}},
         "json", SCHEMA, "response_format.json_schema.schema"),
        ({"structured_outputs": {"json": SCHEMA}}, "json", SCHEMA, "structured_outputs.json"),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json", SCHEMA,
         "structured_outputs.json"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+",
         "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice", ["a", "b"],
         "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": 'root ::= "a"', "disable_fallback": True}},
         "grammar", 'root ::= "a"', "structured_outputs.grammar"),
        ({"guided_json": SCHEMA}, "json", SCHEMA, "guided_json"),
        ({"guided_regex": "[0-9]"}, "regex", "[0-9]", "guided_regex"),
        ({"guided_choice": ["x"]}, "choice", ["x"], "guided_choice"),
        ({"guided_grammar": 'root ::= "b"'}, "grammar", 'root ::= "b"', "guided_grammar"),
        ({"grammar": 'root ::= "c"'}, "grammar", 'root ::= "c"', "grammar"),
    ],
)  # fmt: skip
def test_each_field_becomes_one_constraint(fields, kind, spec, field) -> None:
    so = _chat(**fields)
    assert (so.kind, so.field) == (kind, field)
    decoded = json.loads(so.spec) if kind in ("json", "choice") else so.spec
    assert decoded == spec
    if "response_format" not in fields:  # completions take all but response_format
        assert _completion(**fields) == so


def test_no_constraint_and_text_format_are_none() -> None:
    assert _chat() is None
    assert _chat(response_format={"type": "text"}) is None
    assert _completion() is None


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        ({"response_format": "json"}, "response_format", "type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "required"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema.schema", "JSON schema"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"schema": {}, "strict": "yes"}}},
         "response_format.json_schema.strict", "boolean"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
         "response_format.json_schema", "unknown"),
        ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs",
         "exactly one"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs", "unknown"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "valid JSON"),
        ({"guided_regex": 5}, "guided_regex", "regular expression"),
        ({"grammar": ""}, "grammar", "non-empty"),
        ({"grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_regex", "at most one"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
         "structured_outputs", "at most one"),
        ({"grammar": "root ::= " + '"a" ' * MAX_SPEC_BYTES}, "grammar", "grammar too large"),
    ],
)  # fmt: skip
def test_malformed_constraints_are_400s_naming_the_field(fields, param, words) -> None:
    with pytest.raises(APIError) as err:
        _chat(**fields)
    assert err.value.status == 400 and err.value.param == param
    assert words in err.value.message


def test_completions_have_no_response_format() -> None:
    with pytest.raises(APIError) as err:
        _completion(response_format={"type": "json_object"})
    assert err.value.param == "response_format"
