"""How many long chats one KV pool serves at once with the hybrid KV cache against keeping every
layer's blocks (issue 31): `python -m engine_proc.bench.hybrid_capacity [--context 2048]`.

The model has Gemma 3 270M's KV geometry (18 layers, every sixth global, the others sliding over
512 tokens, 1 KV head of 256) over a narrow random body (hidden 64): the KV cache is the real
model's, the compute small; `--global-every 0` makes every layer slide, as Mistral's do.
`--chats` chats of `--context` tokens arrive at once on a pool that
holds `--full-chats` of them with every block kept; the count the engine runs at once (each with
its whole prompt computed) is taken after every step, hybrid_kv on and off, in one run, and printed
with their ratio beside the ratio the layout predicts (bytes a chat holds, full over hybrid).
Counts, not times: the same on any machine.
Prompts are computed in chunks of 128 tokens: while a chunk is computed, a sliding layer holds its
window and the chunk, so larger chunks leave room for fewer chats at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass

import torch

from engine_proc.config import EngineConfig
from engine_proc.core.kv_groups import max_sliding_blocks
from engine_proc.engine.llm_engine import LLMEngine
from engine_proc.loading.checkpoint import Checkpoint, expected_weight_shapes
from engine_proc.loading.loader import default_model_path
from engine_proc.loading.tokenizer_cache import gguf_tokenizer
from engine_proc.models.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from engine_proc.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_SIZE = 16


@dataclass(slots=True)
class Geometry:
    num_layers: int = 18
    global_every: int = 6  # Gemma 3: five sliding layers to one global; 0: every layer slides
    window: int = 512
    num_kv_heads: int = 1
    head_dim: int = 256

    def layer_types(self) -> tuple[str, ...]:
        every = self.global_every
        return tuple(FULL_ATTENTION if every and (i + 1) % every == 0 else SLIDING_ATTENTION
                     for i in range(self.num_layers))  # fmt: skip

    def describe(self) -> str:
        full = sum(t == FULL_ATTENTION for t in self.layer_types())
        return f"{self.num_layers} layers, {full} global, window {self.window}"


@dataclass(slots=True)
class Outcome:
    hybrid_kv: bool
    peak_decoding: int
    num_preemptions: int
    seconds: float


def gemma3_shaped(g: Geometry, context: int) -> ModelConfig:
    return ModelConfig(
        architecture="Gemma3ForCausalLM", vocab_size=49152, hidden_size=64,
        intermediate_size=128, num_layers=g.num_layers, num_heads=4, num_kv_heads=g.num_kv_heads,
        head_dim=g.head_dim, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
        max_position_embeddings=max(context + 64, 2048), tie_word_embeddings=True,
        attention_bias=False, qk_norm=True, sliding_window=g.window, layer_types=g.layer_types(),
        rope_local_theta=10_000.0, sandwich_norms=True, hidden_act="gelu_tanh",
        embed_scale=8.0, query_scale=g.head_dim**-0.5,
    )  # fmt: skip


def random_checkpoint(config: ModelConfig, seed: int = 0) -> Checkpoint:
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    path = default_model_path()
    tokenizer = gguf_tokenizer(path, None)  # the default model's vocabulary (49,152 tokens)
    return Checkpoint(config, weights, tokenizer, "gemma3-shaped-random", "Gemma-3-shaped")


def layer_tokens_per_chat(g: Geometry, context: int, hybrid: bool) -> int:
    """Layer-token slots a chat of `context` tokens holds (block-rounded): full-attention layers
    the whole context; with hybrid KV, sliding layers at most their window's blocks."""
    blocks = -(-context // BLOCK_SIZE)
    full = sum(t == FULL_ATTENTION for t in g.layer_types())
    sliding = g.num_layers - full
    if not hybrid:
        return g.num_layers * blocks * BLOCK_SIZE
    kept = min(blocks, max_sliding_blocks(g.window, BLOCK_SIZE))
    return (full * blocks + sliding * kept) * BLOCK_SIZE


def run(checkpoint: Checkpoint, g: Geometry, context: int, chats: int, full_chats: int,
        hybrid_kv: bool, new_tokens: int = 4, chunk: int = 128) -> Outcome:  # fmt: skip
    """`chats` prompts of `context` tokens at once over a pool sized to hold `full_chats` of them
    with every layer's blocks kept; the peak number decoding at once."""
    per_layer_token = 2 * g.num_kv_heads * g.head_dim * 4  # float32 K and V
    pool_bytes = full_chats * layer_tokens_per_chat(g, context + new_tokens, False) \
        * per_layer_token  # fmt: skip
    engine = LLMEngine(EngineConfig(
        dtype="float32", block_size=BLOCK_SIZE, kv_cache_memory=pool_bytes, hybrid_kv=hybrid_kv,
        max_num_seqs=max(64, chats), long_prefill_chunk=chunk,
        max_num_batched_tokens=max(2048, chunk * 4), max_model_len=context + new_tokens + 16,
        decode_weights="dense", enable_prefix_caching=False,
    ), checkpoint=checkpoint)  # fmt: skip
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    for i in range(chats):
        prompt = torch.randint(3, 49152, (context,), generator=gen).tolist()
        engine.add_request(f"c{i}", prompt, params)
    peak, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        # decoding: the whole prompt computed, its context resident (a prompt mid-prefill holds
        # only its chunks so far, and may be preempted for the others)
        decoding = sum(s.num_computed_tokens >= s.num_prompt_tokens
                       for s in engine.scheduler.running)  # fmt: skip
        peak = max(peak, decoding)
    seconds = time.perf_counter() - start
    assert engine.kv.pool.num_free == engine.num_blocks, "blocks leaked"
    return Outcome(hybrid_kv, peak, engine.stats.num_preemptions, seconds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine_proc.bench.hybrid_capacity",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--context", type=int, default=2048, help="tokens per chat (default 2048)")
    ap.add_argument("--chats", type=int, default=16, help="chats arriving at once (default 16)")
    ap.add_argument("--full-chats", type=int, default=3,
                    help="chats the pool holds with every block kept (default 3)")
    ap.add_argument("--window", type=int, default=512, help="sliding window (default 512)")
    ap.add_argument("--global-every", type=int, default=6,
                    help="every Nth layer global (default 6, as Gemma 3); 0: every layer slides")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    for name in ("context", "chats", "full_chats", "window"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.global_every < 0:
        ap.error("--global-every must be 0 (every layer slides) or more")
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    g = Geometry(window=args.window, global_every=args.global_every)
    checkpoint = random_checkpoint(gemma3_shaped(g, args.context))
    outcomes = [run(checkpoint, g, args.context, args.chats, args.full_chats, hybrid)
                for hybrid in (False, True)]  # fmt: skip
    predicted = (layer_tokens_per_chat(g, args.context, False)
                 / layer_tokens_per_chat(g, args.context, True))  # fmt: skip
    print(f"{args.chats} chats of {args.context:,} tokens, Gemma 3 270M KV geometry "
          f"({g.describe()}), a pool for {args.full_chats} with every block kept")
    print("| KV cache | chats at once | preemptions | seconds |")
    print("|---|---|---|---|")
    for o in outcomes:
        name = "hybrid (sliding blocks released)" if o.hybrid_kv else "every block kept"
        print(f"| {name} | {o.peak_decoding} | {o.num_preemptions} | {o.seconds:.1f} |")
    ratio = outcomes[1].peak_decoding / max(1, outcomes[0].peak_decoding)
    print(f"chats at once: {ratio:.2f}x (the layout predicts {predicted:.2f}x, "
          f"capped by --chats {args.chats})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
