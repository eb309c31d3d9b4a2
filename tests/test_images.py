"""flowgrpo.images: the one float -> uint8 conversion and PNG encoder every writer and reward uses."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from flowgrpo.images import png_bytes, to_uint8


def test_to_uint8_rounds_clamps_and_moves_channels_last():
    x = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) * 1.4 - 0.2  # some out of [0, 1]
    out = to_uint8(x)
    assert out.dtype == np.uint8 and out.shape == (2, 5, 7, 3)
    ref = np.clip(np.rint(np.clip(x.double().numpy(), 0, 1) * 255), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    assert np.array_equal(out, ref)
    assert np.array_equal(to_uint8(x[1]), out[1])  # one image [3, H, W] -> [H, W, 3]
    assert np.array_equal(to_uint8(x.bfloat16().float()), to_uint8(x.bfloat16()))  # math in float32
    with pytest.raises(ValueError, match="3, H, W"):
        to_uint8(x[0, 0])


def test_png_bytes_is_lossless_for_tensors_and_pixels():
    x = torch.rand(3, 6, 4, generator=torch.Generator().manual_seed(1))
    for image in (x, to_uint8(x)):
        decoded = np.asarray(Image.open(io.BytesIO(png_bytes(image))).convert("RGB"))
        assert np.array_equal(decoded, to_uint8(x))
