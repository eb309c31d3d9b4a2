"""LoRA through peft on diffusers models, saved so that stock pipelines can load it.

Which layers a LoRA wraps is ``model.lora_targets``: the adapter's own list (``default``), a named
set (:data:`LORA_TARGET_SETS`) or a list of module names in peft's rule (a name equal to an entry or
ending in ``.entry``: ``attn.to_q`` wraps ``transformer_blocks.3.attn.to_q`` but not ``attn2.to_q``).
How the adapter starts is ``model.lora_init``, one of peft's ``init_lora_weights`` that leave B = 0
(:data:`LORA_INITS`), so that the policy starts as the base model.
"""

from __future__ import annotations

import contextlib
import re

from torch import nn

from ...errors import ConfigError

#: ``model.lora_targets`` value that means the adapter's own list (the adapters' ``*_LORA_TARGETS``)
DEFAULT_TARGETS = "default"
#: the q, k, v and output projections of every diffusers ``Attention`` (DanceGRPO's LoRA targets)
ATTENTION_QKVO = ("to_q", "to_k", "to_v", "to_out.0")
#: named sets of ``model.lora_targets``: peft module-name lists, or None for one resolved on the model
LORA_TARGET_SETS: dict[str, tuple[str, ...] | None] = {
    "attention_qkvo": ATTENTION_QKVO,
    # both streams of joint attention (MMDiT): the text stream's projections too
    "attention": (*ATTENTION_QKVO, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
    # every nn.Linear inside a numbered block (embedders and the final projection left out)
    "all_linear": None,
}
#: every valid string of ``model.lora_targets``
LORA_TARGET_CHOICES = (DEFAULT_TARGETS, *LORA_TARGET_SETS)
#: peft ``init_lora_weights`` values that start B at zero: True (A kaiming-uniform, peft's default) and
#: "gaussian" (A ~ N(0, 1/r)); the others change the base weights or start B random
LORA_INITS = (True, "gaussian")
#: ``model.lora_init`` when a run sets none (Flow-GRPO's and DiffusionNFT's)
DEFAULT_LORA_INIT = "gaussian"


def target_matches(name: str, targets) -> bool:
    """Whether peft wraps the module called ``name`` (a dotted path) for ``targets``: a regex string
    must match the whole name; a list matches a name equal to an entry or ending in ``.entry``
    (peft's ``check_target_module_exists`` rule)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def check_lora_init(init) -> bool | str:
    """``init`` when it is one of :data:`LORA_INITS`, else a ConfigError naming ``model.lora_init``."""
    if not (init is True or init == "gaussian"):
        raise ConfigError(f"config key 'model.lora_init' = {init!r} is not one of: true, gaussian (peft's "
                          "init_lora_weights that start B at zero, so the policy starts as the base model)")
    return init


def check_lora_settings(targets, init) -> None:
    """``model.lora_targets`` is a named set or a non-empty list of names and ``model.lora_init`` one of
    :data:`LORA_INITS`, else a ConfigError naming the key. Whether the targets match a layer is checked
    when the model is built (:func:`resolve_targets`)."""
    if isinstance(targets, str) and targets not in LORA_TARGET_CHOICES:
        raise ConfigError(f"config key 'model.lora_targets' = {targets!r} is not one of: "
                          f"{', '.join(LORA_TARGET_CHOICES)}, or a list of module names")
    if not isinstance(targets, str) and (not targets or not all(str(t).strip() for t in targets)):
        raise ConfigError(f"config key 'model.lora_targets' = {targets!r}: a list needs module names, none empty")
    check_lora_init(init)


def _block_linears(model: nn.Module) -> list[str]:
    """Full names of the ``nn.Linear`` modules inside a numbered block (a child of a ``ModuleList``),
    peft's own sublayers (``base_layer``, ``lora_A``...) left out."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and re.search(r"\.\d+\.", f".{n}")
            and not re.search(r"(^|\.)(base_layer|lora_\w+)(\.|$)", n)]


