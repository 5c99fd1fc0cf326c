"""Compile the Triton kernels for NVIDIA GPUs this machine does not have.

    python -m engine_proc.attention.triton_aot                 # sm_80 and sm_90, the usual variants
    python -m engine_proc.attention.triton_aot --arch 90 --verbose

Triton's interpreter runs the kernels' arithmetic on CPU but is lenient where the GPU compiler is
strict (types, layouts, ``tl.dot`` shapes, shared memory). This builds every launch variant the
engine picks (through the same ``attention_constants`` as ``forward``) down to a cubin for a
chosen compute capability, then reads ptxas' resource report: registers per thread, spill bytes
and shared memory, checked against the architecture's per-block limit. No GPU is needed, only the
``ptxas`` that ships inside the triton wheel.

It must run with the kernels compiled, not interpreted: it refuses when ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Most dynamic shared memory one block may use, per compute capability (CUDA programming guide).
SHARED_MEMORY_LIMIT = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

_PTR_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16"}
# Pool values and scale pointers per kv_cache_dtype ("auto": the model dtype, scales unread).
_KV_PTR_TYPES = {"int8": ("*i8", "*fp16"), "fp8": ("*u8", "*fp32")}
LABEL_WIDTH = 68  # the report's first column


def _dtype_label(dtype: torch.dtype, kv_cache_dtype: str) -> str:
    short = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]
    return short if kv_cache_dtype == "auto" else f"{short}/{kv_cache_dtype}"


@dataclass(slots=True, frozen=True)
class AttentionVariant:
    dtype: torch.dtype
    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    max_query_len: int  # 1 = decode-only launch; larger = prefill tiles
    kv_cache_dtype: str = "auto"  # the pool's format: auto | int8 | fp8

    def label(self) -> str:
        kind = "decode" if self.max_query_len == 1 else "prefill"
        return (
            f"attention {_dtype_label(self.dtype, self.kv_cache_dtype):<9} group {self.group:<2} "
            f"head_dim {self.head_dim:<3} block {self.block_size:<2} {kind}"
        )


@dataclass(slots=True, frozen=True)
class WriteKVVariant:
    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_cache_dtype: str = "auto"

    def label(self) -> str:
        return (
            f"write_kv  {_dtype_label(self.dtype, self.kv_cache_dtype):<9} kv_heads "
            f"{self.num_kv_heads:<2} head_dim {self.head_dim:<3} block {self.block_size:<2}"
        )


@dataclass(slots=True)
class CompileReport:
    label: str
    arch: int
    seconds: float
    shared_bytes: int
    registers: int | None
    spill_bytes: int | None
    num_warps: int

    @property
    def fits(self) -> bool:
        return self.shared_bytes <= SHARED_MEMORY_LIMIT.get(self.arch, 48 * 1024)


def default_variants() -> list[AttentionVariant | WriteKVVariant]:
    """What the acceptance sweep covers: every dtype, head dims 64/128 (and 80, padded), GQA
    1/3/8, block sizes 16/32, decode and prefill tiles, without the full cross product."""
    out: list[AttentionVariant | WriteKVVariant] = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for group, head_dim, block_size in ((1, 64, 16), (3, 128, 32), (8, 128, 16)):
            for max_query_len in (1, 64):
                out.append(AttentionVariant(dtype, group, head_dim, block_size, max_query_len))
    out.append(AttentionVariant(torch.bfloat16, 3, 80, 32, 64))
    out.append(WriteKVVariant(torch.bfloat16, 8, 128, 16))
    out.append(WriteKVVariant(torch.float32, 3, 80, 32))
    # Quantised pools: every model dtype reads them, decode and prefill tiles.
    for kv in ("int8", "fp8"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for max_query_len in (1, 64):
                out.append(AttentionVariant(dtype, 3, 128, 16, max_query_len, kv))
        out.append(AttentionVariant(torch.bfloat16, 8, 64, 32, 1, kv))
        out.append(WriteKVVariant(torch.bfloat16, 8, 128, 16, kv))
        out.append(WriteKVVariant(torch.float32, 3, 80, 32, kv))
    return out


def quick_variants() -> list[AttentionVariant | WriteKVVariant]:
    """A few seconds' worth: the engine's common bf16 decode, the heaviest prefill tile (float32,
    head_dim 128), the KV write, the int8 and fp8 pools' decode, the heaviest quantised prefill
    (float32 over int8) and fp8's quantising write."""
    return [
        AttentionVariant(torch.bfloat16, 8, 128, 16, 1),
        AttentionVariant(torch.float32, 3, 128, 32, 64),
        WriteKVVariant(torch.bfloat16, 8, 128, 16),
        AttentionVariant(torch.bfloat16, 8, 128, 16, 1, "int8"),
        AttentionVariant(torch.bfloat16, 8, 128, 16, 1, "fp8"),
        AttentionVariant(torch.float32, 3, 128, 16, 64, "int8"),
        WriteKVVariant(torch.bfloat16, 8, 128, 16, "fp8"),
    ]


