"""`python -m engine_proc.bench.decode_quality`: what each decode arithmetic does to the model's
next-token distributions, measured as llama.cpp's `llama-perplexity --kl-divergence` does.

One text the model did not write (this repository's documentation, or --text FILE), teacher-
forced: every decode step is handed the text's next token whatever the model would have picked,
so each system's full next-token distribution at every position meets the reference's on the
same history. Reference: the engine's float32 forward of the same weights, eager (the path
tests/engine_proc/engine/test_hf_parity.py holds to transformers). Systems:

- `kvscope-exact`: the fused 4-bit decode step with float32 activations (the engine's default);
- `kvscope-int8`: the same step with 8-bit activations (`decode_activations="int8"`, llama.cpp's
  arithmetic: Q4_1 x Q8_1 products, Q8_0 x Q8_0 head);
- `llamacpp`: llama.cpp itself on the same GGUF, one token per call (its decode path), when
  llama-cpp-python is installed.

Per system: perplexity of the text, mean / p99 / max KL(reference || system) in nats, and the
share of positions whose top token is the reference's. Decode steps are what is measured: the
first `--prefix` tokens are the prompt, and only the first measured position comes from its
prefill (for every system alike); the other `--positions` - 1 are decode steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_proc import EngineConfig, LLMEngine, SamplingParams
from engine_proc.bench.common import model_path
from engine_proc.bench.kv_quant_eval import _all_position_logits, _default_text

logger = logging.getLogger(__name__)
KVSCOPE_SYSTEMS = {"kvscope-exact": "exact", "kvscope-int8": "int8"}
SYSTEMS = (*KVSCOPE_SYSTEMS, "llamacpp")


def teacher_forced_decode(engine: LLMEngine, ids: list[int], prefix: int) -> torch.Tensor:
    """Log-probabilities [len(ids) - prefix, vocab]: row j is the distribution after
    ids[: prefix + j], where the first row comes from the prompt's prefill and every other from
    a decode step that was handed ids[prefix + j - 1] (whatever the model sampled is replaced
    by the text's token before the engine sees it)."""
    captured: list[torch.Tensor] = []
    emit = engine._sample_and_emit

    def forced(logits: torch.Tensor, sampling: list) -> list:
        if not sampling:  # a prompt chunk before the last: nothing sampled
            return emit(logits, sampling)
        assert logits.shape[0] == 1, "one sequence, no speculation"
        captured.append(torch.log_softmax(logits[0].double(), -1))
        nxt = ids[prefix + len(captured) - 1] if prefix + len(captured) - 1 < len(ids) else 0
        only = torch.full_like(logits, -math.inf)
        only[0, nxt] = 0.0  # greedy then picks the text's token
        return emit(only, sampling)

    engine._sample_and_emit = forced  # type: ignore[method-assign]
    try:
        params = SamplingParams(max_tokens=len(ids) - prefix, temperature=0, ignore_eos=True)
        engine.generate([ids[:prefix]], params)
    finally:
        del engine._sample_and_emit  # back to the class's method
    return torch.stack(captured)


def llamacpp_decode(path: Path, ids: list[int], prefix: int, threads: int) -> torch.Tensor:
    """llama.cpp's log-probabilities, the same rows as teacher_forced_decode: the prefix in one
    call, then one token per call (llama_decode of a single token: its decode arithmetic)."""
    from llama_cpp import Llama

    n = threads or None
    llm = Llama(str(path), n_ctx=len(ids) + 8, n_batch=max(prefix, 1), logits_all=True,
                n_threads=n, n_threads_batch=n, verbose=False)  # fmt: skip
    llm.eval(ids[:prefix])
    for token in ids[prefix:-1]:
        llm.eval([token])
    rows = np.asarray(llm.scores[prefix - 1 : len(ids) - 1], dtype=np.float64)
    return torch.log_softmax(torch.from_numpy(rows), -1)


def compare(lp_ref: torch.Tensor, lp: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(ref || lp) per position (nats), perplexity of the targets, top-1 agreement."""
    kld = (lp_ref.exp() * (lp_ref - lp)).sum(-1)
    nll = -lp.gather(1, targets[:, None]).mean().item()
    return {
        "ppl": math.exp(nll),
        "kld_mean": kld.mean().item(),
        "kld_p99": torch.quantile(kld, 0.99).item(),
        "kld_max": kld.max().item(),
        "top1_agreement": (lp_ref.argmax(-1) == lp.argmax(-1)).double().mean().item(),
    }


def evaluate(text: str, positions: int, prefix: int, threads: int, model: str | None,
             systems: tuple[str, ...], progress: Callable[[str], None] = logger.info,
             ) -> dict[str, dict[str, float]]:  # fmt: skip
    """Every system against the float32 reference on the text's first positions + 1 tokens."""
    common: dict[str, Any] = dict(model=model, device="cpu", num_threads=threads,
                                  enable_prefix_caching=False,
                                  num_kv_blocks=(prefix + positions + 15) // 16 + 8)  # fmt: skip
    ref = LLMEngine(EngineConfig(**common, dtype="float32", decode_weights="dense",
                                 decode_step="eager", attention_backend="torch"))  # fmt: skip
    ids = ref.tokenize_text(text)[: prefix + positions]
    if len(ids) < prefix + positions:
        raise ValueError(f"--positions: the text has {len(ids)} tokens; {prefix + positions} "
                         "are needed")  # fmt: skip
    progress("reference: float32, eager")
    lp_ref = _all_position_logits(ref, ids, 512)[prefix - 1 : -1]
    targets = torch.tensor(ids[prefix:])
    results = {"reference": compare(lp_ref, lp_ref, targets)}
    del ref
    for system in systems:
        progress(f"{system}: {positions} teacher-forced decode steps")
        if system == "llamacpp":
            lp = llamacpp_decode(model_path(model), ids, prefix, threads)
        else:
            activations = KVSCOPE_SYSTEMS[system]
            engine = LLMEngine(EngineConfig(**common, decode_weights="int4", decode_step="fused",
                                            decode_activations=activations))  # fmt: skip
            step = engine.runner.fused.ready()
            if step is None or step.int8_activations != (activations == "int8"):
                raise RuntimeError(f"{system} does not run here: {engine.runner.fused.detail}")
            lp = teacher_forced_decode(engine, ids, prefix)
            fused = engine.runner.num_fused_steps
            del engine
            if fused != positions - 1:  # the arithmetic measured must be the fused step's
                raise RuntimeError(f"{system}: {fused} of {positions - 1} decode steps fused")
        results[system] = compare(lp_ref, lp, targets)
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(prog="python -m engine_proc.bench.decode_quality",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model", default=None, help="a GGUF (default: SmolLM2-135M, Q4_1)")
    p.add_argument("--text", default=None, help="a text file (default: the repository's docs)")
    p.add_argument("--positions", type=int, default=1024, help="decode steps measured")
    p.add_argument("--prefix", type=int, default=16, help="prompt tokens before them")
    p.add_argument("--threads", type=int, default=0, help="0: torch's and llama.cpp's choice")
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    default = [s for s in SYSTEMS if have_llama or s != "llamacpp"]
    p.add_argument("--systems", default=",".join(default),
                   help=f"comma-separated, of {', '.join(SYSTEMS)}")  # fmt: skip
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)}; allowed: {', '.join(SYSTEMS)}")
    if "llamacpp" in systems and not have_llama:
        p.error("--systems: llamacpp needs llama-cpp-python (pip install llama-cpp-python)")
    if args.positions < 1 or args.prefix < 1:
        p.error("--positions and --prefix: at least 1")
    text = Path(args.text).read_text(encoding="utf-8") if args.text else _default_text()
    results = evaluate(text, args.positions, args.prefix, args.threads, args.model, systems)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{args.positions} positions; KL(reference || system) in nats")
    print(f"{'system':15s} {'ppl':>8s} {'KL mean':>9s} {'KL p99':>9s} {'KL max':>9s} {'top-1':>7s}")
    for name, r in results.items():
        print(f"{name:15s} {r['ppl']:8.3f} {r['kld_mean']:9.2e} {r['kld_p99']:9.2e} "
              f"{r['kld_max']:9.2e} {100 * r['top1_agreement']:6.2f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
