"""Tiny random image-editing pipelines for the generic adapter, built offline (tests, benchmarks).

* FLUX.1-Kontext: ``FluxKontextPipeline`` around the tiny FLUX.1 components of
  :mod:`~flowgrpo.policies.flux_tiny` (the same transformer class; Kontext concatenates the reference
  image's packed latents to the sample's tokens and gives them their own RoPE ids);

Each is deterministic in ``seed`` and leaves the caller's global RNG state untouched.
"""

from __future__ import annotations

from .flux_tiny import tiny_flux_components


def tiny_flux_kontext_pipeline(seed: int = 0):
    """A stock ``FluxKontextPipeline`` over :func:`~flowgrpo.policies.flux_tiny.tiny_flux_components`
    (guidance-distilled, as FLUX.1-Kontext-dev; no IP-adapter image encoder)."""
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline(**tiny_flux_components(seed, guidance_embeds=True))
