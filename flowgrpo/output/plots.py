"""Pictures people would rather look at than read: sample grids and reward curves."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..images import image_grid

#: captions are cut to this many characters before they are measured and drawn: a caption shows two
#: lines at most, and PIL refuses to lay out strings of about a million characters
MAX_CAPTION_CHARS = 400


def clip_caption(text: str, limit: int = MAX_CAPTION_CHARS) -> str:
    """``text`` cut to ``limit`` characters (the last one an ellipsis) for drawing; shorter text unchanged."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


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
        ax.set_title(clip_caption(prompts[i], 120), fontsize=5)
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
    rew = [float("nan") if r.get("reward_mean") is None else r["reward_mean"] for r in records]  # null: no valid reward
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
    """Held-out accuracy against training minutes, with a +-1 standard-error band (each point's
    ``accuracy_se`` where recorded, else binomial of an ``n_samples``-sample accuracy), the
    never-trained-prompts accuracy where measured, and the image fidelity (``fidelity`` of the curve's
    entries, on the same 0-1 scale) where measured. Where every point has its ``per_tag`` accuracies
    (tag -> accuracy) for two tags or more, a second panel draws each tag's curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tags = sorted(set().union(*(c.get("per_tag") or {} for c in curve)))
    by_tag = len(tags) >= 2 and all(set(c.get("per_tag") or {}) == set(tags) for c in curve)
    if by_tag:
        fig, (ax, ax_tags) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.15, 1]})
    else:
        fig, ax = plt.subplots(figsize=(6, 3.5))
    t = np.array([c["train_seconds"] for c in curve]) / 60.0
    acc = np.array([c["accuracy"] for c in curve])
    binomial = np.sqrt(np.clip(acc * (1 - acc), 0, None) / max(1, n_samples))
    # the evaluator's own seed standard error where it gave one (runs before it was recorded: binomial)
    se = np.array([c["accuracy_se"] if c.get("accuracy_se") is not None else b for c, b in zip(curve, binomial)])
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
    if by_tag:
        for tag in tags:
            ax_tags.plot(t, [c["per_tag"][tag] for c in curve], "o-", ms=3, label=tag)
        ax_tags.set_xlabel("training minutes (evaluation time excluded)")
        ax_tags.set_ylabel("held-out accuracy of the tag")
        ax_tags.set_ylim(0, 1)
        ax_tags.grid(alpha=0.3)
        ax_tags.legend(loc="lower right", fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def grid_captions(prompts: list[str], rewards: list[float | None] | None, ncol: int) -> list[tuple[str, list[str]]]:
    """Captions for a grid of ``len(prompts)`` images laid out ``ncol`` per row (row-major, as
    :func:`image_grid` lays them out): one ``(text, cells)`` per row, ``text`` the row's prompts
    (each once, in order, joined by `` | ``; empty prompts are padding and skipped) and ``cells`` a
    label per image of the row, its reward (``r 0.531``; ``""`` where ``rewards`` is None or the
    entry is None)."""
    out = []
    for start in range(0, len(prompts), ncol):
        row = range(start, min(len(prompts), start + ncol))
        seen: list[str] = []
        for i in row:
            if prompts[i] and prompts[i] not in seen:
                seen.append(prompts[i])
        cells = ["" if rewards is None or rewards[i] is None else f"r {rewards[i]:.3f}" for i in row]
        given = [rewards[i] for i in row if rewards is not None and rewards[i] is not None]
        mean = f"  (mean r {float(np.nanmean(given)):.3f})" if len(given) > 1 and not all(np.isnan(given)) else ""
        out.append((" | ".join(seen) + mean, cells))
    return out


def rows_by_key(keys: list, max_rows: int = 8, max_cols: int = 8) -> list[list[int]]:
    """Indices of ``keys`` grouped one row per distinct key (first ``max_rows`` keys in order of
    appearance, at most ``max_cols`` indices each): a sample grid whose rows are prompts."""
    rows: dict = {}
    for i, k in enumerate(keys):
        if k not in rows:
            if len(rows) == max_rows:
                continue
            rows[k] = []
        if len(rows[k]) < max_cols:
            rows[k].append(i)
    return list(rows.values())


def _caption_font(size: int):
    from PIL import ImageFont

    try:
        from matplotlib import font_manager

        return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), size)
    except Exception:  # no matplotlib font or no FreeType: Pillow's own
        try:
            return ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1
            return ImageFont.load_default()


def _fit(text: str, font, width: float) -> str:
    """``text`` cut (with an ellipsis) to at most ``width`` pixels."""
    if font.getlength(text) <= width:
        return text
    while text and font.getlength(text + "…") > width:
        text = text[:-1]
    return text + "…"


def _wrap(text: str, font, width: float, lines: int) -> list[str]:
    """``text`` in at most ``lines`` lines of at most ``width`` pixels (the last cut with an ellipsis)."""
    words, out, cur = clip_caption(text).split(), [], ""
    for w in words:
        if cur and font.getlength(cur + " " + w) > width:
            out.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    out.append(cur)
    if len(out) > lines:
        out = out[:lines - 1] + [" ".join(out[lines - 1:])]
    return [_fit(ln, font, width) for ln in out]


def captioned_grid(images: Tensor, ncol: int, captions: list[tuple[str, list[str]]], pad: int = 2,
                   scale: int = 1) -> np.ndarray:
    """:func:`image_grid` with a caption band above each row: the row's text (its prompt, up to two
    lines) and, centred over each image, that image's label (its reward). ``captions`` as
    :func:`grid_captions` returns them, one per row."""
    from PIL import Image, ImageDraw

    bare = image_grid(images, ncol, pad=pad, scale=scale)
    n, h = images.shape[0], images.shape[2] * max(1, scale)
    w = images.shape[3] * max(1, scale)
    rows = (n + ncol - 1) // ncol
    if len(captions) != rows:
        raise ValueError(f"{rows} grid rows but {len(captions)} captions")
    size = int(min(28, max(11, w // 6)))
    font = _caption_font(size)
    line = size + 3
    has_cells = any(any(c) for _, c in captions)
    width = bare.shape[1]
    texts = [_wrap(t, font, width - 2 * pad - 4, 2) if t else [] for t, _ in captions]
    band = line * (max((len(t) for t in texts), default=0) + has_cells) + 6
    canvas = Image.new("RGB", (width, rows * (band + h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r, (lines, (_, cells)) in enumerate(zip(texts, captions)):
        top = r * (band + h + pad)
        strip = bare[r * (h + pad): r * (h + pad) + h + 2 * pad]
        canvas.paste(Image.fromarray(strip), (0, top + band))
        for k, text in enumerate(lines):
            draw.text((pad + 2, top + 4 + k * line), text, fill=(0, 0, 0), font=font)
        y = top + 4 + len(lines) * line
        for c, label in enumerate(cells):
            if label:
                label = _fit(label, font, w)
                x = pad + c * (w + pad) + (w - font.getlength(label)) / 2
                draw.text((x, y), label, fill=(90, 90, 90), font=font)
    return np.asarray(canvas)


def save_captioned_grid(path: Path, images: Tensor, ncol: int, captions: list[tuple[str, list[str]]],
                        scale: int = 1) -> None:
    """Write :func:`captioned_grid` as a png."""
    import imageio.v3 as iio

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, captioned_grid(images, ncol, captions, scale=scale))


def save_sample_grid(path: Path, images: Tensor, prompts: list[str], row_keys: list, rewards: Tensor | None) -> None:
    """An iteration's samples as a png, one row per prompt (up to 8 prompts x 8 samples), each row
    captioned with its prompt and each image with its reward.

    Args: images, [L, 3, H, W] in [0, 1], or videos [L, F, 3, H, W] (the first also as an mp4 beside
    the png; the frames of up to 8 videos as rows); prompts, [L] each leaf's prompt; row_keys, [L]
    which row a leaf belongs to (its prompt index: tree rollouts interleave prompts among leaves);
    rewards, [L] each leaf's reward or None."""
    path = Path(path)
    reward = (lambda i: None) if rewards is None else (lambda i: float(rewards[i]))
    if images.ndim == 5:
        from .video_io import save_mp4

        save_mp4(path.with_suffix(".mp4"), images[0])
        b, f = min(8, images.shape[0]), images.shape[1]
        frames = images[:b].detach().float().reshape(b * f, *images.shape[2:]).cpu()
        cell_prompts = [prompts[i] for i in range(b) for _ in range(f)]
        cell_rewards = [reward(i) if k == 0 else None for i in range(b) for k in range(f)]
        save_captioned_grid(path, frames, f, grid_captions(cell_prompts, cell_rewards, f), scale=2)
        return
    rows = rows_by_key(row_keys)
    ncol = max(len(r) for r in rows)
    blank = torch.ones_like(images[0])
    cells, cell_prompts, cell_rewards = [], [], []
    for row in rows:
        for k in range(ncol):
            i = row[k] if k < len(row) else None
            cells.append(blank if i is None else images[i])
            cell_prompts.append("" if i is None else prompts[i])
            cell_rewards.append(None if i is None else reward(i))
    save_captioned_grid(path, torch.stack(cells).detach().float().cpu(), ncol,
                        grid_captions(cell_prompts, cell_rewards, ncol), scale=2)
