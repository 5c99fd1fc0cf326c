"""Decode-attention micro-benchmark for the Triton paged-attention kernel.

    python -m engine_proc.bench.kernels               # on a CUDA GPU: batch x context sweep
    python -m engine_proc.bench.kernels --interpret   # no GPU: one tiny shape, Triton interpreter

Decode attention is memory bound: every step reads each sequence's whole K/V once. So the
number that matters is achieved KV-read bandwidth against the device's peak. Next to the kernel
it times torch ``scaled_dot_product_attention`` on K/V already gathered into contiguous tensors
(the best case for a non-paged path) and gather + SDPA (what a torch paged path pays per step),
plus the Triton kernel replayed from a CUDA graph (what the engine's decode would pay without
per-launch CPU overhead). A second table times the default model's whole decode step eagerly and
replayed from the engine's own CUDA graphs (``engine_proc.executor.cuda_graphs``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from engine_proc.attention.base import AttentionMetadata

TIME_BUDGET_S = 120.0  # kernel sweep; the decode-step table after it keeps the total < 3 min

# HBM/GDDR peak of common parts in GB/s, used when torch does not expose the memory clock.
_KNOWN_PEAK_GBPS = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 NVL": 3900.0,
    "H100 PCIe": 2000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100 80GB PCIe": 1935.0,
    "A100-SXM4-40GB": 1555.0,
    "A100-PCIE-40GB": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
    "RTX 4090": 1008.0,
    "RTX 3090": 936.0,
    "T4": 320.0,
}


@dataclass(slots=True)
class DecodeCase:
    batch: int
    context: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def _parse_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_decode_batch(case: DecodeCase, device: torch.device, seed: int = 0):
    """One decode token per sequence over ``context`` cached tokens in shuffled blocks."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    k_cache = torch.randn(shape, generator=gen, device=device, dtype=case.dtype)
    v_cache = torch.randn(shape, generator=gen, device=device, dtype=case.dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)
    block_tables = perm.view(case.batch, blocks_per_seq).to(torch.int32)
    query = torch.randn(
        case.batch, case.num_heads, case.head_dim, generator=gen, device=device, dtype=case.dtype
    )
    slots = torch.full((case.batch,), -1, dtype=torch.int64, device=device)
    return query, k_cache, v_cache, decode_metadata(slots, block_tables, case.context)


