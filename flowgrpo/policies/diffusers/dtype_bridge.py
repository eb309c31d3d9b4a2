"""A module kept in another dtype than the pipeline around it: inputs cast in, outputs cast back.

flowgrpo keeps the VAE in float32 whatever ``model.dtype`` is (decoding in bf16 costs image quality
for little memory), while a stock pipeline hands the VAE tensors in its own dtype: FLUX.2 decodes
its bf16 latents, FLUX.1-Kontext and Qwen-Image-Edit encode their bf16 reference images. The
stock pipelines assume one dtype for every module, so without a bridge those calls fail with
"Input type (BFloat16) and bias type (float) should be the same".

:func:`bridge_dtype` hooks each direct child of a module (a VAE's ``encoder``, ``decoder``,
``quant_conv``, ...: what ``encode`` and ``decode`` call): floating tensors among its positional and
keyword inputs (and in tuples among them) are cast to the child's own parameter dtype, and floating
tensors it returns are cast back to the dtype its first floating input had. The computation runs in the module's precision; the
pipeline sees its own dtype, as if the module were stored in it.
"""

from __future__ import annotations

from torch import Tensor, nn

_BRIDGED = "_flowgrpo_dtype_bridged"


def _own_dtype(module: nn.Module):
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


def _cast(value, dtype):
    """``value`` in ``dtype`` if it is a floating tensor, a tuple of them with each such element cast,
    else ``value`` itself. Lists and dicts pass through untouched: callees mutate them in place (the
    Wan VAE's ``feat_cache`` list carries its causal-convolution cache between chunks)."""
    if isinstance(value, Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if type(value) is tuple:
        return tuple(_cast(v, dtype) for v in value)
    return value


def _cast_output(value, dtype):
    """A child's output with its floating tensors in ``dtype``: a tensor, a tuple, or a diffusers
    ``BaseOutput`` (an OrderedDict dataclass; set in place, which keeps its type)."""
    if isinstance(value, dict):
        for k in list(value):
            value[k] = _cast(value[k], dtype)
        return value
    return _cast(value, dtype)


def _first_float_dtype(values):
    for v in values:
        if isinstance(v, Tensor) and v.is_floating_point():
            return v.dtype
    return None


def bridge_dtype(module: nn.Module) -> nn.Module:
    """Hook the direct children of ``module`` (see the module docstring); idempotent. Returns ``module``."""
    if getattr(module, _BRIDGED, False):
        return module
    for child in module.children():
        own = _own_dtype(child)
        if own is None:
            continue
        callers: list = []  # a stack: a child may be re-entered (a decoder called per frame chunk)

        def pre(mod, args, kwargs, own=own, callers=callers):
            callers.append(_first_float_dtype([*args, *kwargs.values()]))
            return _cast(args, own), {k: _cast(v, own) for k, v in kwargs.items()}

        def post(mod, args, kwargs, output, callers=callers):
            caller = callers.pop()
            return output if caller is None else _cast_output(output, caller)

        child.register_forward_pre_hook(pre, with_kwargs=True)
        child.register_forward_hook(post, with_kwargs=True, always_call=True)
    object.__setattr__(module, _BRIDGED, True)
    return module
