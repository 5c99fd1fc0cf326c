"""Helpers of the server tests that drive an engine process (tests/engine_proc/server/conftest.py
starts it)."""

from __future__ import annotations

from engine_proc.sampling_params import SamplingParams

NUM_BLOCKS = 512
_REFERENCE: list = []  # the in-process reference engine, once the conftest has built it


def greedy(reference, prompt: str, max_tokens: int) -> list[int]:
    out = reference.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return out[0].token_ids


def _prompt(i: int) -> str:
    return f"request {i}: " + "abcdefgh"[i % 8] * (3 + i % 11)
