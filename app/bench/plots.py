"""The benchmark's PNG plots (optional: only when matplotlib, the `bench` extra, is installed)."""

from __future__ import annotations

import math
from pathlib import Path

from app.bench.workloads import streams_level

NO_PLOTS = ('no plots written: matplotlib is not installed (pip install "kvscope[bench]", or '
            'pip install matplotlib)')


def write_plots(out: Path, runs: dict[str, dict[str, list[dict]]],
                summary: dict[str, dict[str, dict]]) -> list[Path] | None:
    """The PNGs written into `out`; None when matplotlib is not installed (NO_PLOTS says so)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    written = []
    cols = min(3, len(runs))
    nrows = -(-len(runs) // cols)
    for metric in ("ttft", "itl", "e2e"):
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
        flat = [ax for row in axes for ax in row]
        for ax, (workload, by_system) in zip(flat, runs.items(), strict=False):
            lo, hi = math.inf, 0.0
            for system, rs in by_system.items():
                vals = sorted(x for r in rs if "requests" in r for q in r["requests"]
                              for x in (q["itl"] if metric == "itl" else [q[metric]])
                              if x is not None and x > 0)
                if vals:
                    ys = [(i + 1) / len(vals) for i in range(len(vals))]
                    ax.step([0.0, *vals], [0.0, *ys], where="post", label=system)
                    lo, hi = min(lo, vals[0]), max(hi, vals[-1])
            if hi > 10 * lo:
                ax.set_xscale("log")
            ax.set_title(f"{workload}: {metric} CDF", fontsize=9)
            ax.set_xlabel("seconds")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
        for ax in flat[len(runs):]:
            ax.axis("off")
        fig.tight_layout()
        path = out / f"cdf_{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels, values = [], []
    for workload in ("mixed", "mixed-poisson", "prefill", "streaming"):
        key = "prefill_tok_s" if workload == "prefill" else "output_tok_s"
        for system, s in summary.get(workload, {}).items():
            if s.get(key) is not None:
                labels.append(f"{workload}\n{system}")
                values.append(s[key])
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("tok/s (prefill: prompt, others: output)")
    fig.tight_layout()
    path = out / "throughput.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    levels = sorted((streams_level(w), w) for w in summary if streams_level(w))
    if levels:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        for system in ("kvscope", "llamacpp", "hf"):
            pts = [(n, summary[w].get(system, {}).get("decode_tok_s")) for n, w in levels]
            pts = [(n, v) for n, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=system)
        ax.set_xscale("log", base=2)
        ax.set_xticks([n for n, _ in levels], [str(n) for n, _ in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("decode tok/s (all streams)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / "streams.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written