def decode_metadata(
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_len: int
) -> AttentionMetadata:
    """One query token per sequence, every sequence ``seq_len`` tokens long."""
    batch, device = block_tables.shape[0], block_tables.device
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=seq_len,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[seq_len] * batch,
    )


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, context: int):
    """K/V of every sequence as dense [batch, kv_heads, context, head_dim] (all same length)."""
    k = k_cache[meta.block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    v = v_cache[meta.block_tables.long()].flatten(1, 2)[:, :context].transpose(1, 2)
    return k.contiguous(), v.contiguous()


def sdpa_decode(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    q = query.unsqueeze(2)  # [batch, heads, 1, head_dim]
    out = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def peak_bandwidth_gbps(device: torch.device) -> tuple[float | None, str]:
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        # Double data rate: two transfers per memory clock over the whole bus.
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, "memory clock x bus width"
    for key, gbps in _KNOWN_PEAK_GBPS.items():
        if key in props.name:
            return gbps, "datasheet"
    return None, "unknown"


def _bench_ms(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _graph_ms(fn) -> float | None:
    """Median time of ``fn`` replayed from a CUDA graph, or None where capture fails."""
    from engine_proc.executor.cuda_graphs import CudaGraph

    try:
        graph = CudaGraph(pool=None)  # warms up (compiles) on a side stream, then captures
        graph.capture(fn)
        return _bench_ms(graph.replay)
    except Exception as exc:  # a bench row should say n/a, not end the sweep
        print(f"CUDA graph capture failed: {exc!r}", file=sys.stderr)
        return None


def _measure(
    backend, case: DecodeCase, device: torch.device, kv_bytes: int, peak: float | None
) -> str:
    """One table row: the kernel, its CUDA-graph replay, SDPA, gather + SDPA, and the error."""
    query, k_cache, v_cache, meta = build_decode_batch(case, device)
    scale = case.head_dim**-0.5
    run = lambda: backend.forward(query, k_cache, v_cache, meta, scale)
    t_triton = _bench_ms(run)
    t_graph = _graph_ms(run)
    k, v = gather_kv(k_cache, v_cache, meta, case.context)
    t_sdpa = _bench_ms(lambda k=k, v=v: sdpa_decode(query, k, v, scale))
    err = (run().float() - sdpa_decode(query, k, v, scale).float()).abs().max().item()
    del k, v  # the gather below makes its own copy

    def gather_then_sdpa() -> torch.Tensor:
        gk, gv = gather_kv(k_cache, v_cache, meta, case.context)
        return sdpa_decode(query, gk, gv, scale)

    t_gather = _bench_ms(gather_then_sdpa)
    gbps = kv_bytes / (t_triton * 1e-3) / 1e9
    pct = f"{100 * gbps / peak:>5.0f}%" if peak else f"{'?':>6}"
    graph = f"{t_graph:>8.4f}" if t_graph is not None else f"{'n/a':>8}"
    return (
        f"{case.batch:>5} {case.context:>6} {kv_bytes / 1e6:>8.1f} | {t_triton:>9.4f} "
        f"{gbps:>7.0f} {pct} {graph} | {t_sdpa:>8.4f} {kv_bytes / (t_sdpa * 1e-3) / 1e9:>7.0f} | "
        f"{t_gather:>14.4f} | {err:>8.1e}"
    )


@dataclass(slots=True)
class DecodeStepRow:
    batch: int
    eager_ms: float
    graph_ms: float
    max_abs_diff: float  # final hidden states, eager vs graph replay

    @property
    def speedup(self) -> float:
        return self.eager_ms / self.graph_ms


def decode_step_input(batch: int, context: int, block_size: int, device: torch.device):
    """A decode-only step of ``batch`` sequences at position ``context`` (blocks laid out
    sequence after sequence), shaped like ModelRunner.prepare's output."""
    blocks_per_seq = context // block_size + 1
    tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=device)
    tables = tables.view(batch, blocks_per_seq)
    positions = torch.full((batch,), context, dtype=torch.int64, device=device)
    slots = tables[:, context // block_size].long() * block_size + context % block_size
    meta = decode_metadata(slots, tables, context + 1)
    input_ids = torch.arange(batch, dtype=torch.int64, device=device) + 100
    return SimpleNamespace(input_ids=input_ids, positions=positions, meta=meta)


def decode_step_table(
    model,
    backend,
    batches: list[int],
    context: int,
    block_size: int,
    timer: Callable[[Callable[[], object]], float],
    make_graph=None,
) -> list[DecodeStepRow]:
    """Whole-model decode step, eager vs replayed from the engine's CUDA graphs, per batch.
    ``timer(fn)`` returns milliseconds; ``make_graph`` swaps the graph class (CPU tests)."""
    from engine_proc.executor.model_runner import ModelRunner

    cfg = model.config
    device = model.device
    blocks_per_seq = context // block_size + 1
    kv_cache = torch.zeros(
        (cfg.num_layers, 2, max(batches) * blocks_per_seq, block_size, cfg.num_kv_heads,
         cfg.head_dim),
        dtype=model.dtype,
        device=device,
    )  # fmt: skip
    runner = ModelRunner(model, kv_cache, backend)
    runner.enable_decode_graphs(max(batches), context + block_size, make_graph=make_graph)
    graphs = runner.decode_graphs
    assert graphs is not None
    rows = []
    with torch.inference_mode():
        for batch in batches:
            step = decode_step_input(batch, context, block_size, device)

            def eager(step=step):
                return model.forward(
                    step.input_ids, step.positions, runner.kv_caches, step.meta, backend
                )

            diff = (eager().float() - graphs.run(step).float()).abs().max().item()
            rows.append(
                DecodeStepRow(batch, timer(eager), timer(lambda s=step: graphs.run(s)), diff)
            )
    return rows


def run_decode_steps(args: argparse.Namespace, device: torch.device) -> None:
    """The default model's decode step with and without CUDA graphs (engine-level view)."""
    from engine_proc.attention.triton_backend import TritonAttentionBackend
    from engine_proc.loading.loader import load_checkpoint
    from engine_proc.models.llama import LlamaModel

    dtype = getattr(torch, args.dtype)
    try:
        ckpt = load_checkpoint(None, dtype)
    except Exception as exc:  # the kernel table above stands on its own
        print(f"decode step vs CUDA graphs: skipped ({exc})")
        return
    context = 512
    model = LlamaModel(ckpt.config, ckpt.weights, dtype, device, context + 2 * args.block_size)
    print(
        f"\nwhole decode step, {ckpt.display_name}, {args.dtype}, context {context}: "
        "eager launches vs CUDA graph replay"
    )
    print(
        f"{'batch':>5} | {'eager ms':>9} | {'graph ms':>9} | {'speedup':>7} | {'graph tok/s':>11}"
    )
    rows = decode_step_table(
        model, TritonAttentionBackend(), args.step_batches, context, args.block_size, _bench_ms
    )
    for r in rows:
        print(
            f"{r.batch:>5} | {r.eager_ms:>9.3f} | {r.graph_ms:>9.3f} | {r.speedup:>6.1f}x | "
            f"{r.batch / (r.graph_ms * 1e-3):>11.0f} | {r.max_abs_diff:>8.1e}"
        )


def run_cuda(args: argparse.Namespace) -> int:
    from engine_proc.attention import select_backend

    device = torch.device("cuda")
    try:
        backend = select_backend("triton", device)
    except ValueError as exc:  # says why (interpreter mode, old GPU, no triton)
        print(exc)
        return 1
    dtype = getattr(torch, args.dtype)
    peak, peak_src = peak_bandwidth_gbps(device)
    name = torch.cuda.get_device_name(device)
    print(
        f"device: {name}; peak memory bandwidth: "
        + (f"{peak:.0f} GB/s ({peak_src})" if peak else "unknown")
    )
    print(
        f"decode attention, {args.dtype}, heads {args.heads}/{args.kv_heads} (q/kv), "
        f"head_dim {args.head_dim}, block_size {args.block_size}; times are medians"
    )
    header = (
        f"{'batch':>5} {'ctx':>6} {'KV MB':>8} | {'triton ms':>9} {'GB/s':>7} {'%peak':>6} "
        f"{'graph ms':>8} | {'sdpa ms':>8} {'GB/s':>7} | {'gather+sdpa ms':>14} | {'max err':>8}"
    )
    print(header)
    print("-" * len(header))
    started = time.monotonic()
    points = [(b, c) for b in args.batches for c in args.contexts]
    for batch, context in points:
        if time.monotonic() - started > TIME_BUDGET_S:
            print(f"time budget of {TIME_BUDGET_S:.0f} s reached: remaining points skipped")
            break
        case = DecodeCase(
            batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype
        )
        elem = torch.finfo(dtype).bits // 8
        kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * elem
        free, _ = torch.cuda.mem_get_info(device)
        # Cache + gathered copy + gather transients; float32 SDPA (no flash path) also expands
        # K/V per query head.
        need = kv_bytes * (3.5 + (args.heads // args.kv_heads if dtype == torch.float32 else 0))
        skipped = f"{batch:>5} {context:>6} {kv_bytes / 1e6:>8.0f} | skipped: not enough memory"
        if need > 0.8 * free - 512e6:
            print(skipped)
            continue
        try:
            print(_measure(backend, case, device, kv_bytes, peak))
        except torch.OutOfMemoryError:
            print(skipped + " (out of memory)")
        torch.cuda.empty_cache()
    if not args.no_engine:
        try:
            run_decode_steps(args, device)
        except Exception as exc:  # the kernel table above stands on its own
            print(f"decode step vs CUDA graphs: failed ({exc!r})")
    print(f"done in {time.monotonic() - started:.0f} s")
    return 0


def run_interpreted() -> int:
    """A tiny decode batch through Triton's interpreter: proves the path, no timing."""
    from engine_proc.attention import triton_backend

    if not triton_backend.kernels_interpreted():
        print("kernels are compiled, not interpreted (TRITON_INTERPRET was not set at import)")
        return 1
    backend = triton_backend.TritonAttentionBackend()
    case = DecodeCase(3, 40, 6, 2, 64, 16, torch.float32)
    query, k_cache, v_cache, meta = build_decode_batch(case, torch.device("cpu"))
    scale = case.head_dim**-0.5
    started = time.monotonic()
    out = backend.forward(query, k_cache, v_cache, meta, scale)
    elapsed = time.monotonic() - started
    k, v = gather_kv(k_cache, v_cache, meta, case.context)
    err = (out - sdpa_decode(query, k, v, scale)).abs().max().item()
    ok = err < 1e-4
    print(
        f"interpreter: decode batch {case.batch} x context {case.context}, heads "
        f"{case.num_heads}/{case.num_kv_heads}, head_dim {case.head_dim}: max |triton - sdpa| = "
        f"{err:.1e} ({'OK' if ok else 'MISMATCH'}), {elapsed:.2f} s (interpreter speed, not GPU)"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_proc.bench.kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="run a tiny shape through Triton's interpreter on CPU",
    )
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=_parse_ints, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", type=_parse_ints, default=[512, 2048, 8192])
    parser.add_argument(
        "--step-batches",
        type=_parse_ints,
        default=[1, 8, 32],
        help="batch sizes of the whole-model decode step table (eager vs CUDA graphs)",
    )
    parser.add_argument("--no-engine", action="store_true", help="only the attention kernel table")
    args = parser.parse_args(argv)
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")

    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            # Triton fixes compiled vs interpreted when a kernel is decorated, i.e. at import:
            # restart with the switch set rather than depend on what was imported already.
            os.environ["TRITON_INTERPRET"] = "1"
            os.execv(
                sys.executable, [sys.executable, "-m", "engine_proc.bench.kernels", *sys.argv[1:]]
            )
        try:
            import triton  # noqa: F401
        except ImportError:
            print("triton is not installed: nothing to interpret (pip install triton)")
            return 1
        return run_interpreted()
    if not torch.cuda.is_available():
        print(
            "no CUDA GPU present: nothing to benchmark "
            "(--interpret runs a tiny shape through Triton's interpreter)"
        )
        return 0
    return run_cuda(args)


if __name__ == "__main__":
    sys.exit(main())
