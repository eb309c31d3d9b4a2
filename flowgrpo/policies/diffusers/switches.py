"""The model switches of :class:`~flowgrpo.config.ModelConfig`, implemented once for every diffusers adapter.

:class:`SwitchedPolicy` is a base class of every diffusers adapter (through
:class:`~flowgrpo.policies.diffusers.policy.DiffusersPolicy`); each calls
:meth:`SwitchedPolicy.apply_switches` at the end of its constructor (after
:func:`~flowgrpo.policies.diffusers.common.load_frozen` has set the dtypes and
:func:`~flowgrpo.policies.diffusers.common.make_trainable` the adapter), and implements
:meth:`SwitchedPolicy._encode_now` (its own prompt recipe) instead of ``_encode``.

=========================  =====================================================================
switch                     what it does (the same for every adapter)
=========================  =====================================================================
gradient_checkpointing     ``transformer.enable_gradient_checkpointing()``
vae_slicing / vae_tiling   ``vae.enable_slicing()`` / ``vae.enable_tiling()``
offload_text_encoders      the ``text_encoder*`` modules live on the CPU and visit the transformer's
                           device only to encode prompts not yet seen; encodings are kept per prompt
                           in an LRU dict of ``prompt_cache_size`` entries
precompute_prompts         (called by the trainer with the run's prompts, not a constructor switch)
                           :meth:`SwitchedPolicy.precompute_prompts` encodes a fixed prompt set once
                           into CPU memory and moves the text encoders to the meta device (their
                           memory is freed); a prompt outside the set is refused by name; on CUDA
                           the transformer waits in host memory meanwhile (:mod:`.parking`)
attention_backend          ``sdpa``: diffusers' default processors, unchanged; ``native``, ``flex``,
                           ``flash``, ``flash-3``, ``sage``, ``xformers``: diffusers' attention
                           dispatcher, ``transformer.set_attention_backend(...)``
                           (:mod:`~flowgrpo.policies.diffusers.attention`)
compile_transformer        ``true`` / ``whole``: ``transformer.compile()`` (``torch.compile`` of its
                           forward in place); ``regional``: each repeated block compiled in place
                           instead (diffusers' ``compile_repeated_blocks()`` where the class names
                           its ``_repeated_blocks``, else every entry of its block lists)
=========================  =====================================================================

A switch that cannot apply to a model (its VAE class lacks the method in the installed diffusers,
its transformer does not support checkpointing, an attention backend's package or CUDA is missing)
raises a :class:`~flowgrpo.errors.ConfigError` naming the key, the model and the reason (for an
attention backend also the backends usable on this machine); none is ignored.

``torch.compile`` uses its default backend (inductor) unless the environment variable
``FLOWGRPO_COMPILE_BACKEND`` names another one; the tests set ``aot_eager`` there, because a cold
inductor build of the tiny transformers takes about a minute on two CPU cores.
"""

from __future__ import annotations

import os
from abc import abstractmethod
from collections import OrderedDict

import torch
from torch import Tensor, nn

from ...errors import ConfigError, UserError
from ..base.trained import TrainedPolicy
from .attention import ATTENTION_BACKENDS, backend_problem, set_attention_backend, usable_backends
from .parking import networks_in_host_memory

#: the ``ModelConfig`` fields every diffusers adapter takes as keyword arguments (:func:`runtime_options`)
SWITCHES = ("gradient_checkpointing", "vae_slicing", "vae_tiling", "offload_text_encoders", "attention_backend",
            "compile_transformer")
#: ``model.compile_transformer`` values: False (off), True / "whole" (the forward), "regional" (each block)
COMPILE_MODES = (False, True, "whole", "regional")
#: environment variable naming the ``torch.compile`` backend (unset: torch's default, inductor)
COMPILE_BACKEND_ENV = "FLOWGRPO_COMPILE_BACKEND"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (UserError on an unknown name)."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise UserError(f"unknown model dtype {name!r}; valid: float32, bfloat16, float16") from None


