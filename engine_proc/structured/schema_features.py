"""Which JSON-schema keywords the grammar can enforce. xgrammar compiles a schema with a keyword
it does not know by ignoring the keyword (`multipleOf`, `not`, `uniqueItems`, ...): the output
would then follow a looser schema than the client asked for. Such a schema is refused instead,
naming the keyword and where it is."""

from __future__ import annotations

from typing import Any

# Keywords xgrammar 0.2 turns into grammar rules (docs: "Supported JSON Schema").
ENFORCED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minProperties", "maxProperties",
})  # fmt: skip
# Annotations: they describe, they do not constrain.
ANNOTATIONS = frozenset({
    "$schema", "$id", "$comment", "title", "description", "default", "examples", "deprecated",
    "readOnly", "writeOnly", "$anchor", "contentMediaType", "contentEncoding", "discriminator",
    "strict", "name",
})  # fmt: skip
FORMATS = frozenset({
    "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})  # fmt: skip
# Keywords whose value is one schema, a list of schemas, or a map of name -> schema.
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then",
        "else", "unevaluatedItems", "unevaluatedProperties", "additionalItems")  # fmt: skip
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


class UnsupportedFeature(ValueError):
    """A schema keyword the grammar cannot enforce; `feature` names it, `path` where it is."""

    def __init__(self, feature: str, path: str, why: str = "is not supported") -> None:
        super().__init__(f"the JSON schema keyword '{feature}' at {path} {why}")
        self.feature = feature
        self.path = path


def check_schema(schema: Any, path: str = "#") -> None:
    """Raise UnsupportedFeature for the first keyword (depth first) the grammar cannot enforce."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise UnsupportedFeature(
            "(schema)", path, f"must be an object or a boolean, got {type(schema).__name__}"
        )
    for key, value in schema.items():
        where = f"{path}/{key}"
        if key in ANNOTATIONS or key.startswith("x-"):
            continue
        if key not in ENFORCED:
            raise UnsupportedFeature(key, path)
        if key == "format" and value not in FORMATS:
            raise UnsupportedFeature(
                f"format: {value}",
                path,
                f"is not a supported format ({', '.join(sorted(FORMATS))})",
            )
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise UnsupportedFeature("allOf", path, "with more than one schema is not supported")
        if key in _ONE and isinstance(value, (dict, bool)):
            check_schema(value, where)
        elif key in _LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}/{i}")
        elif key in _MAP and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}/{name}")
