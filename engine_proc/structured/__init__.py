"""Structured output: constraints (JSON schema, regex, choice, GBNF grammar) compiled with
xgrammar off the step loop and enforced as a per-step token mask (docs/STRUCTURED.md)."""
