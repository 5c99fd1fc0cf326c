"""Twenty JSON schemas of the shapes agents send (nested objects, bounded arrays, enums, anyOf,
$defs/$ref, string patterns, bounded numbers, additionalProperties false), shared by the
structured-output benchmark (engine_proc/bench/structured.py) and the API acceptance test.
Strings are bounded (maxLength / patterns) so a small model sampled at temperature 1 cannot
wander past max_tokens inside one string."""

from __future__ import annotations

from typing import Any

_S = {"type": "string", "maxLength": 12}  # a short free string


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "address": _obj({
        "name": _S,
        "address": _obj({"street": _S, "city": _S,
                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    }),
    "tags": _obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                           "minItems": 1, "maxItems": 3}}),
    "enums": _obj({"color": {"enum": ["red", "green", "blue"]},
                   "size": {"type": "string", "enum": ["S", "M", "L"]}}),
    "any_of": _obj({"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                        {"type": "string", "maxLength": 8}]}}),
    "defs_ref": {
        "$defs": {"point": _obj({"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                 "y": {"type": "integer", "minimum": -99, "maximum": 99}})},
        **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "patterns": _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
                      "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}}),
    "bounded_numbers": _obj({
        "celsius": {"type": "integer", "minimum": -50, "maximum": 50},
        "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    }),
    "nullable": _obj({"active": {"type": "boolean"},
                      "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 10}]}}),
    "todo_list": _obj({"items": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": _obj({"id": {"type": "integer", "minimum": 1, "maximum": 99},
                       "done": {"type": "boolean"}}),
    }}),
    "matrix": _obj({"rows": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                  "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    }}),
    "consts": _obj({"version": {"const": 1}, "kind": {"const": "event"}, "name": _S}),
    "shapes": _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "integer", "minimum": 1,
                                                      "maximum": 9}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "integer", "minimum": 1,
                                                    "maximum": 9}}),
    ]}}),
    "optional_fields": _obj({"title": _S, "subtitle": _S, "pages": {"type": "integer",
                                                                  "minimum": 1, "maximum": 999}},
                            required=["title"]),
    "mixed_enums": _obj({"priority": {"enum": [1, 2, 3]},
                         "status": {"enum": ["open", "closed", None]}}),
    "date": _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                  "event": _S}),
    "weekdays": _obj({"days": {"type": "array", "minItems": 1, "maxItems": 3,
                               "items": {"enum": ["mon", "tue", "wed", "thu", "fri"]}}}),
    "exclusive_bounds": _obj({
        "score": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
        "label": {"type": "string", "minLength": 1, "maxLength": 6},
    }),
    "deep": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "string",
                                                           "maxLength": 5}})})})}),
    "refs_in_array": {
        "$defs": {"user": _obj({"name": _S, "role": {"enum": ["admin", "guest"]}})},
        **_obj({"owner": {"$ref": "#/$defs/user"},
                "members": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/user"}}}),
    },
}
assert len(SCHEMAS) == 20
