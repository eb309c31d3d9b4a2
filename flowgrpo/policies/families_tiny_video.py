"""Tiny random video pipelines of the families the generic adapter trains, built offline (tests).

* Wan 2.2 A14B layout: ``WanPipeline`` with two experts of Wan 2.1's tiny transformer layout
  (:mod:`~flowgrpo.policies.wan_tiny`): ``transformer`` for high noise and ``transformer_2`` below
  ``boundary_ratio`` = 0.875 (the A14B T2V value), Wan's UniPC scheduler on flow sigmas;
* Wan 2.2 TI2V-5B layout: ``WanPipeline`` with one transformer over 48 latent channels, the Wan 2.2
  VAE (residual, 2x2 patchified input, 16x spatial compression) and per-token timesteps
  (``expand_timesteps=True``).

Each builder takes a seed, returns the stock pipeline, and leaves the caller's global RNG untouched.
"""

from __future__ import annotations

import torch

from .wan_tiny import TRANSFORMER_TINY, tiny_wan_components

#: the A14B text-to-video boundary: ``transformer`` while t >= 0.875 * 1000
WAN22_BOUNDARY = 0.875


def tiny_wan22_a14b_pipeline(seed: int = 0):
    """A ``WanPipeline`` in the Wan 2.2 A14B layout (two experts split at :data:`WAN22_BOUNDARY`)."""
    from diffusers import WanPipeline, WanTransformer3DModel

    components = tiny_wan_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 11)
        components["transformer_2"] = WanTransformer3DModel(**TRANSFORMER_TINY)
    return WanPipeline(**components, boundary_ratio=WAN22_BOUNDARY)


def tiny_wan22_5b_pipeline(seed: int = 0):
    """A ``WanPipeline`` in the Wan 2.2 TI2V-5B layout (one expert, 48 channels, per-token timesteps)."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    components = tiny_wan_components(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 12)
        components["transformer"] = WanTransformer3DModel(**{**TRANSFORMER_TINY, "in_channels": 48, "out_channels": 48})
        components["vae"] = AutoencoderKLWan(
            base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
            latents_mean=[0.0] * 48, latents_std=[1.0] * 48, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
            scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True]).eval()
    return WanPipeline(**components, transformer_2=None, boundary_ratio=None, expand_timesteps=True)
