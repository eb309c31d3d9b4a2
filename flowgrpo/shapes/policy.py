"""Policy adapter for the embedded shapes-world model (pixel space, 3x32x32)."""

from __future__ import annotations

from torch import Tensor

from ..errors import UserError
from ..policies.base.lora import DEFAULT_LORA_INIT
from ..policies.diffusers.common import lora_options, make_trainable
from ..policies.base.trained import TrainedPolicy
from .model import ShapesFlowModel

# Attention and feed-forward projections of SD3's MMDiT blocks (image and text streams).
SD3_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]


class ShapesPolicy(TrainedPolicy):
    """Wraps :class:`ShapesFlowModel`.

    Args:
        model: the flow model (default: the weights shipped with the package).
        guidance_scale: classifier-free guidance scale (1 = off, one forward per step).
        train_mode: "lora" (peft adapter on the transformer), "full" (every transformer weight) or
            "frozen" (nothing trainable; evaluation only).
        lora_rank, lora_alpha, lora_targets, lora_init: adapter size, scale, target modules (default
            :data:`SD3_LORA_TARGETS`) and peft's ``init_lora_weights`` (``model.*``).
    """

    latent_shape = (3, 32, 32)
    evaluator = "shapes"
    denoiser_path = "model.transformer"

    def __init__(self, model: ShapesFlowModel | None = None, guidance_scale: float = 1.0, train_mode: str = "lora",
                 lora_rank: int = 32, lora_alpha: float = 64.0, lora_targets: list[str] | str | None = None,
                 lora_init: bool | str = DEFAULT_LORA_INIT):
        super().__init__(guidance_scale)
        self.set_train_mode(train_mode)
        self.model = model if model is not None else ShapesFlowModel.load()
        self.model.requires_grad_(False)
        size = self.model.cfg.image_size
        self.latent_shape = (3, size, size)
        make_trainable(self.model.transformer, train_mode, lora_rank=lora_rank, lora_alpha=lora_alpha,
                       lora_targets=lora_targets or SD3_LORA_TARGETS, lora_init=lora_init)

    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        hidden, pooled = self.model.encode(prompts)
        return {"hidden": hidden, "pooled": pooled}

    def _forward(self, x: Tensor, sigma: Tensor, enc: dict[str, Tensor]) -> Tensor:
        return self.model(x, sigma, enc["hidden"], enc["pooled"])

    def decode(self, latents: Tensor) -> Tensor:
        return ((latents.float() + 1.0) / 2.0).clamp(0.0, 1.0)

    def encode_images(self, images: Tensor) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] -> latents [B, 3, H, W] in [-1, 1] (the inverse of :meth:`decode`;
        Diffusion-DPO's offline pairs)."""
        return images.float() * 2.0 - 1.0


def build_shapes_policy(cfg) -> ShapesPolicy:
    """Factory for ``model.name=shapes`` from a :class:`~flowgrpo.config.ModelConfig`."""
    try:
        model = ShapesFlowModel.load(cfg.path)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    return ShapesPolicy(model, guidance_scale=cfg.guidance_scale, train_mode=cfg.train_mode, **lora_options(cfg))