def _examples(model: nn.Module, most: int = 8) -> str:
    """A few linear layers of ``model`` as block-relative names (``attn.to_q``), the names a list takes."""
    seen: list[str] = []
    for name in _block_linears(model) or [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]:
        short = re.sub(r"^.*?\.\d+\.", "", name)
        if short not in seen:
            seen.append(short)
    return ", ".join(seen[:most]) + (", ..." if len(seen) > most else "")


def resolve_targets(model: nn.Module, targets) -> list[str] | str:
    """peft ``target_modules`` for ``targets`` on ``model``: a named set's list (``all_linear``: the
    full names of its block linears), a list or a regex string as given. A ConfigError naming
    ``model.lora_targets`` when nothing matches, or when an entry of a list matches no module."""
    if isinstance(targets, str) and targets in LORA_TARGET_SETS:
        named = LORA_TARGET_SETS[targets]
        resolved = list(named) if named is not None else _block_linears(model)
    else:
        resolved = targets if isinstance(targets, str) else list(targets)
    names = [n for n, _ in model.named_modules()]
    what = f"config key 'model.lora_targets' = {targets!r}"
    where = f"{type(model).__name__} (its linear layers include {_examples(model)})"
    if not resolved or not any(target_matches(n, resolved) for n in names):
        raise ConfigError(f"{what} matches no module of {where}")
    if not isinstance(resolved, str):
        idle = [t for t in resolved if not any(target_matches(n, [t]) for n in names)]
        if idle:
            raise ConfigError(f"{what}: {', '.join(map(repr, idle))} matches no module of {where}")
    return resolved


def add_lora(model: nn.Module, rank: int, alpha: float, targets, name: str = "default",
             init: bool | str = DEFAULT_LORA_INIT) -> None:
    """Attach a peft LoRA adapter on ``targets`` (:func:`resolve_targets`) with peft's
    ``init_lora_weights=init`` (one of :data:`LORA_INITS`: B starts at zero, so the policy starts as
    the base model).

    ``model`` is a diffusers ``ModelMixin`` (it has ``add_adapter``); only the adapter is trainable.
    """
    from peft import LoraConfig

    model.requires_grad_(False)
    resolved = resolve_targets(model, targets)
    _check_rank(model, rank, resolved)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=resolved, init_lora_weights=check_lora_init(init))
    model.add_adapter(config, adapter_name=name)


def _check_rank(model: nn.Module, rank: int, resolved) -> None:
    """A ConfigError naming ``model.lora_rank`` when the LoRA's float32 weights alone, ``rank * (in +
    out)`` values per targeted linear layer, need more memory than the model's device has (rank
    100,000,000 asked peft for a 51 GB matrix and ended in an allocator traceback). A rank above
    min(in, out) is only wasteful (a tiny model's default rank 32 on 24-wide layers), so it is named in
    the message, not refused."""
    from ...memory_floor import GIB, machine_bytes

    layers = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and target_matches(n, resolved)]
    param = next(model.parameters(), None)
    total = machine_bytes(param.device) if param is not None else None
    need = rank * sum(m.in_features + m.out_features for m in layers) * 4
    if total is not None and need > total:
        full = max(min(m.in_features, m.out_features) for m in layers)
        raise ConfigError(f"config key 'model.lora_rank' = {rank}: its LoRA weights alone take {need / GIB:.3g} GiB "
                          f"over {len(layers)} layers of {type(model).__name__}, more than this machine's "
                          f"{total / GIB:.3g} GiB; a LoRA has full rank at min(in, out) = {full} of the widest layer "
                          "it targets")


@contextlib.contextmanager
def lora_disabled(model: nn.Module):
    """Run ``model`` without its LoRA adapters (the frozen base model), then re-enable them."""
    model.disable_adapters()
    try:
        yield
    finally:
        model.enable_adapters()
