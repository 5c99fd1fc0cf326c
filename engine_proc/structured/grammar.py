"""One constraint (kind, spec) compiled against the model's tokenizer with xgrammar
(docs/STRUCTURED.md says why xgrammar). Compiling is slow (milliseconds to seconds) and happens
on engine_proc/structured/compiler.py's worker thread; xgrammar releases the GIL meanwhile."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import xgrammar as xgr

from engine_proc.structured.schema_features import UnsupportedFeature, check_schema


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the API field it came from."""


def grammar_key(kind: str, spec: str) -> str:
    """The cache key: a digest of the constraint (the tokenizer is the engine's, fixed)."""
    return hashlib.sha256(f"{kind}\0{spec}".encode()).hexdigest()


def tokenizer_info(tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> Any:
    """xgrammar's view of the vocabulary: the logits' width (a model may pad it past the
    tokenizer's) and the tokens that end a completed output."""
    stop = sorted(eos_token_ids) or None
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)


def compile_constraint(compiler: Any, kind: str, spec: str, field: str) -> Any:
    """xgrammar's CompiledGrammar for the constraint; GrammarError naming `field` otherwise."""
    try:
        if kind == "json":
            schema = _json(spec, field, "a JSON schema")
            check_schema(schema)
            # Compact separators, no free whitespace: a small model sampled at temperature 1
            # would otherwise fill the reply with spaces and newlines.
            return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            choices = _json(spec, field, "a JSON list of strings")
            if not (isinstance(choices, list) and choices
                    and all(isinstance(c, str) for c in choices)):  # fmt: skip
                raise GrammarError(f"{field}: choice must be a non-empty list of strings")
            rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return compiler.compile_grammar(f"root ::= {rule}")
        if kind == "grammar":
            return compiler.compile_grammar(spec)
    except UnsupportedFeature as exc:
        raise GrammarError(f"{field}: {exc}") from None
    except GrammarError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError (parse errors, unsatisfiable, ...)
        raise GrammarError(f"{field}: invalid {kind} constraint: {_short(exc)}") from None
    raise GrammarError(f"{field}: unknown constraint kind {kind!r}")


def _json(spec: str, field: str, what: str) -> Any:
    try:
        return json.loads(spec)
    except ValueError as exc:
        raise GrammarError(f"{field}: must be {what}, not valid JSON ({exc})") from None


def _short(exc: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0]:
            text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(exc).__name__
