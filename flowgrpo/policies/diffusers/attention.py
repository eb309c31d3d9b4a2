"""``model.attention_backend``: the attention kernels of a diffusers transformer, through diffusers' dispatcher.

diffusers routes the attention of its newer transformers (FLUX, Wan, Qwen-Image, Z-Image, FLUX.2,
HunyuanVideo 1.5, ...) through ``diffusers.models.attention_dispatch.dispatch_attention_fn``, whose
kernel is picked per processor by ``ModelMixin.set_attention_backend(name)``. This module maps the
config's names to the dispatcher's, checks that a backend can run here before anything is changed,
and sets it on a transformer:

=========  ===============  ===========================================================================
config     dispatcher       needs
=========  ===============  ===========================================================================
sdpa       (none)           nothing: diffusers' default processors, unchanged (the default)
native     ``native``       nothing: ``torch.nn.functional.scaled_dot_product_attention`` by the dispatcher
flex       ``flex``         torch >= 2.5 (PyTorch's FlexAttention; unfused and slow unless compiled)
flash      ``flash``        the flash-attn package (FlashAttention 2) and a CUDA GPU
flash-3    ``_flash_3``     FlashAttention 3 (``flash_attn_interface``, built from source; Hopper GPUs)
sage       ``sage``         the sageattention package and a CUDA GPU
xformers   ``xformers``     the xformers package and a CUDA GPU
=========  ===============  ===========================================================================

Classic processors that call ``scaled_dot_product_attention`` themselves have no dispatcher switch;
the one a supported model needs, SD3's ``JointAttnProcessor2_0`` (SD3.5-M and -Large), is replaced by
:class:`DispatchJointAttnProcessor`, the same computation through the dispatcher. Any other processor
without the switch is refused, as is a transformer class without ``set_attention_backend``.

Packages are never imported here: availability is diffusers' own check
(``_check_attention_backend_requirements``, which reads the flags diffusers set when it was imported).
The switch is per transformer: ``set_attention_backend`` names the backend on each of its
processors, and diffusers' process-wide default backend, which it also sets, is put back.
"""

from __future__ import annotations

import torch
from torch import nn

#: config name -> (the dispatcher's ``AttentionBackendName`` value, what it needs, whether it needs CUDA);
#: ``sdpa`` is diffusers' default processors, left as they are
ATTENTION_BACKENDS: dict[str, tuple[str | None, str, bool]] = {
    "sdpa": (None, "", False),
    "native": ("native", "", False),
    "flex": ("flex", "a torch with FlexAttention (2.5 or newer)", False),
    "flash": ("flash", "the flash-attn package", True),
    "flash-3": ("_flash_3", "FlashAttention 3's flash_attn_interface package", True),
    "sage": ("sage", "the sageattention package", True),
    "xformers": ("xformers", "the xformers package", True),
}


def backend_problem(name: str) -> str | None:
    """Why config backend ``name`` cannot run on this machine ("needs the xformers package and a CUDA GPU,
    which this machine lacks"), or None when it can."""
    if name not in ATTENTION_BACKENDS:
        return f"it is not one of {', '.join(ATTENTION_BACKENDS)}"
    target, package, cuda = ATTENTION_BACKENDS[name]
    if target is None:
        return None
    import diffusers
    from diffusers.models import attention_dispatch

    missing = []
    check = getattr(attention_dispatch, "_check_attention_backend_requirements", None)
    if check is not None:
        try:
            check(attention_dispatch.AttentionBackendName(target))
        except (RuntimeError, ValueError):
            missing.append(f"{package} (not installed, or older than diffusers {diffusers.__version__} needs)")
    if cuda and not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if not missing:
        return None
    return f"it needs {' and '.join(missing)}, which this machine lacks"


def usable_backends() -> list[str]:
    """The config backends that can run on this machine (``sdpa`` and ``native`` always)."""
    return [name for name in ATTENTION_BACKENDS if backend_problem(name) is None]


def _attention_modules(transformer: nn.Module) -> list[nn.Module]:
    """The attention modules of ``transformer`` set_attention_backend walks (classic ``Attention`` and
    ``AttentionModuleMixin``), with their processor."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    return [m for m in transformer.modules() if isinstance(m, (Attention, AttentionModuleMixin))
            and getattr(m, "processor", None) is not None]


def processor_backends(transformer: nn.Module) -> list:
    """The dispatcher backend of every attention processor of ``transformer`` (None: the dispatcher's
    active backend; a processor without the attribute gives ``"<ClassName>: no dispatcher"``)."""
    return [getattr(m.processor, "_attention_backend", f"{type(m.processor).__name__}: no dispatcher")
            for m in _attention_modules(transformer)]


def set_attention_backend(transformer: nn.Module, name: str) -> None:
    """Route every attention of ``transformer`` through dispatcher backend ``name`` (a config name of
    :data:`ATTENTION_BACKENDS`; ``sdpa`` leaves it as it is). ValueError (its text one line) where the
    class has no dispatcher switch or one of its processors bypasses the dispatcher; RuntimeError where
    diffusers refuses the backend. The caller checks :func:`backend_problem` first."""
    target = ATTENTION_BACKENDS[name][0]
    if target is None:
        return
    cls = type(transformer).__name__
    if not callable(getattr(transformer, "set_attention_backend", None)):
        raise ValueError(f"{cls} has no set_attention_backend() (diffusers' attention dispatcher)")
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    for module in _attention_modules(transformer):
        processor = module.processor
        if hasattr(processor, "_attention_backend"):
            continue
        if type(processor) is JointAttnProcessor2_0:
            module.set_processor(DispatchJointAttnProcessor())
        else:
            raise ValueError(f"{cls}'s attention processor {type(processor).__name__} calls its kernel itself, "
                             "not through diffusers' attention dispatcher")
    import logging

    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    logger = logging.getLogger("diffusers.models.modeling_utils")
    level, active = logger.level, _AttentionBackendRegistry._active_backend
    logger.setLevel(logging.ERROR)  # "Attention backends are an experimental feature ..." on every call
    try:
        transformer.set_attention_backend(target)
    finally:
        logger.setLevel(level)
        # set_attention_backend also makes the backend diffusers' process-wide default, which every
        # processor left at None (any other model's, e.g. a policy with model.attention_backend=sdpa)
        # would pick up; this transformer's processors now name theirs, so the default goes back
        _AttentionBackendRegistry.set_active_backend(active)


class DispatchJointAttnProcessor:
    """diffusers' ``JointAttnProcessor2_0`` (SD3's joint image-text attention, and its image-only
    ``attn2``) with the kernel call through ``dispatch_attention_fn``, so that
    ``set_attention_backend`` reaches it: the same projections, q/k norms and split, in the
    dispatcher's [batch, tokens, heads, head_dim] layout."""

    _attention_backend = None
    _parallel_config = None

    def __call__(self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *args, **kwargs):
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        batch_size, tokens = hidden_states.shape[0], hidden_states.shape[1]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        query, key, value = (t.view(batch_size, -1, attn.heads, head_dim) for t in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if encoder_hidden_states is not None:
            c_query, c_key, c_value = (proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim)
                                       for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                c_query = attn.norm_added_q(c_query)
            if attn.norm_added_k is not None:
                c_key = attn.norm_added_k(c_key)
            query, key, value = (torch.cat([a, b], dim=1) for a, b in ((query, c_query), (key, c_key),
                                                                       (value, c_value)))

        out = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                    backend=self._attention_backend, parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is not None:
            out, encoder_hidden_states = out[:, :tokens], out[:, tokens:]
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, encoder_hidden_states) if encoder_hidden_states is not None else out
