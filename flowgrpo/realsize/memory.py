"""Parameter, LoRA and per-GPU training-state memory of a recipe's real transformer, on the meta device.

What a LoRA run keeps per GPU (``flowgrpo/trainer`` and ``flowgrpo/policies``: ``make_trainable``
holds LoRA weights in float32 whatever ``model.dtype``; the trainer's optimizer is torch AdamW over
``policy.trainable_parameters()``; ``train.ema`` keeps one more float32 copy of them):

====================  =================================================================
frozen base weights   every transformer parameter in ``model.dtype`` (bf16: 2 B; the
                      submodules the class keeps in float32, 4 B), times the experts
LoRA weights          4 B per LoRA parameter (float32; they are their own master copy)
gradients             4 B per LoRA parameter (float32, as the weights)
AdamW moments         8 B per LoRA parameter (``exp_avg`` and ``exp_avg_sq``, float32)
EMA                   4 B per LoRA parameter when ``train.ema`` (the default)
====================  =================================================================

Replicated (one GPU, or data parallel on N): every GPU holds all of it. FSDP2
(``configs/accelerate/fsdp.yaml``; :class:`flowgrpo.trainer.engines.FullyShardedWeights`): every
weight, gradient, moment and EMA tensor is sharded, 1/N per GPU, plus the gathered weights of the
block running (and the next one, prefetched): 2 x the largest block's bytes. Text encoders, the VAE
and activations are not in these columns (activations: :mod:`flowgrpo.realsize.activations`).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass

import torch

from .configs import RealTransformer, build_transformer, recipe_config, transformer_config

GIB = 2**30
#: bytes per LoRA parameter of each float32 training tensor
LORA_BYTES = {"lora_weights": 4, "gradients": 4, "adamw": 8, "ema": 4}


def parameter_count(model: torch.nn.Module) -> int:
    """``sum(p.numel())`` over every parameter (meta tensors count their shapes)."""
    return sum(p.numel() for p in model.parameters())


def parameter_bytes(model: torch.nn.Module, trainable: bool | None = None) -> int:
    """Bytes of the parameters (all; or only those whose ``requires_grad`` is ``trainable``)."""
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if trainable is None or p.requires_grad == trainable)


def block_of(name: str) -> str:
    """The block type of a module path: the path up to its first numbered level, the number
    replaced (``transformer_blocks.3.attn.to_q`` -> ``transformer_blocks``; ``proj_out`` -> itself)."""
    match = re.match(r"(.*?)\.\d+(\.|$)", name)
    return match.group(1) if match else name


def largest_block_bytes(model: torch.nn.Module) -> int:
    """Bytes of the largest numbered block (a child of a ``ModuleList``): FSDP's wrap unit."""
    sizes = [parameter_bytes(child) for module in model.modules() if isinstance(module, torch.nn.ModuleList)
             for child in module]
    return max(sizes, default=parameter_bytes(model))


def wrap_lora(model: torch.nn.Module, entry: RealTransformer, rank: int, alpha: float | None = None,
              preset: str | None = None) -> None:
    """Attach the recipe's LoRA to ``model`` (a meta model stays on meta) with the project's own
    :func:`flowgrpo.policies.base.lora.add_lora`, on the targets and with the init that ``preset`` (None:
    the recipe's own method) trains (:meth:`~flowgrpo.realsize.configs.RealTransformer.lora`)."""
    from ..policies.base.lora import add_lora

    targets, init = entry.lora(preset)
    with torch.device(next(model.parameters()).device):
        add_lora(model, rank, float(alpha if alpha is not None else 2 * rank), targets, init=init)


