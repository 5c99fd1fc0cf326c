"""The status bar's line on the CPU decode step: which step runs and why, from the engine's
telemetry (`Telemetry.decode_step` and `decode_detail`, docs/PROTOCOL.md)."""

from __future__ import annotations

# The fused step's 4-bit kernels (engine_proc/executor/fused_decode.py INT4_KERNELS), as named
# to a person
KERNEL_LABELS = {
    "avx2_fp32": "AVX2 int4",
    "avx512_bf16": "AVX-512 bf16 int4",
    "portable": "portable int4",
    "torch": "torch's int4 kernel",
}
COMPILING = "decode: eager while the fused step compiles (first start, ~1 min)"


def decode_status_text(step: str, detail: str) -> str:
    """'decode: fused (AVX2 int4)', the compiling line, 'decode: eager: <reason>'; '' when
    the engine reports no CPU decode step (GPU engines, older engines)."""
    if step == "fused":  # detail: the kernel, "+int8" under 8-bit activations (fused_decode.py)
        kernel, _, int8 = detail.partition("+")
        label = KERNEL_LABELS.get(kernel, kernel) + (" x 8-bit activations" if int8 else "")
        return f"decode: fused ({label})"
    if step == "building":
        if detail == "elsewhere":  # another start (another window, a server) is building it
            return COMPILING.replace("compiles", "compiles in another process")
        return COMPILING
    if step == "eager":
        return f"decode: eager: {detail}" if detail else "decode: eager"
    return ""


def decode_status_tip(step: str) -> str:
    if step == "building":
        return ("the fused C++ decode step is compiled once per machine and cached; the engine "
                "switches to it as soon as it is built (until then decoding runs at about a "
                "third of the speed)")
    if step:
        return "the CPU decode step: fused runs a whole step in one C++ call (Engine → Options)"
    return ""
