"""Routed experts in place of a layer's MLP (Qwen3-MoE, Mixtral).

A router (a linear layer, [experts, hidden]) scores every expert per token; softmax in float32,
the top-k experts, their weights renormalised to sum to 1 where the model says so (Mixtral
always, Qwen3-MoE by `norm_topk_prob`); the token's output is the weighted sum of those experts'
gated MLPs. Over a flat batch the (token, expert) pairs are sorted by expert, so each expert runs
one product over the tokens routed to it (no per-token loop), and the weighted outputs are added
back per token in expert order, as transformers adds them (its float32 logits agree to ~1e-6).

Weights are held stacked as transformers 5 holds them: gate_up [experts, 2 x width, hidden]
(gate rows first) and down [experts, hidden, width]; the loaders stack per-expert checkpoints
(engine_proc/loading/experts.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine_proc.models.int4 import Int4Weight, quantize_int4

Product = Callable[..., torch.Tensor]  # layers.Linear: (x, weight, bias, packed) -> x @ weight.T


@dataclass(slots=True)
class RoutedExperts:
    """One layer's router and experts."""

    router: torch.Tensor  # [experts, hidden]
    gate_up: torch.Tensor  # [experts, 2 x width, hidden]
    down: torch.Tensor  # [experts, hidden, width]
    top_k: int
    renormalize: bool
    # per expert 4-bit copies for decode-sized products (models/int4.py); None: dense only
    gate_up_int4: list[Int4Weight] | None = None
    down_int4: list[Int4Weight] | None = None

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def pack_int4(self) -> None:
        self.gate_up_int4 = [quantize_int4(w) for w in self.gate_up]
        self.down_int4 = [quantize_int4(w) for w in self.down]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(weights [tokens, top_k] in x's dtype, expert ids [tokens, top_k]), best first."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def moe_mlp(
    x: torch.Tensor,  # [tokens, hidden]
    experts: RoutedExperts,
    act: Callable[[torch.Tensor], torch.Tensor],
    linear: Product,
    counts_out: torch.Tensor | None = None,  # [experts], tokens routed to each are added to it
    use_int4: bool = False,
) -> torch.Tensor:
    weights, ids = route(x, experts.router, experts.top_k, experts.renormalize)
    k = experts.top_k
    flat = ids.reshape(-1)
    # (token, slot) pairs grouped by expert; stable, so each expert's tokens stay in order
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=experts.num_experts)
    if counts_out is not None:
        counts_out += counts
    token_of = order // k
    xs = x[token_of]
    out = torch.empty_like(xs)
    gate_up_int4 = experts.gate_up_int4 if use_int4 else None
    down_int4 = experts.down_int4 if use_int4 else None
    start = 0
    for e, n in enumerate(counts.tolist()):  # one host sync: the group sizes
        if n == 0:
            continue
        rows = slice(start, start + n)
        gu = linear(xs[rows], experts.gate_up[e], None,
                    gate_up_int4[e] if gate_up_int4 is not None else None)  # fmt: skip
        gate, up = gu.chunk(2, dim=-1)
        out[rows] = linear(act(gate) * up, experts.down[e], None,
                           down_int4[e] if down_int4 is not None else None)  # fmt: skip
        start += n
    out = out * weights.reshape(-1)[order, None]
    # added per token in expert order (index_add_ follows the index order), as transformers does
    return torch.zeros_like(x).index_add_(0, token_of, out)