def lora_layer_counts(recipe: str, rank: int = 0, preset: str | None = None) -> dict:
    """The layers the LoRA of ``preset`` (None: the recipe's own method) on ``recipe`` wraps on the real
    transformer (meta device), per block type, at ``rank`` (0: that configuration's ``model.lora_rank``).

    Returns ``{"recipe", "rank", "wrapped", "wrapped_by_block": {block: n}, "wrapped_by_layer":
    {"transformer_blocks.*.attn.to_q": n, ...}, "lora_params"}`` for one expert."""
    from peft.tuners.lora import LoraLayer

    from ..errors import UserError

    entry = transformer_config(recipe)
    mode = recipe_config(recipe, preset).model.train_mode
    if mode != "lora":
        raise UserError(f"{preset or 'the recipe method'} on {recipe} trains with model.train_mode={mode}: no LoRA layers")
    rank = rank or entry.lora_rank(preset)
    model = build_transformer(entry)
    wrap_lora(model, entry, rank, preset=preset)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    return {"recipe": recipe, "rank": rank, "wrapped": len(wrapped),
            "wrapped_by_block": dict(Counter(block_of(n) for n in wrapped)),
            "wrapped_by_layer": dict(Counter(re.sub(r"\.\d+\.", ".*.", n, count=1) for n in wrapped)),
            "lora_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}


@dataclass
class TrainingState:
    """One recipe's parameter counts and per-GPU training-state bytes (all experts together).

    ``per_gpu`` maps a layout name (``"1 GPU"``, ``"8 GPUs"``, ``"8 GPUs FSDP"``...) to a dict of
    bytes: ``base_weights``, ``lora_weights``, ``gradients``, ``adamw``, ``ema``, ``fsdp_gathered``
    and ``total``.
    """

    recipe: str
    class_name: str
    experts: int
    transformer_params: int
    lora_params: int
    lora_rank: int
    wrapped_layers: int
    wrapped_by_block: dict
    dtype: str
    base_bytes: int
    largest_block_bytes: int
    ema: bool
    per_gpu: dict

    def as_dict(self) -> dict:
        return asdict(self)


def layout_bytes(state_bytes: dict, gpus: int, fsdp: bool, block_bytes: int) -> dict:
    """Per-GPU bytes of one layout: ``state_bytes`` (whole-model bytes per kind) kept whole
    (replicated) or 1/``gpus`` each plus 2 gathered blocks (FSDP)."""
    share = (lambda b: -(-b // gpus)) if fsdp else (lambda b: b)
    out = {k: share(v) for k, v in state_bytes.items()}
    out["fsdp_gathered"] = 2 * block_bytes if fsdp and gpus > 1 else 0
    out["total"] = sum(out.values())
    return out


def layouts(gpus_list=(1, 8)) -> list[tuple[str, int, bool]]:
    """(name, gpus, fsdp) of the table's layouts: each GPU count replicated, and with FSDP above 1."""
    rows = []
    for g in gpus_list:
        rows.append((f"{g} GPU" + ("s" if g > 1 else ""), g, False))
        if g > 1:
            rows.append((f"{g} GPUs FSDP", g, True))
    return rows


def training_state(recipe: str | RealTransformer, gpus_list=(1, 8), rank: int = 0,
                   dtype: torch.dtype = torch.bfloat16, ema: bool | None = None) -> TrainingState:
    """Count ``recipe``'s transformer and LoRA on the meta device and size its training state for each
    layout of :func:`layouts` (``rank`` 0: the recipe's; ``ema`` None: the recipe's ``train.ema``)."""
    from peft.tuners.lora import LoraLayer

    entry = transformer_config(recipe) if isinstance(recipe, str) else recipe
    rank = rank or entry.lora_rank()
    if ema is None:
        ema = recipe_config(entry.recipe).train.ema
    model = build_transformer(entry, dtype=dtype)
    total = parameter_count(model)
    base = parameter_bytes(model)
    block = largest_block_bytes(model)
    wrap_lora(model, entry, rank)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    wrapped = [n for n, m in model.named_modules() if isinstance(m, LoraLayer)]
    n = len(entry.experts)
    state_bytes = {"base_weights": n * base, **{k: n * lora * b for k, b in LORA_BYTES.items()}}
    if not ema:
        state_bytes["ema"] = 0
    per_gpu = {name: layout_bytes(state_bytes, g, fsdp, block) for name, g, fsdp in layouts(gpus_list)}
    return TrainingState(recipe=entry.recipe, class_name=entry.class_name, experts=n, transformer_params=n * total,
                         lora_params=n * lora, lora_rank=rank, wrapped_layers=n * len(wrapped),
                         wrapped_by_block=dict(Counter(block_of(w) for w in wrapped)), dtype=str(dtype).split(".")[-1],
                         base_bytes=n * base, largest_block_bytes=block, ema=bool(ema), per_gpu=per_gpu)
