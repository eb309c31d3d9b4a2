"""Activation memory of one training forward of a real-size transformer, counted on the meta device.

The real model (every block, real widths) runs one forward on ``meta`` tensors at the real token
count, with the recipe's LoRA attached, and every tensor autograd saves for backward is counted
once (by storage; parameters excluded: they are weights) through
``torch.autograd.graph.saved_tensors_hooks``. No memory is allocated and nothing is extrapolated
in tokens or depth. Attention is counted as a memory-efficient kernel keeps it (FlashAttention /
cuDNN / efficient SDPA, what a GPU run uses): it saves q, k, v, the output and a float32
log-sum-exp per query, never the L x L score matrix; ``torch.nn.functional.scaled_dot_product_attention``
is replaced by such a stand-in during the count.

The blocks are called through diffusers' gradient-checkpointing hook with a counting stand-in, which
gives per block its inputs and its own saved tensors; the two memory laws are then

* without checkpointing: ``A = A_outside + sum_blocks A_block`` (linear in the tokens N for a fixed
  text length, as every saved tensor is [B, N, width] with efficient attention, and in the depth);
* with gradient checkpointing (``model.gradient_checkpointing``, diffusers' non-reentrant
  ``torch.utils.checkpoint`` around every block): ``A = A_outside + sum_blocks inputs_block +
  max_blocks A_block``: each block keeps only its inputs, and backward recomputes one block at a time.

Both are per micro-batch of ``batch`` samples (CFG in the training forward doubles the batch); the
transient gradient buffers of backward (about twice the largest block's inputs) are not included.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .configs import RealTransformer, build_transformer, transformer_config


@dataclass(frozen=True)
class Geometry:
    """The sample size of one training forward.

    Attributes:
        resolution: image / frame side in pixels (square); frames: video frames (1 for images).
        text_tokens: text-encoder tokens the transformer sees (SD3: 77 CLIP + T5 tokens).
        batch: samples in the micro-batch (x2 with CFG in the training forward).
        reference: an edit model's reference image tokens follow the sample's (same count).
    """

    resolution: int
    frames: int = 1
    text_tokens: int = 256
    batch: int = 1
    reference: bool = False


@dataclass
class ActivationCount:
    """Saved-for-backward bytes of one forward (see the module docstring for the laws)."""

    outside: int = 0
    blocks: list = field(default_factory=list)       # per block call: its own saved bytes
    block_inputs: int = 0                            # unique bytes of every block call's tensor inputs
    image_tokens: int = 0

    @property
    def no_checkpointing(self) -> int:
        return self.outside + sum(self.blocks)

    @property
    def checkpointing(self) -> int:
        return self.outside + self.block_inputs + max(self.blocks, default=0)


class _FlashSDPA(torch.autograd.Function):
    """Shape stand-in of a memory-efficient attention kernel: saves q, k, v, out and a float32 LSE."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - never run: the count stops after forward
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


def _flash_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FlashSDPA.apply(query, key, value)


class _Counter:
    def __init__(self, model: torch.nn.Module):
        self.seen = {p.untyped_storage()._cdata for p in model.parameters()}
        self.count = ActivationCount()
        self.bucket: list[int] | None = None
        self.alive: list[torch.Tensor] = []  # counted tensors stay alive: no storage address is reused

    def _add(self, t: torch.Tensor) -> int:
        key = t.untyped_storage()._cdata
        if key in self.seen:
            return 0
        self.seen.add(key)
        self.alive.append(t)
        return t.untyped_storage().nbytes()

    def pack(self, t):
        n = self._add(t)
        if self.bucket is None:
            self.count.outside += n
        else:
            self.bucket[0] += n
        return t

    def checkpoint(self, module, *args):
        """Stands in for diffusers' gradient-checkpointing function: count inputs, then the block."""
        for a in args:
            if isinstance(a, torch.Tensor):
                self.count.block_inputs += self._add(a)
        outer, self.bucket = self.bucket, [0]
        try:
            out = module(*args)
        finally:
            self.count.blocks.append(self.bucket[0])
            self.bucket = outer
        return out


