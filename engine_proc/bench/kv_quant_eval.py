"""`python -m engine_proc.bench.kv_quant_eval`: accuracy of a quantised KV cache against the
model-dtype cache on the same engine path.

Teacher-forced next-token distributions over text the model did not write (this repository's
documentation, or --text FILE), fed through the engine in prompt chunks so later chunks attend
to K/V read back from the (quantised) paged cache: mean and p99 KL(ref || quantised), perplexity
of both, and greedy agreement on the 8 parity chat prompts of
tests/engine_proc/engine/test_hf_parity.py. """

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parents[2]
_LONG_TEXT = (
    "The history of paged memory begins with virtual memory systems in the 1960s, where the "
    "operating system split a program's address space into fixed-size pages and kept a page "
    "table mapping each virtual page to a physical frame. "
) * 6
# The 8 parity chats of tests/engine_proc/engine/test_hf_parity.py (engine_proc must not import
# tests).
PARITY_CHATS: list[list[dict[str, str]]] = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers and explain why they are prime."}],
    [
        {"role": "system", "content": "You are a pirate. Answer like one."},
        {"role": "user", "content": "How do I make a cup of tea?"},
    ],
    [
        {"role": "user", "content": "What is 12 times 7?"},
        {"role": "assistant", "content": "12 times 7 is 84."},
        {"role": "user", "content": "And divided by 4?"},
    ],
    [{"role": "user", "content": "Summarize this text in one sentence:\n" + _LONG_TEXT}],
    [{"role": "user", "content": "Translate to French: The cat sleeps on the warm window sill."}],
]


def _default_text() -> str:
    files = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]
    return "\n\n".join(f.read_text(encoding="utf-8") for f in files if f.exists())


def _all_position_logits(engine: LLMEngine, ids: list[int], chunk: int) -> torch.Tensor:
    """Log-probabilities [len(ids), vocab] of every position, from the engine's own forward
    passes (prompt chunks of `chunk` tokens over the paged cache)."""
    captured: list[torch.Tensor] = []
    forward = engine.model.forward

    def capture(*args: object, **kwargs: object) -> torch.Tensor:
        hidden = forward(*args, **kwargs)
        captured.append(hidden.detach())
        return hidden

    engine.model.forward = capture  # type: ignore[method-assign]
    try:
        engine.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    finally:
        engine.model.forward = forward  # type: ignore[method-assign]
    hidden = torch.cat(captured)[: len(ids)]
    rows = [
        torch.log_softmax(engine.model.compute_logits(hidden[i : i + 256]).double(), -1)
        for i in range(0, len(ids), 256)
    ]
    return torch.cat(rows)


def evaluate(
    kv_cache_dtype: str, dtype: str, text: str, positions: int, chunk: int, model: str | None
) -> dict[str, float]:
    common = dict(
        model=model,
        dtype=dtype,
        device="cpu",
        attention_backend="torch",
        enable_prefix_caching=False,
        long_prefill_chunk=chunk,
        max_num_batched_tokens=chunk,
        num_kv_blocks=(positions + 64) // 16 + 8,
    )
    ref = LLMEngine(EngineConfig(**common))  # type: ignore[arg-type]
    quant = LLMEngine(
        EngineConfig(**common, kv_cache_dtype=kv_cache_dtype),  # type: ignore[arg-type]
    )
    ids = ref.tokenize_text(text)[: positions + 1]
    if len(ids) < positions + 1:
        raise ValueError(f"the text has {len(ids)} tokens; {positions + 1} are needed")
    lp_ref = _all_position_logits(ref, ids, chunk)[:-1]
    lp_q = _all_position_logits(quant, ids, chunk)[:-1]
    kld = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1)
    target = torch.tensor(ids[1:])
    nll_ref = -lp_ref.gather(1, target[:, None]).mean().item()
    nll_q = -lp_q.gather(1, target[:, None]).mean().item()
    top1 = (lp_ref.argmax(-1) == lp_q.argmax(-1)).double().mean().item()
    chats = PARITY_CHATS
    params = SamplingParams(max_tokens=32, temperature=0)
    outs_ref = [o.token_ids for o in ref.generate(chats, params)]
    outs_q = [o.token_ids for o in quant.generate(chats, params)]
    same_tokens = sum(
        sum(1 for _ in _common_prefix(a, b)) for a, b in zip(outs_ref, outs_q, strict=True)
    )
    return {
        "positions": float(len(kld)),
        "kld_mean": kld.mean().item(),
        "kld_p99": torch.quantile(kld, 0.99).item(),
        "kld_max": kld.max().item(),
        "ppl_ref": math.exp(nll_ref),
        "ppl_quant": math.exp(nll_q),
        "ppl_change_perc": 100 * (math.exp(nll_q) / math.exp(nll_ref) - 1),
        "top1_agreement": top1,
        "greedy_identical_chats": float(sum(a == b for a, b in zip(outs_ref, outs_q, strict=True))),
        "greedy_common_prefix_tokens": float(same_tokens),
        "greedy_tokens": float(sum(len(a) for a in outs_ref)),
        "kv_bytes_per_token_ref": float(ref.kv_bytes_per_token),
        "kv_bytes_per_token_quant": float(quant.kv_bytes_per_token),
    }


def _common_prefix(a: list[int], b: list[int]):  # noqa: ANN202
    for x, y in zip(a, b, strict=False):
        if x != y:
            return
        yield x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine_proc.bench.kv_quant_eval", description=__doc__
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="int8",
        choices=("fp16", "int8", "fp8"),
        help="the quantised format measured against the model-dtype cache",
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--model", default=None)
    p.add_argument("--text", default=None, help="a text file (default: the repository's docs)")
    p.add_argument("--positions", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    text = Path(args.text).read_text(encoding="utf-8") if args.text else _default_text()
    r = evaluate(args.kv_cache_dtype, args.dtype, text, args.positions, args.chunk, args.model)
    if args.json:
        print(json.dumps(r))
    else:
        for k, v in r.items():
            print(f"{k:30s} {v:.6g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