def repeated_blocks(network: nn.Module) -> list[nn.Module]:
    """The blocks regional compilation compiles: the modules whose class ``network._repeated_blocks``
    names (diffusers' ``compile_repeated_blocks()`` rule), else every entry of each ``nn.ModuleList``
    child of ``network`` (``transformer_blocks``, ``single_transformer_blocks``, ``layers``, ...)."""
    names = set(getattr(network, "_repeated_blocks", None) or ())
    if names:
        return [m for m in network.modules() if type(m).__name__ in names]
    return [block for child in network.children() if isinstance(child, nn.ModuleList) for block in child]


def runtime_options(cfg) -> dict:
    """The model switches of a ``ModelConfig`` (:data:`SWITCHES`) as keyword arguments of any diffusers adapter."""
    return {n: getattr(cfg, n) for n in SWITCHES if hasattr(cfg, n)}


class SwitchedPolicy(TrainedPolicy):
    """A policy over a diffusers transformer pipeline that honours the model switches.

    Subclasses hold ``transformer``, ``vae`` and their text encoders as submodules named
    ``text_encoder*``, set :attr:`model_name` and implement :meth:`_encode_now`.
    """

    #: the model family named in error messages ("SD3", "FLUX", "Wan")
    model_name = "diffusers"

    def apply_switches(self, *, gradient_checkpointing: bool = False, vae_slicing: bool = False,
                       vae_tiling: bool = False, offload_text_encoders: bool = False, attention_backend: str = "sdpa",
                       compile_transformer: bool | str = False, prompt_cache_size: int = 1024) -> None:
        """Turn the switches on (see the module docstring); ConfigError for one that cannot apply."""
        self._check_compile_mode(compile_transformer)
        if gradient_checkpointing:
            if not getattr(self.transformer, "_supports_gradient_checkpointing", False):
                raise self._cannot("gradient_checkpointing", True, f"{type(self.transformer).__name__} does not "
                                   "support gradient checkpointing")
            self.transformer.enable_gradient_checkpointing()
        for key, wanted, method in (("vae_slicing", vae_slicing, "enable_slicing"),
                                    ("vae_tiling", vae_tiling, "enable_tiling")):
            if wanted:
                self._enable_vae(key, method)
        self._set_attention_backend(attention_backend)
        self.attention_backend = attention_backend

        if prompt_cache_size < 1:
            raise ValueError(f"prompt_cache_size must be >= 1, got {prompt_cache_size}")
        self.prompt_cache_size = int(prompt_cache_size)
        self._prompt_cache: OrderedDict[str, dict[str, Tensor]] = OrderedDict()
        if offload_text_encoders and not self.text_encoders():
            raise self._cannot("offload_text_encoders", True, "it has no text encoder")
        self.offload_text_encoders = bool(offload_text_encoders)
        if self.offload_text_encoders:
            self._text_encoders_to("cpu")
        #: prompt -> CPU encoding rows once :meth:`precompute_prompts` ran (the text encoders are then freed)
        self._precomputed: dict[str, dict[str, Tensor]] | None = None

        #: the compile mode: False, "whole" or "regional" (truthy when compiled)
        self.compile_transformer = {True: "whole"}.get(compile_transformer, compile_transformer)
        self._compile(self.transformer)

    def _enable_vae(self, key: str, method: str) -> None:
        """``vae.<method>()``; ConfigError where the VAE class lacks it (older diffusers, other VAEs) or
        diffusers' ``AutoencoderMixin`` says the class does not implement it."""
        import diffusers

        enable, vae = getattr(self.vae, method, None), type(self.vae).__name__
        if not callable(enable):
            raise self._cannot(key, True, f"its VAE ({vae}) has no {method}() in diffusers {diffusers.__version__}")
        try:
            enable()
        except NotImplementedError as exc:
            raise self._cannot(key, True, f"its VAE ({vae}) does not implement {method}() in diffusers "
                               f"{diffusers.__version__}: {exc}") from None

    def _cannot(self, key: str, value, why: str) -> ConfigError:
        return ConfigError(f"model.{key}={str(value).lower()} cannot apply to {self.model_name} "
                           f"({type(self.transformer).__name__}): {why}")

    def _set_attention_backend(self, backend: str, networks: list[nn.Module] | None = None) -> None:
        """``model.attention_backend`` on ``networks`` (default: the transformer): ConfigError (one line)
        for an unknown backend, one this machine cannot run (naming the usable ones), or a transformer
        whose attention does not go through diffusers' dispatcher."""
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"unknown model.attention_backend {backend!r}; valid: {', '.join(ATTENTION_BACKENDS)}")
        problem = backend_problem(backend)
        if problem:
            raise self._cannot("attention_backend", backend, f"{problem}; usable here: {', '.join(usable_backends())}")
        for network in networks or [self.transformer]:
            try:
                set_attention_backend(network, backend)
            except (ValueError, RuntimeError) as exc:
                why = " ".join(str(exc).split())
                raise self._cannot("attention_backend", backend, f"{why}; use model.attention_backend=sdpa") from None

    def _check_compile_mode(self, mode) -> None:
        if not any(mode == m and type(mode) is type(m) for m in COMPILE_MODES):
            raise ConfigError(f"unknown model.compile_transformer {mode!r}; valid: false, true, whole, regional")

    def _compile(self, network: nn.Module) -> None:
        """``torch.compile`` ``network`` in place as :attr:`compile_transformer` says (parameter names, peft
        adapters and state dicts are unchanged either way)."""
        backend = os.environ.get(COMPILE_BACKEND_ENV) or "inductor"
        if self.compile_transformer == "whole":
            network.compile(backend=backend)
        elif self.compile_transformer == "regional":
            if getattr(network, "_repeated_blocks", None) and callable(getattr(network, "compile_repeated_blocks", None)):
                network.compile_repeated_blocks(backend=backend)  # diffusers' own: each _repeated_blocks module
                return
            blocks = repeated_blocks(network)
            if not blocks:
                raise self._cannot("compile_transformer", "regional", f"{type(network).__name__} names no "
                                   "_repeated_blocks and has no block list (an nn.ModuleList child) to compile")
            for block in blocks:
                block.compile(backend=backend)

    # ------------------------------------------------------------------ devices
    @property
    def device(self) -> torch.device:
        """The transformer's device (where inputs and encodings go; offloaded text encoders stay on the CPU;
        while :mod:`.parking` holds the transformer in host memory, the device it returns to)."""
        parked = getattr(self, "_parked_device", None)
        return parked if parked is not None else next(self.transformer.parameters()).device

    def text_encoders(self) -> list[nn.Module]:
        """The text encoder submodules (``text_encoder``, ``text_encoder_2``, ...), in name order."""
        return [m for name, m in sorted(self.named_children()) if name.startswith("text_encoder")]

    def _text_encoders_to(self, device) -> None:
        for module in self.text_encoders():
            module.to(device)

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (behind ``.to``, ``.cuda``, ``.half``, ...); with offloaded text encoders a move
        off the CPU skips them, so ``policy.to("cuda")`` never puts them on the GPU (casts that stay on the
        CPU still reach them); freed text encoders (:meth:`precompute_prompts`) are skipped by every call."""
        freed = getattr(self, "_precomputed", None) is not None
        if not freed and (not getattr(self, "offload_text_encoders", False) or fn(torch.zeros(())).device.type == "cpu"):
            return super()._apply(fn, recurse)
        held = {name: m for name, m in self._modules.items() if name.startswith("text_encoder") and m is not None}
        self._modules.update(dict.fromkeys(held))
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules.update(held)

    # ------------------------------------------------------------------ prompts
    @abstractmethod
    def _encode_now(self, prompts: list[str]) -> dict[str, Tensor]:
        """Prompts -> batch-first encodings through the text encoders (on :attr:`device`)."""

    @torch.no_grad()
    def precompute_prompts(self, prompts: list[str], batch_size: int = 16) -> tuple[int, int]:
        """Encode ``prompts`` and the empty prompt once, in batches of ``batch_size``, keep the rows in CPU
        memory keyed by prompt text, and free the text encoders (moved to the meta device: no storage
        left, whoever else holds them); afterwards :meth:`_encode` reads only these rows and refuses a
        prompt outside them. Returns (bytes of the stored encodings, bytes of the freed encoder weights).
        ConfigError for an image-editing model (its encodings depend on the reference image too) or a
        model without text encoders; calling it a second time is refused (the encoders are gone)."""
        if self.takes_references:
            raise self._cannot("precompute_prompts", True, "an edit model's encodings depend on each reference "
                               "image, not on the prompt alone; use model.offload_text_encoders=true")
        if not self.text_encoders():
            raise self._cannot("precompute_prompts", True, "it has no text encoder")
        if self._precomputed is not None:
            raise RuntimeError("precompute_prompts() ran already: the text encoders are freed")
        store: dict[str, dict[str, Tensor]] = {}
        unique = list(dict.fromkeys(["", *prompts]))
        with networks_in_host_memory(self):  # the encode phase holds the encoders, not the transformer too
            for start in range(0, len(unique), batch_size):
                chunk = unique[start:start + batch_size]
                enc = self._encode(chunk)  # through the LRU path when offloaded: the encoders visit the device
                for i, p in enumerate(chunk):
                    store[p] = {k: v[i].to("cpu", copy=True) for k, v in enc.items()}  # own storage, not a view
        freed = sum(t.numel() * t.element_size() for m in self.text_encoders() for t in (*m.parameters(), *m.buffers()))
        for module in self.text_encoders():
            module.to("meta")
        self._prompt_cache.clear()
        self._precomputed = store
        return sum(t.numel() * t.element_size() for row in store.values() for t in row.values()), freed

    @torch.no_grad()
    def _encode(self, prompts: list[str]) -> dict[str, Tensor]:
        """:meth:`_encode_now`, or with ``offload_text_encoders`` rows of the per-prompt LRU cache (only
        prompts not in it reach the encoders, moved to :attr:`device` for that call and back after), or
        after :meth:`precompute_prompts` the stored rows (UserError naming a prompt outside them)."""
        prompts = list(prompts)
        if self._precomputed is not None:
            store = self._precomputed
            missing = [p for p in prompts if p not in store]
            if missing:
                raise UserError(f"prompt {missing[0]!r} was not encoded before training: model.precompute_prompts="
                                "true encodes the data.prompts file, the evaluator's prompts and the empty prompt "
                                "once and frees the text encoders; add the prompt to data.prompts or set "
                                "model.precompute_prompts=false")
            return {k: torch.stack([store[p][k] for p in prompts]).to(self.device) for k in store[prompts[0]]}
        if not self.offload_text_encoders:
            return self._encode_now(prompts)
        cache = self._prompt_cache
        missing = [p for p in dict.fromkeys(prompts) if p not in cache]
        if missing:
            self._text_encoders_to(self.device)
            try:
                enc = self._encode_now(missing)
            finally:
                self._text_encoders_to("cpu")
            for i, p in enumerate(missing):
                cache[p] = {k: v[i] for k, v in enc.items()}
        for p in prompts:
            cache.move_to_end(p)
        # on the transformer's device even if the policy moved since the rows were cached
        out = {k: torch.stack([cache[p][k] for p in prompts]).to(self.device) for k in cache[prompts[0]]}
        while len(cache) > self.prompt_cache_size:
            cache.popitem(last=False)
        return out
