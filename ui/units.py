"""How every panel writes a number of bytes."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def short_bytes(n: int) -> str:
    """'256 MiB', '1 GiB', '1.5 GiB' (human_bytes without a needless '.0')."""
    text = human_bytes(n)
    return text.replace(".0 ", " ")
