"""Turns the logits of the last position of each sampling sequence into next tokens.

Each sequence draws from its own torch.Generator, so a seeded request samples the same tokens
whatever else shares its batch."""

from __future__ import annotations

import torch

from engine_proc.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int]:
    """logits: [N, vocab] float32 on any device."""
    assert logits.shape[0] == len(params) == len(generators)
    tokens = logits.argmax(dim=-1).tolist()
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = _filtered_probs(logits[rows], [params[i] for i in rows])
        for row, i in enumerate(rows):
            # Exponential race (Gumbel-max in disguise): argmax p / E with E ~ Exp(1) samples p.
            # One draw per vocabulary entry from this sequence's own generator.
            noise = torch.empty(probs.shape[1], device="cpu").exponential_(generator=generators[i])
            tokens[i] = int((probs[row].cpu() / noise).argmax())
    return tokens


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    top_k = torch.tensor([p.top_k for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    need_k = bool((top_k > 0).any())
    need_p = bool((top_p < 1).any())
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=device)[None, :]
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            drop |= (top_k[:, None] > 0) & (rank >= top_k[:, None])
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        if need_p:
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest set whose mass reaches top_p: drop a token when the mass of
            # the tokens strictly before it already reaches top_p (the first is always kept).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits.softmax(dim=-1)
