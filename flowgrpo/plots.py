"""Pictures people would rather look at than read: sample grids and reward curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def image_grid(images: Tensor, ncol: int, pad: int = 2, scale: int = 1) -> np.ndarray:
    """images [N, 3, H, W] in [0, 1] -> uint8 grid [rows*(H+pad), ncol*(W+pad), 3] (white padding)."""
    n, _, h, w = images.shape
    if scale > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=scale, mode="nearest")
        h, w = h * scale, w * scale
    rows = (n + ncol - 1) // ncol
    grid = np.full((rows * (h + pad) + pad, ncol * (w + pad) + pad, 3), 255, dtype=np.uint8)
    arr = (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i in range(n):
        r, c = divmod(i, ncol)
        grid[pad + r * (h + pad): pad + r * (h + pad) + h, pad + c * (w + pad): pad + c * (w + pad) + w] = arr[i]
    return grid


def save_grid(path: Path, images: Tensor, ncol: int, scale: int = 1) -> None:
    import imageio.v3 as iio

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, image_grid(images, ncol, scale=scale))


def save_labeled_grid(path: Path, images: Tensor, prompts: list[str], correct: list[float] | None,
                      ncol: int, title: str = "") -> None:
    """A matplotlib grid with each image's prompt, the verifier's verdict in the frame colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(prompts)
    rows = (n + ncol - 1) // ncol
    fig, axes = plt.subplots(rows, ncol, figsize=(ncol * 1.6, rows * 1.75), squeeze=False)
    arr = images.clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    for i, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if i >= n:
            ax.axis("off")
            continue
        ax.imshow(arr[i], interpolation="nearest")
        ax.set_title(prompts[i], fontsize=5)
        if correct is not None:
            color = "tab:green" if correct[i] >= 1 else "tab:red"
            for s in ax.spines.values():
                s.set_edgecolor(color)
                s.set_linewidth(2)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def save_reward_curve(path: Path, records: list[dict], eval_points: list[tuple[int, float]] | None = None) -> None:
    """Reward (and held-out accuracy where evaluated) against iteration and against wall-clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = [r["iteration"] for r in records]
    rew = [r.get("reward_mean", float("nan")) for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(it, rew, lw=0.8, alpha=0.5, label="reward (batch mean)")
    if len(rew) >= 5:
        k = max(2, len(rew) // 20)
        smooth = np.convolve(rew, np.ones(k) / k, mode="valid")
        ax.plot(it[k - 1:], smooth, lw=2, label=f"reward ({k}-iter mean)")
    if eval_points:
        ax2 = ax.twinx()
        ax2.plot([p[0] for p in eval_points], [p[1] for p in eval_points], "o--", color="tab:red",
                 label="held-out accuracy")
        ax2.set_ylabel("held-out accuracy")
        ax2.set_ylim(0, 1)
        ax2.legend(loc="lower right", fontsize=8)
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_accuracy_curve(path: Path, curve: list[dict], n_samples: int) -> None:
    """Held-out accuracy against training minutes, with a +-1 standard-error band (binomial, of an
    ``n_samples``-sample accuracy), the never-trained-prompts accuracy where measured, and the image
    fidelity (``fidelity`` of the curve's entries, on the same 0-1 scale) where measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.array([c["train_seconds"] for c in curve]) / 60.0
    acc = np.array([c["accuracy"] for c in curve])
    se = np.sqrt(np.clip(acc * (1 - acc), 0, None) / max(1, n_samples))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.fill_between(t, acc - se, acc + se, color="tab:blue", alpha=0.2, label="+-1 s.e.")
    ax.plot(t, acc, "o-", color="tab:blue", label=f"held-out accuracy ({n_samples} samples)")
    unseen = [c.get("accuracy_unseen") for c in curve]
    if all(u is not None and np.isfinite(u) for u in unseen):
        ax.plot(t, unseen, "s--", color="tab:orange", ms=4, label="prompts never trained on")
    fid = [(tt, c["fidelity"]) for tt, c in zip(t, curve) if c.get("fidelity") is not None]  # absent in old runs
    if fid:
        ax.plot([p[0] for p in fid], [p[1] for p in fid], "^:", color="tab:green", ms=4, clip_on=False,
                label="image fidelity (1 = clean drawing)")  # often at 1.0, the top edge
    ax.set_xlabel("training minutes (evaluation time excluded)")
    ax.set_ylabel("accuracy (strict GenEval rule)" + (" / fidelity" if fid else ""))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
