"""The output constraint of a request, from whichever field the client used: OpenAI's chat
`response_format` (json_object, json_schema), vLLM's `structured_outputs` {json | regex |
choice | grammar} and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, and llama.cpp's `grammar` (GBNF). At most one per request.

Only the shape is checked here (the app imports no grammar library): whether the constraint
compiles is the engine's call, and its refusal names the `field` recorded in the constraint."""

from __future__ import annotations

import json
from typing import Any

from app.api.errors import bad_request
from ipc import protocol as P

MAX_SPEC_BYTES = 64 * 1024  # a constraint's text; bigger ones are refused ("grammar too large")

# vLLM's structured_outputs keys -> our kinds (json_object: a boolean flag)
VLLM_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar",
             "json_object": "json_object"}  # fmt: skip
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # fmt: skip
# Accepted and ignored inside structured_outputs: they tune vLLM's backends, not the output.
VLLM_IGNORED = frozenset(
    {"disable_fallback", "disable_any_whitespace", "disable_additional_properties",
     "whitespace_pattern", "backend"}
)  # fmt: skip
FIELDS = ("response_format", "structured_outputs", "grammar", *GUIDED_FIELDS)
JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def structured_of(body: dict[str, Any], kind: str) -> P.StructuredOutput | None:
    """The request's constraint, or None; a 400 naming the field for a malformed one."""
    given = [f for f in FIELDS if body.get(f) is not None]
    if kind == "chat" and _is_text_format(body.get("response_format")):
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"at most one output constraint per request; got {' and '.join(given)}",
                          given[1])  # fmt: skip
    if not given:
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        out = _response_format(value)
    elif name == "structured_outputs":
        out = _structured_outputs(value)
    elif name == "grammar":
        out = _constraint("grammar", value, "grammar")
    else:
        out = _constraint(GUIDED_FIELDS[name], value, name)
    size = len(out.spec.encode())
    if size > MAX_SPEC_BYTES:
        raise bad_request(f"{out.field}: grammar too large ({size} bytes; at most "
                          f"{MAX_SPEC_BYTES})", out.field, "grammar_too_large")  # fmt: skip
    return out


def _is_text_format(rf: Any) -> bool:
    return isinstance(rf, dict) and rf.get("type") == "text" and set(rf) == {"type"}


def _response_format(rf: Any) -> P.StructuredOutput:
    types = "'text', 'json_object' or 'json_schema'"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request(f"response_format must be an object with a type ({types})",
                          "response_format")  # fmt: skip
    kind = rf["type"]
    if kind == "text":
        raise bad_request("response_format {'type': 'text'} takes no other field",
                          "response_format")  # fmt: skip
    if kind == "json_object":
        if set(rf) != {"type"}:
            raise bad_request("response_format {'type': 'json_object'} takes no other field",
                              "response_format")  # fmt: skip
        return P.StructuredOutput(kind="json_object", spec="", field="response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be {types}, got {kind!r}",
                          "response_format.type")  # fmt: skip
    extra = set(rf) - {"type", "json_schema"}
    if extra:
        raise bad_request(f"response_format has unknown fields {sorted(extra)}", "response_format")
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise bad_request(f"{where} must be an object with name, schema, strict, description",
                          where)  # fmt: skip
    extra = set(js) - JSON_SCHEMA_KEYS
    if extra:
        raise bad_request(f"{where} has unknown fields {sorted(extra)} (allowed: "
                          f"{', '.join(sorted(JSON_SCHEMA_KEYS))})", where)  # fmt: skip
    name = js.get("name")
    if name is not None and not (isinstance(name, str) and 0 < len(name) <= 64):
        raise bad_request(f"{where}.name must be a string of 1 to 64 characters", f"{where}.name")
    for key in ("strict",):
        if js.get(key) is not None and not isinstance(js[key], bool):
            raise bad_request(f"{where}.{key} must be a boolean", f"{where}.{key}")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    if "schema" not in js:
        raise bad_request(f"{where}.schema is required (a JSON schema object)", f"{where}.schema")
    return _constraint("json", js["schema"], f"{where}.schema")


def _structured_outputs(so: Any) -> P.StructuredOutput:
    allowed = ", ".join(VLLM_KEYS)
    if not isinstance(so, dict):
        raise bad_request(f"structured_outputs must be an object with one of {allowed}",
                          "structured_outputs")  # fmt: skip
    unknown = set(so) - set(VLLM_KEYS) - VLLM_IGNORED
    if unknown:
        raise bad_request(f"structured_outputs has unknown fields {sorted(unknown)} (allowed: "
                          f"{allowed})", "structured_outputs")  # fmt: skip
    keys = [k for k in VLLM_KEYS if so.get(k) not in (None, False)]
    if len(keys) != 1:
        raise bad_request(f"structured_outputs must set exactly one of {allowed}; got "
                          f"{keys or 'none'}", "structured_outputs")  # fmt: skip
    key = keys[0]
    if key == "json_object":
        if so[key] is not True:
            raise bad_request("structured_outputs.json_object must be true",
                              "structured_outputs.json_object")  # fmt: skip
        return P.StructuredOutput(kind="json_object", spec="", field="structured_outputs")
    return _constraint(VLLM_KEYS[key], so[key], f"structured_outputs.{key}")


def _constraint(kind: str, value: Any, field: str) -> P.StructuredOutput:
    if kind == "json":
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"{field} must be a JSON schema (an object), not valid JSON",
                                  field) from None  # fmt: skip
        if not isinstance(value, (dict, bool)):
            raise bad_request(f"{field} must be a JSON schema (an object)", field)
        return P.StructuredOutput(kind="json", spec=json.dumps(value, ensure_ascii=False),
                                  field=field)  # fmt: skip
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
            raise bad_request(f"{field} must be a non-empty list of strings", field)
        return P.StructuredOutput(kind="choice", spec=json.dumps(value, ensure_ascii=False),
                                  field=field)  # fmt: skip
    if not isinstance(value, str) or not value.strip():
        what = "a regular expression" if kind == "regex" else "a grammar (GBNF)"
        raise bad_request(f"{field} must be {what}, a non-empty string", field)
    return P.StructuredOutput(kind=kind, spec=value, field=field)  # type: ignore[arg-type]