@contextlib.contextmanager
def _flash_attention():
    original = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = _flash_sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def count_activations(model: torch.nn.Module, inputs: dict) -> ActivationCount:
    """Run ``model(**inputs)`` once (meta or real tensors) and count its saved-for-backward bytes."""
    counter = _Counter(model)
    model.enable_gradient_checkpointing(counter.checkpoint)
    model.train()
    with _flash_attention(), torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
        out = model(**inputs, return_dict=False)[0]
    if isinstance(out, (list, tuple)):
        out = out[0]
    counter.count.outside += counter._add(out)
    return counter.count


# ---------------------------------------------------------------------------- inputs
def latent_grid(entry: RealTransformer, geo: Geometry) -> tuple[int, int, int]:
    """(latent frames, latent side, spatial VAE factor) of ``geo`` for ``entry``'s VAE."""
    spatial = entry.vae_factor
    frames = (geo.frames - 1) // 4 + 1 if geo.frames > 1 else 1
    return frames, geo.resolution // spatial, spatial


def example_inputs(entry: RealTransformer, geo: Geometry, device="meta", dtype=torch.bfloat16) -> tuple[dict, int]:
    """The transformer keyword inputs of one micro-batch of ``geo`` (random / empty tensors on
    ``device``) and its number of image tokens (the sample's; an edit model's reference adds as many)."""
    cfg, b, L = entry.config, geo.batch, geo.text_tokens
    frames, side, _ = latent_grid(entry, geo)
    z = lambda *shape, dt=dtype: torch.randn(*shape, device=device, dtype=dt) if device != "meta" \
        else torch.empty(*shape, device=device, dtype=dt)  # noqa: E731
    t = torch.full((b,), 500.0, device=device)
    cls = entry.class_name
    if cls == "SD3Transformer2DModel":
        n = (side // 2) ** 2
        return {"hidden_states": z(b, cfg["in_channels"], side, side), "encoder_hidden_states": z(b, L, cfg["joint_attention_dim"]),
                "pooled_projections": z(b, cfg["pooled_projection_dim"]), "timestep": t}, n
    packed, n = side // 2, (side // 2) ** 2
    tokens = n * (2 if geo.reference else 1)
    if cls in ("FluxTransformer2DModel", "Flux2Transformer2DModel"):
        axes = 3 if cls == "FluxTransformer2DModel" else 4
        img_ids = torch.zeros(tokens, axes, device=device)
        inputs = {"hidden_states": z(b, tokens, cfg["in_channels"]), "encoder_hidden_states": z(b, L, cfg["joint_attention_dim"]),
                  "timestep": t / 1000, "img_ids": img_ids, "txt_ids": torch.zeros(L, axes, device=device),
                  "guidance": torch.full((b,), 3.5, device=device)}
        if cls == "FluxTransformer2DModel":
            inputs["pooled_projections"] = z(b, cfg["pooled_projection_dim"])
        return inputs, n
    if cls == "QwenImageTransformer2DModel":
        shapes = [[(1, packed, packed)] * (2 if geo.reference else 1)] * b
        return {"hidden_states": z(b, tokens, cfg["in_channels"]), "encoder_hidden_states": z(b, L, cfg["joint_attention_dim"]),
                "encoder_hidden_states_mask": torch.ones(b, L, device=device, dtype=torch.long), "timestep": t / 1000,
                "img_shapes": shapes}, n
    if cls == "ZImageTransformer2DModel":
        return {"x": [z(cfg["in_channels"], 1, side, side) for _ in range(b)], "t": t / 1000,
                "cap_feats": [z(L, cfg["cap_feat_dim"]) for _ in range(b)]}, n
    if cls == "WanTransformer3DModel":
        n = frames * packed * packed
        timestep = torch.full((b, n), 500.0, device=device) if entry.generic_layout and cfg["in_channels"] == 48 else t
        return {"hidden_states": z(b, cfg["in_channels"], frames, side, side), "timestep": timestep,
                "encoder_hidden_states": z(b, L, cfg["text_dim"])}, n
    if cls == "HunyuanVideo15Transformer3DModel":
        n, glyph = frames * side * side, 256
        return {"hidden_states": z(b, cfg["in_channels"], frames, side, side), "timestep": t.to(dtype),
                "encoder_hidden_states": z(b, L, cfg["text_embed_dim"]),
                "encoder_attention_mask": torch.ones(b, L, device=device, dtype=torch.long),
                "encoder_hidden_states_2": z(b, glyph, cfg["text_embed_2_dim"]),
                "encoder_attention_mask_2": torch.ones(b, glyph, device=device, dtype=torch.long),
                "image_embeds": z(b, 729, cfg["image_embed_dim"])}, n
    raise ValueError(f"no example inputs for {cls}")


#: classes whose forward indexes with data-dependent masks (no meta run): counted on the CPU at two
#: small token counts and one / two blocks of the real width, then extrapolated linearly
CPU_FIT = ("HunyuanVideo15Transformer3DModel",)


def activation_bytes(recipe: str | RealTransformer, geo: Geometry, rank: int = 32, dtype=torch.bfloat16,
                     device="meta", **overrides) -> ActivationCount:
    """:class:`ActivationCount` of one training forward of ``recipe``'s transformer (with its LoRA of
    ``rank``) on a micro-batch of ``geo``; ``overrides`` replace config keys (tests: a shallow copy).
    A class in :data:`CPU_FIT` is measured by :func:`linear_fit` instead (on a meta request)."""
    from .memory import wrap_lora

    entry = transformer_config(recipe) if isinstance(recipe, str) else recipe
    if device == "meta" and entry.class_name in CPU_FIT:
        return linear_fit(entry, geo, rank, dtype)
    model = build_transformer(entry, device=device, dtype=dtype, **overrides)
    if rank:
        wrap_lora(model, entry, rank)
    inputs, n = example_inputs(entry, geo, device=device, dtype=dtype)
    count = count_activations(model, inputs)
    count.image_tokens = n
    return count


def linear_fit(entry: RealTransformer, geo: Geometry, rank: int = 32, dtype=torch.bfloat16) -> ActivationCount:
    """:func:`activation_bytes` extrapolated from four CPU forwards of the real width at the real text
    length: image tokens n1 = 16 and n2 = 64 (one frame), one and two blocks. Every term is taken
    linear in the image tokens (efficient attention) and the depth law of the module docstring
    applies: block(N) and outside(N) from the two token counts, the inputs of each further block
    from the difference between two blocks and one."""
    depth_key = "num_layers"
    depth = entry.config[depth_key]
    frames, side, spatial = latent_grid(entry, geo)
    n_real = frames * side * side
    runs = {}
    for n_side in (4, 8):
        small = Geometry(n_side * spatial, 1, geo.text_tokens, geo.batch, geo.reference)
        for layers in (1, 2):
            runs[n_side, layers] = activation_bytes(entry, small, rank, dtype, device="cpu", **{depth_key: layers})
    n1, n2 = 16, 64

    def at(f) -> float:
        a, b = f(4), f(8)
        return a + (b - a) * (n_real - n1) / (n2 - n1)

    block = at(lambda s: runs[s, 1].blocks[0])
    first_inputs = at(lambda s: runs[s, 1].block_inputs)
    more_inputs = at(lambda s: runs[s, 2].block_inputs - runs[s, 1].block_inputs)
    outside = at(lambda s: runs[s, 1].outside)
    return ActivationCount(outside=int(outside), blocks=[int(block)] * depth,
                           block_inputs=int(first_inputs + (depth - 1) * more_inputs), image_tokens=n_real)
