"""Atomic checkpoints of a training run: written to a temporary folder, then renamed into place."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

CKPT_PREFIX = "ckpt_"


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` (tensors and plain data) as ``RUN_DIR/checkpoints/ckpt_{iteration:06d}``.

    The folder is complete or absent: it is written under a temporary name and renamed, so a
    crash (even SIGKILL) mid-write never leaves a half checkpoint that resume would pick up.
    Older checkpoints beyond ``keep`` are removed.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CKPT_PREFIX}{iteration:06d}"
    tmp = root / f".tmp_{CKPT_PREFIX}{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    torch.save(state, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(CKPT_PREFIX) and (p / "state.pt").exists())


def latest_checkpoint(run_dir: Path) -> Path | None:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_checkpoint(path: Path) -> dict:
    return torch.load(Path(path) / "state.pt", map_location="cpu", weights_only=False)
