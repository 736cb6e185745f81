"""The loss-curve PNG written at the end of a run (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional


def plot_loss(history: dict, path, summary: Optional[dict] = None) -> Path:
    """Loss per step (raw and smoothed) and the mask sparsity in the title; returns ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = history["step"], history["loss"]
    if not steps or len(steps) != len(losses):
        raise ValueError("history needs equally long, non-empty 'step' and 'loss' lists")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(steps, losses, lw=0.8, alpha=0.4, label="loss")
    ax.plot(steps, _ema(losses, 0.9), lw=1.8, label="loss (EMA 0.9)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / byte)")
    title = "flashmask3 training"
    if summary:
        title += (f" — {summary.get('mask', '')}, {100 * summary.get('mask_sparsity', 0):.0f}% "
                  f"of pairs skipped, cp={summary.get('world_size', 1)}")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def _ema(values, beta: float) -> list:
    out, acc = [], None
    for v in values:
        acc = v if acc is None else beta * acc + (1 - beta) * v
        out.append(acc)
    return out
