"""Quality-vs-speed and quality-vs-size scatter plots with the Pareto front marked.

Lower perplexity is better, higher tokens/s is better, lower size is better. A variant is on the
front when no other variant is at least as good on both axes and strictly better on one.
Uses matplotlib's Agg backend (no display needed); needs the ``plot`` extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_front(points: list[tuple[float, float]], maximize_x: bool) -> list[int]:
    """Indices of the non-dominated points; y (perplexity) is minimized, x per ``maximize_x``."""
    sign = 1 if maximize_x else -1

    def dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
        better_x, better_y = sign * a[0] >= sign * b[0], a[1] <= b[1]
        strictly = sign * a[0] > sign * b[0] or a[1] < b[1]
        return better_x and better_y and strictly

    return [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]


def plot_tradeoffs(rows: list[dict[str, Any]], path: Path, title: str = "") -> Path | None:
    """Two panels (perplexity vs output tokens/s, perplexity vs weight MB); None if no row has
    both a perplexity and a speed or size."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'compress[plot]'") from exc
    panels = [
        ("tokens_per_s", "decode tokens/s (single stream, p50 TPOT)", True),
        ("weight_mb", "weights MB", False),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    drawn = False
    for ax, (key, label, maximize) in zip(axes, panels, strict=False):
        usable = [r for r in rows if r.get(key) is not None and r.get("perplexity") is not None]
        if not usable:
            ax.set_visible(False)
            continue
        drawn = True
        pts = [(float(r[key]), float(r["perplexity"])) for r in usable]
        front = sorted(pareto_front(pts, maximize), key=lambda i: pts[i][0])
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:blue", zorder=3)
        ax.plot(
            [pts[i][0] for i in front],
            [pts[i][1] for i in front],
            "--o",
            color="tab:red",
            mfc="none",
            ms=12,
            label="Pareto front",
            zorder=2,
        )
        for r, (x, y) in zip(usable, pts, strict=True):
            ax.annotate(
                str(r["variant"]), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=8
            )
        ax.set_xlabel(label + (" (higher is better)" if maximize else " (lower is better)"))
        ax.set_ylabel("perplexity (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    if not drawn:
        plt.close(fig)
        return None
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
