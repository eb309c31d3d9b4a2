"""Image statistics that reward hacking moves: pure functions of a batch of images.

Every function takes images ``[N, 3, H, W]`` (or videos ``[N, F, 3, H, W]``, each statistic then the
mean over the frames of a video) as floats in [0, 1] (values outside are clamped) on any device, and
returns one number per image, a float64 tensor ``[N]`` on the CPU. Colour is read as in an sRGB
file: ``luminance`` is Rec. 601 luma (PIL's "L" conversion), no gamma decoding.

* :func:`dark_share` -- fraction of pixels darker than ``level`` (OCR rewards turn backgrounds
  black: UniRL #407 reports 0.45 -> 0.93);
* :func:`saturation` -- mean HSV saturation (over-saturated colour, a common preference-model hack);
* :func:`grid_energy` -- share of the image's variance that repeats with the ``period``-pixel grid
  of the VAE / patch tokens (the grid artefacts of flow_grpo #233);
* :func:`high_freq_energy` -- share of the variance above ``cutoff`` cycles per pixel (noise and
  fine texture).

:func:`image_stats` computes all four at once (:class:`ImageStats`). The monitors
(:mod:`flowgrpo.monitors`) log their means at every held-out evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: luminance (0-1) below which a pixel counts as dark: 0.1 is 25.5 of 255
DARK_LEVEL = 0.1
#: pixels per grid period: 8 (the VAE's downsampling) x 2 (a transformer's 2 x 2 patches) for SD3,
#: FLUX and Wan; a 16-pixel grid's spectrum holds the 8-pixel grid's harmonics too
GRID_PERIOD = 16
#: radial spatial frequency (cycles per pixel; Nyquist 0.5) above which energy counts as high-frequency
HIGH_FREQ_CUTOFF = 0.25
#: images per FFT batch in :func:`high_freq_energy` (bounds its memory on large images)
_FFT_CHUNK = 16


def _frames(images: Tensor) -> tuple[Tensor, int]:
    """Images [N, 3, H, W] or videos [N, F, 3, H, W] -> (float64 CPU images [N * F, 3, H, W] in [0, 1], F)."""
    if images.ndim == 5:
        n, f = images.shape[:2]
        return _frames(images.reshape(n * f, *images.shape[2:]))[0], f
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"image statistics take images [N, 3, H, W] or videos [N, F, 3, H, W], got "
                         f"{tuple(images.shape)}")
    return images.detach().to("cpu", torch.float64).clamp(0.0, 1.0), 1


def _per_item(values: Tensor, frames: int) -> Tensor:
    """[N * F] per-frame values -> [N] per-video means (F = 1: unchanged)."""
    return values.reshape(-1, frames).mean(1)


def luminance(images: Tensor) -> Tensor:
    """Rec. 601 luma ``0.299 R + 0.587 G + 0.114 B`` of images [N, 3, H, W] in [0, 1]: [N, H, W] float64."""
    x, _ = _frames(images)
    return 0.299 * x[:, 0] + 0.587 * x[:, 1] + 0.114 * x[:, 2]


def dark_share(images: Tensor, level: float = DARK_LEVEL) -> Tensor:
    """Fraction of each image's pixels whose luminance (:func:`luminance`, 0-1) is below ``level``.

    Returns float64 [N] in [0, 1]: 1 for a black image, 0 for a white one."""
    x, f = _frames(images)
    return _per_item((luminance(x) < level).double().flatten(1).mean(1), f)


def saturation(images: Tensor) -> Tensor:
    """Mean HSV saturation of each image: per pixel ``(max - min) / max`` over R, G, B (0 where
    ``max`` = 0). Returns float64 [N] in [0, 1]: 0 for any grey image, 1 for pure primaries."""
    x, f = _frames(images)
    hi, lo = x.amax(1), x.amin(1)
    sat = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))
    return _per_item(sat.flatten(1).mean(1), f)


def grid_energy(images: Tensor, period: int = GRID_PERIOD) -> Tensor:
    """Share of each image's luminance variance that repeats every ``period`` pixels in both axes.

    In the spectrum: the luminance (cropped at the top left to multiples of ``period``, mean
    removed) has power ``|FFT|^2``; a pattern that repeats every ``period`` pixels puts all of its
    power on the lattice of frequencies that are multiples of ``1 / period`` cycles per pixel in
    both axes (``period**2 - 1`` bins besides DC, the grid's fundamental and harmonics). The
    statistic is the lattice's share of the power. By Parseval it equals the variance of the mean
    ``period x period`` tile (the image's periodic part) over the image's variance, which is how it
    is computed here (no FFT, exact).

    Returns float64 [N] in [0, 1]: 1 for a checkerboard of ``period / 2``-pixel squares (or any
    pattern of that period), about ``(period**2 - 1) / (H * W - 1)`` for white noise, 0 for a flat
    image (no variance). Images smaller than ``period`` are refused."""
    x, f = _frames(images)
    h, w = (x.shape[-2] // period) * period, (x.shape[-1] // period) * period
    if h == 0 or w == 0:
        raise ValueError(f"grid_energy: images of {tuple(x.shape[-2:])} pixels hold no {period}-pixel period")
    y = luminance(x[..., :h, :w])
    y = y - y.mean((1, 2), keepdim=True)
    tile = y.reshape(len(y), h // period, period, w // period, period).mean((1, 3))  # [N, P, P]
    total = (y ** 2).mean((1, 2))
    periodic = (tile ** 2).mean((1, 2))
    share = torch.where(total > 0, periodic / total.clamp_min(1e-300), torch.zeros_like(total))
    return _per_item(share.clamp(0.0, 1.0), f)


def high_freq_energy(images: Tensor, cutoff: float = HIGH_FREQ_CUTOFF) -> Tensor:
    """Share of each image's luminance power (mean removed) at radial frequencies above ``cutoff``
    cycles per pixel (``sqrt(fx**2 + fy**2)``; Nyquist is 0.5 per axis).

    Returns float64 [N] in [0, 1]: 1 for a one-pixel checkerboard (all power at (0.5, 0.5)), about
    ``1 - pi * cutoff**2`` for white noise (0.80 at 0.25), near 0 for smooth images, 0 for a flat one."""
    x, f = _frames(images)
    h, w = x.shape[-2:]
    radius = torch.sqrt(torch.fft.fftfreq(h, dtype=torch.float64)[:, None] ** 2
                        + torch.fft.rfftfreq(w, dtype=torch.float64)[None, :] ** 2)
    # rfft2 keeps half the spectrum: the columns other than 0 (and Nyquist, for even w) stand for two bins
    weight = torch.full((w // 2 + 1,), 2.0, dtype=torch.float64)
    weight[0] = 1.0
    if w % 2 == 0:
        weight[-1] = 1.0
    high = (radius > cutoff).double() * weight
    out = []
    for start in range(0, len(x), _FFT_CHUNK):
        y = luminance(x[start:start + _FFT_CHUNK])
        power = torch.fft.rfft2(y - y.mean((1, 2), keepdim=True)).abs() ** 2
        total = (power * weight).sum((1, 2))
        share = torch.where(total > 0, (power * high).sum((1, 2)) / total.clamp_min(1e-300), torch.zeros_like(total))
        out.append(share.clamp(0.0, 1.0))
    return _per_item(torch.cat(out), f)


@dataclass(frozen=True)
class ImageStats:
    """The four statistics of a batch, each float64 [N] on the CPU (see the module docstring)."""

    dark_share: Tensor
    saturation: Tensor
    grid_energy: Tensor
    high_freq: Tensor

    def means(self) -> dict[str, float]:
        """Each statistic's mean over the batch, as plain floats keyed by field name."""
        return {name: float(getattr(self, name).mean()) for name in STAT_NAMES}


#: the statistics :func:`image_stats` measures, in :class:`ImageStats`' field order
STAT_NAMES = ("dark_share", "saturation", "grid_energy", "high_freq")


def image_stats(images: Tensor, dark_level: float = DARK_LEVEL, grid_period: int = GRID_PERIOD,
                high_freq_cutoff: float = HIGH_FREQ_CUTOFF) -> ImageStats:
    """:func:`dark_share`, :func:`saturation`, :func:`grid_energy` and :func:`high_freq_energy` of
    images [N, 3, H, W] (or videos [N, F, 3, H, W]) in [0, 1]."""
    return ImageStats(dark_share(images, dark_level), saturation(images), grid_energy(images, grid_period),
                      high_freq_energy(images, high_freq_cutoff))