def _signature(kernel, pointers: dict[str, str], floats: tuple[str, ...], constants: dict):
    sig = {}
    for name in kernel.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in floats:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _source(variant: AttentionVariant | WriteKVVariant):
    """The kernel as Triton's compiler takes it, and the warp count ``forward`` launches with."""
    from triton.compiler import ASTSource

    from engine_proc.attention import triton_attention_kernel, triton_kv_codec, triton_launch

    ptr = _PTR_TYPES[variant.dtype]
    cache_ptr, scale_ptr = _KV_PTR_TYPES.get(variant.kv_cache_dtype, (ptr, ptr))
    kv_pointers = {
        "k_cache_ptr": cache_ptr,
        "v_cache_ptr": cache_ptr,
        "k_scale_ptr": scale_ptr,
        "v_scale_ptr": scale_ptr,
    }
    if isinstance(variant, AttentionVariant):
        kernel = triton_attention_kernel.paged_attention_kernel
        constants = triton_launch.attention_constants(
            variant.dtype, variant.group, variant.head_dim, variant.block_size,
            variant.max_query_len, variant.kv_cache_dtype,
        )  # fmt: skip
        pointers = {
            "out_ptr": ptr,
            "query_ptr": ptr,
            **kv_pointers,
            "block_tables_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "query_start_loc_ptr": "*i32",
        }
        floats: tuple[str, ...] = ("scale_log2", "softcap")
    else:
        kernel = triton_kv_codec.write_kv_kernel
        constants = dict(  # a copy: the cached dict must not lose keys to the pop below
            triton_launch.write_kv_constants(
                variant.num_kv_heads, variant.head_dim, variant.block_size, variant.kv_cache_dtype
            )
        )
        pointers = {"key_ptr": ptr, "value_ptr": ptr, **kv_pointers, "slot_mapping_ptr": "*i64"}
        floats = ()
    num_warps = int(constants.pop("num_warps", 4))
    sig = _signature(kernel, pointers, floats, constants)
    constexprs = {(kernel.arg_names.index(k),): v for k, v in constants.items()}
    # What the runtime's specialization sees on a real launch: torch allocations are 16-byte
    # aligned and, for head dims that are multiples of 16, so are all strides (except the ones
    # the kernel opts out of). Without these hints the build would differ from the real one
    # (scalar instead of vector loads, twice the registers).
    opted_out = set(getattr(kernel, "do_not_specialize", ()) or ())
    hinted = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(kernel.arg_names)
        if name in pointers
        or ("stride" in name and name not in opted_out and _strides_divisible(variant))
    }
    source = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=hinted)
    return source, num_warps


def _strides_divisible(variant: AttentionVariant | WriteKVVariant) -> bool:
    return variant.head_dim % 16 == 0


def ptxas_path(arch: int) -> str:
    """The ptxas Triton itself uses for this architecture (the wheel ships two)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _resource_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """Registers per thread and spill bytes (stores + loads) from ``ptxas -v``."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.MULTILINE)
    gpu = target.group(1) if target else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run(
            [ptxas_path(arch), f"-arch={gpu}", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    text = proc.stdout + proc.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (
        int(regs.group(1)) if regs else None,
        int(spills.group(1)) + int(spills.group(2)) if spills else None,
    )


def compile_variant(variant: AttentionVariant | WriteKVVariant, arch: int) -> CompileReport:
    """Build one variant to a cubin for ``sm_<arch>``; raises whatever the compiler raises."""
    import triton
    from triton.backends.compiler import GPUTarget

    from engine_proc.attention import triton_backend as tb

    if tb.kernels_interpreted():
        raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels are interpreted, not compiled")
    started = time.monotonic()
    source, num_warps = _source(variant)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps}
    )
    seconds = time.monotonic() - started
    registers, spill_bytes = _resource_usage(compiled.asm["ptx"], arch)
    return CompileReport(
        label=variant.label(),
        arch=arch,
        seconds=seconds,
        shared_bytes=int(compiled.metadata.shared),
        registers=registers,
        spill_bytes=spill_bytes,
        num_warps=int(compiled.metadata.num_warps),
    )


def _parse_archs(text: str) -> list[int]:
    try:
        archs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--arch: expected e.g. 80,90, got {text!r}") from exc
    bad = [a for a in archs if a < 75]
    if not archs or bad:
        raise argparse.ArgumentTypeError(
            f"--arch: compute capabilities >= 75 (e.g. 80,86,89,90), got {text!r}"
        )
    return archs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine_proc.attention.triton_aot",
        description="Compile the Triton kernels for NVIDIA GPUs without one (ptxas report).",
    )
    parser.add_argument("--arch", type=_parse_archs, default=[80, 90], help="e.g. 80,86,90")
    parser.add_argument("--quick", action="store_true", help="seven variants instead of all")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it, this compiles the kernels for real GPUs")
        return 2
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: nothing to compile (pip install triton)")
        return 2
    variants = quick_variants() if args.quick else default_variants()
    print(
        f"{'variant':<{LABEL_WIDTH}} {'sm':>3} {'warps':>5} {'regs':>5} {'spill B':>8} "
        f"{'smem KB':>8} {'s':>5}"
    )
    failures = 0
    for arch in args.arch:
        for variant in variants:
            try:
                r = compile_variant(variant, arch)
            except Exception as exc:  # report every variant, then fail
                failures += 1
                print(f"{variant.label():<{LABEL_WIDTH}} {arch:>3} FAILED: {exc!r}"[:400])
                continue
            flag = "" if r.fits else "  exceeds the shared-memory limit"
            failures += not r.fits
            print(
                f"{r.label:<{LABEL_WIDTH}} {arch:>3} {r.num_warps:>5} {r.registers!s:>5} "
                f"{r.spill_bytes!s:>8} {r.shared_bytes / 1024:>8.1f} {r.seconds:>5.1f}{flag}"
            )
    print("all variants compiled" if not failures else f"{failures} variant(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
