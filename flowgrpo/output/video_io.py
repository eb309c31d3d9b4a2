"""Writing generated videos: an mp4 per video, and a png grid with one video's frames per row.

Videos are float tensors ``[F, 3, H, W]`` (batches ``[B, F, 3, H, W]``) in [0, 1], as video
policies' ``decode`` returns them. mp4 writing needs ``imageio-ffmpeg`` (the ``video`` extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import Tensor

from ..images import image_grid, to_uint8


def _frames_uint8(video: Tensor) -> np.ndarray:
    """[F, 3, H, W] in [0, 1] -> uint8 [F, H, W, 3]."""
    if video.ndim != 4 or video.shape[1] != 3:
        raise ValueError(f"a video must be [F, 3, H, W], got {tuple(video.shape)}")
    return to_uint8(video)


def save_mp4(path: str | Path, video: Tensor, fps: int = 16) -> Path:
    """Write one video [F, 3, H, W] in [0, 1] as an H.264 mp4 (frame sides are padded to even sizes
    by repeating the last row / column, which yuv420p needs)."""
    import imageio.v3 as iio

    frames = _frames_uint8(video)
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        iio.imwrite(path, frames, extension=".mp4", plugin="FFMPEG", fps=fps, macro_block_size=1)
    except (ImportError, RuntimeError, OSError) as exc:
        raise RuntimeError(f"cannot write {path}: mp4 output needs imageio-ffmpeg "
                           f"(`pip install imageio-ffmpeg`, the `video` extra): {exc}") from exc
    return path


def save_frame_grid(path: str | Path, videos: Tensor, scale: int = 1) -> Path:
    """Write a png of videos [B, F, 3, H, W]: row b holds the F frames of video b."""
    import imageio.v3 as iio

    if videos.ndim != 5:
        raise ValueError(f"videos must be [B, F, 3, H, W], got {tuple(videos.shape)}")
    b, f = videos.shape[:2]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, image_grid(videos.detach().float().reshape(b * f, *videos.shape[2:]).cpu(), ncol=f, scale=scale))
    return path
