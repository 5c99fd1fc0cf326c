"""One forward pass's input, as the model runner builds it and a CUDA graph replays it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_proc.attention.base import AttentionMetadata
from engine_proc.core.request import Sequence


@dataclass(slots=True)
class StepInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # flat index of the last token of each sampling sequence
    sampling_seqs: list[Sequence]
