"""The benchmark's transformers baseline: `generate()` with static batching (left padding,
batches of up to `hf_batch` requests in arrival order, a batch runs until its longest request is
done), greedy, EOS ignored (min_new_tokens). Run through `python -m engine_proc.bench.worker
--system hf`.

Loading the default GGUF through transformers takes ~60 s of dequantization, so the dequantized
weights are cached under the worker's --cache-dir as a plain safetensors checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from engine_proc.bench.common import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    Issuer,
    arrived_batches,
    cache_key,
    model_path,
    parse_workload,
    request_results,
    summarize,
)

logger = logging.getLogger(__name__)


def load_hf_model(model: str | None, dtype: str, cache_dir: Path | None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    path = model_path(model)
    if not path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).eval()
    if cache_dir is None:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch_dtype
        ).eval()
    d = cache_dir / cache_key(path, "float32", "hf")
    if not (d / "done").exists():
        logger.info("converting %s with transformers (first run only)", path.name)
        m = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
        _save_hf_plain(m, d)
        del m
    return AutoModelForCausalLM.from_pretrained(str(d), dtype=torch_dtype).eval()


def _save_hf_plain(model: Any, d: Path) -> None:
    """save_pretrained refuses GGUF-loaded models; the dequantized weights are plain tensors."""
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # the same storage as the embedding
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(d / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(d))
    (d / "done").touch()


def run_hf(workload: dict, args: argparse.Namespace) -> dict:
    import torch

    reqs = parse_workload(workload)
    sampled = [r.id for r in reqs if r.temperature > 0]
    if sampled:
        raise ValueError(f"the hf runner decodes greedily; requests {sampled[:3]} ask for "
                         "temperature > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.monotonic()
    model = load_hf_model(args.model, args.dtype, args.cache_dir)
    load_s = time.monotonic() - t_load
    if args.device not in ("auto", "cpu"):
        model = model.to(args.device)
    elif args.device == "auto" and torch.cuda.is_available():
        model = model.to("cuda")
    device = next(model.parameters()).device
    eos = model.config.eos_token_id
    pad_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    batch_size = int(workload.get("hf_batch", args.hf_batch))
    clock = time.monotonic

    def generate(prompts: list[list[int]], max_new: int) -> tuple[list[float], list[list[int]]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every row ends at the same column
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        stamps: list[float] = []

        def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(clock())  # logits of this step exist; its token is picked next
            return scores

        with torch.inference_mode():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
                logits_processor=[stamp],
            )
        assert out.shape[1] - width == max_new, (out.shape, width, max_new)
        return stamps, out[:, width:].tolist()

    generate([WARMUP_PROMPT], WARMUP_TOKENS)
    t0 = clock()
    batches = 0
    for batch in arrived_batches(Issuer(reqs, t0), clock, batch_size):
        stamps, new_ids = generate([r.prompt for r in batch], max(r.max_tokens for r in batch))
        for r, ids in zip(batch, new_ids, strict=True):
            # Generous to the baseline: a request counts as done at its own last token, not
            # when its batch ends.
            r.token_times = stamps[: r.max_tokens]
            r.token_ids = ids[: r.max_tokens]
            r.num_out = len(r.token_times)
            r.finished = True
        batches += 1
    result = summarize(reqs, t0)
    result.update(
        {
            "load_s": load_s,
            "batches": batches,
            "hf_batch": batch_size,
            "prefix_hit_rate": None,
            "requests": request_results(reqs, t0),
        }
    )
    return result
