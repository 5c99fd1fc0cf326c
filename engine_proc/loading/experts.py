"""Expert weights of a routed-experts model, stacked into the layout the engine holds
(engine_proc/loading/checkpoint.py EXPERT_WEIGHTS, as transformers 5 holds them in memory):
`mlp.gate.weight` [experts, hidden], `mlp.experts.gate_up_proj` [experts, 2 x width, hidden]
(gate rows first) and `mlp.experts.down_proj` [experts, hidden, width].

Checkpoints store them one of several ways, all accepted:
- per expert (Qwen3-MoE and Mixtral releases, and what transformers 5's save_pretrained writes):
  `mlp.experts.E.{gate,up,down}_proj.weight` or Mixtral's `block_sparse_moe.experts.E.{w1,w3,w2}
  .weight` with its router at `block_sparse_moe.gate.weight`;
- fused 3-D tensors `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` (transformers 5's
  in-memory names; some newer checkpoints);
- llama.cpp's stacked `ffn_{gate,up,down}_exps` (the GGUF loader names them
  `mlp.experts.{gate,up,down}_proj.weight`, 3-D).
Each piece is copied into its slot as it is read, so the per-expert tensors are never all held
twice."""

from __future__ import annotations

import re

import torch

from engine_proc.loading.checkpoint import expected_weight_shapes
from engine_proc.models.config import ModelConfig

_PART = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\."
    r"(gate\.weight|experts\.(?:(\d+)\.)?(gate_up_proj|down_proj|gate_proj|up_proj|w1|w2|w3)"
    r"(?:\.weight)?)$"
)
_ALIASES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class ExpertStacker:
    """take() every tensor it wants() as it is read; finish() returns the stacked weights under
    the engine's names."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype
        self.shapes = expected_weight_shapes(config)
        self.weights: dict[str, torch.Tensor] = {}
        # name -> halves filled: an expert's whole slot counts 2, its gate or up rows 1
        self.filled: dict[str, int] = {}

    def wants(self, name: str) -> bool:
        """Whether `name` is a router or expert piece of a layer with experts."""
        match = _PART.match(name)
        return match is not None and self.config.layer_has_experts(int(match.group(1)))

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """Copy a piece (wants(name) is true) into its slot."""
        match = _PART.match(name)
        assert match is not None, name
        layer, what, expert, part = match.groups()
        prefix = f"model.layers.{layer}."
        if what == "gate.weight":
            self._put(prefix + "mlp.gate.weight", None, tensor)
            return
        part = _ALIASES.get(part, part)
        e = None if expert is None else int(expert)
        width = self.config.moe_intermediate_size
        if part in ("down_proj", "gate_up_proj"):
            self._put(f"{prefix}mlp.experts.{part}", e, tensor)
        else:  # the gate or the up half of gate_up
            rows = slice(0, width) if part == "gate_proj" else slice(width, 2 * width)
            self._put(prefix + "mlp.experts.gate_up_proj", e, tensor, rows)

    def _put(self, name: str, expert: int | None, tensor: torch.Tensor,
             rows: slice | None = None) -> None:  # fmt: skip
        if name not in self.weights:
            self.weights[name] = torch.empty(self.shapes[name], dtype=self.dtype)
        slot = self.weights[name]
        if expert is not None:
            if not 0 <= expert < self.config.num_experts:
                raise ValueError(f"checkpoint has expert {expert} for {name}; the config has "
                                 f"num_experts={self.config.num_experts}")  # fmt: skip
            slot = slot[expert]
        if rows is not None:
            slot = slot[..., rows, :]
        if tuple(tensor.shape) != tuple(slot.shape):
            raise ValueError(
                f"checkpoint weight for {name} (expert {expert}) has shape "
                f"{tuple(tensor.shape)}, config implies {tuple(slot.shape)}"
            )
        slot.copy_(tensor)
        units = (self.config.num_experts if expert is None else 1) * (1 if rows is not None else 2)
        self.filled[name] = self.filled.get(name, 0) + units

    def finish(self) -> dict[str, torch.Tensor]:
        """The stacked weights; ValueError naming a tensor whose experts came incomplete."""
        need = 2 * self.config.num_experts
        for name, got in self.filled.items():
            if got != need:
                raise ValueError(f"checkpoint holds {got / 2:g} of {self.config.num_experts} "
                                 f"experts' weights for {name}")  # fmt: skip
        return self.weights
