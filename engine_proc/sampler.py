"""Turns the logits of the last position of each sampling sequence into next tokens.

Randomness is counter-based: the noise for output position t of a sequence is a fixed function
of (seed, t, token id). A seeded request therefore samples the same tokens whatever else shares
its batch, and a preempted request that is recomputed draws exactly what it would have drawn:
tiny float differences of a recomputed prefill cannot shift a random stream."""

from __future__ import annotations

import torch

from engine_proc.sampling_params import SamplingParams

# Top-k / top-p look at this many best candidates first; the full vocabulary is sorted only
# when they do not hold the nucleus (a nearly flat distribution).
_CANDIDATES = 256


def sample(
    logits: torch.Tensor, params: list[SamplingParams], seeds: list[int], positions: list[int]
) -> list[int]:
    """logits: [N, vocab] float32 on any device; positions: index of the token being drawn."""
    assert logits.shape[0] == len(params) == len(seeds) == len(positions)
    tokens = logits.argmax(dim=-1).tolist()
    if all(p.greedy for p in params):
        return tokens
    host = logits.float().cpu()  # one device-to-host copy for every sampled row
    for i, p in enumerate(params):
        if not p.greedy:
            noise = _noise(logits.shape[1], seeds[i], positions[i])
            tokens[i] = _sample_row(host[i], p, noise)
    return tokens


def _noise(vocab_size: int, seed: int, position: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed((seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % 2**63)
    return torch.empty(vocab_size).exponential_(generator=g)


def _sample_row(logits: torch.Tensor, p: SamplingParams, noise: torch.Tensor) -> int:
    probs = (logits / p.temperature).softmax(dim=-1)
    if p.top_k == 0 and p.top_p >= 1.0:
        return int((probs / noise).argmax())
    k = min(probs.shape[0], p.top_k or _CANDIDATES)
    cand_probs, cand_ids = probs.topk(k)
    if p.top_p < 1.0:
        if not p.top_k and float(cand_probs.sum()) < p.top_p:
            cand_probs, cand_ids = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is dropped when the mass
        # strictly before it already reaches top_p (the first is always kept). With top_k the
        # mass is renormalised over the k kept tokens first, as in vLLM and transformers.
        mass = cand_probs / cand_probs.sum() if p.top_k else cand_probs
        keep = int(((mass.cumsum(0) - mass) < p.top_p).sum())
        cand_probs, cand_ids = cand_probs[:keep], cand_ids[:keep]
    # Exponential race (Gumbel-max in disguise): argmax p / E with E ~ Exp(1) draws from p.
    return int(cand_ids[(cand_probs / noise[cand_ids]).argmax()])
