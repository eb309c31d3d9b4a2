"""Training objectives (``loss.objective``): the update stage's loss, one module each.

* ``grpo`` -- clipped likelihood ratios on SDE transitions (:mod:`.grpo`, every GRPO variant);
* ``nft`` -- DiffusionNFT, negative-aware fine-tuning on the forward process (:mod:`.nft`);
* ``awm`` -- Advantage Weighted Matching, a PPO clip on the flow-matching loss (:mod:`.awm`);
* ``dgpo`` -- Direct Group Preference Optimization, a group-level DPO (:mod:`.dgpo`);
* ``crd`` -- Centered Reward Distillation, implicit rewards matched to group-centred rewards (:mod:`.crd`);
* ``flow_dppo`` -- Flow-DPPO, GRPO's rows with an exact-KL trust region instead of the clip (:mod:`.flow_dppo`);
* ``diffusion_dpo`` -- Diffusion-DPO on preference pairs, online from the rollout or from a file (:mod:`.diffusion_dpo`);
* ``flow_opd`` -- Flow-OPD, on-policy distillation of routed teachers with a manifold anchor (:mod:`.flow_opd`).

:mod:`.base` defines the protocol every objective implements; :mod:`flowgrpo.trainer.update_loop`
runs it. A config may name an objective of user code by import path,
``loss.objective=my_pkg.obj:MyObjective`` (:func:`objective_plugin`).

A shipped objective is its module plus one :func:`register_objective` line below, which names its
factory, its options dataclass (held in ``LossConfig`` as ``loss.<name>``, see
:func:`with_objective_options`), its progress-bar label and the summary in ``loss.objective``'s help.
The loss terms objectives share (KL, anchors, SFT, per-step weights, clip schedule, NormGuard) are in :mod:`.terms`.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field, make_dataclass

from ..errors import ConfigError, UserError
from ..registry import PluginError, Registry, describe, import_object, signature_problem
from .base import Collected, Credit, MicroLoss, Objective, UpdateContext

CONTRACT = ("an objective is an Objective subclass (flowgrpo.objectives.Objective) built as cls(cfg, device), "
            "cls(cfg) or cls(), or a function (cfg, device) -> Objective")


def objective_plugin(path: str, obj):
    """The ``OBJECTIVES`` hook for ``loss.objective=package.module:attr``: an :class:`Objective`
    subclass implementing :meth:`~Objective.rows` and :meth:`~Objective.micro_loss`, constructed as
    ``cls(cfg, device)`` (or ``cls(cfg)``, or ``cls()`` where it takes no arguments), or a factory function
    ``(cfg, device) -> Objective`` whose result is checked when it is built."""
    if inspect.isclass(obj):
        if not issubclass(obj, Objective):
            raise PluginError(f"{describe(obj)} is not a subclass of flowgrpo.objectives.Objective; {CONTRACT}")
        if inspect.isabstract(obj):
            missing = ", ".join(sorted(obj.__abstractmethods__))
            raise PluginError(f"{describe(obj)} does not implement {missing}; {CONTRACT}")
        if signature_problem(obj, None, None) is None:
            return obj
        if signature_problem(obj, None) is None:
            return lambda cfg, device=None: obj(cfg)
        bad = signature_problem(obj)
        if bad:
            raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")
        return lambda cfg, device=None: obj()
    bad = signature_problem(obj, None, None) if callable(obj) else "is not callable"
    if bad:
        raise PluginError(f"{describe(obj)} {bad}; {CONTRACT}")

    def build(cfg, device=None) -> Objective:
        made = obj(cfg, device)
        if not isinstance(made, Objective):
            raise UserError(f"objective {path!r} returned {describe(made)}, not a flowgrpo.objectives.Objective")
        return made

    return build


#: name -> factory ``(run_cfg, device) -> Objective``; ``loss.objective`` may also be an import path
OBJECTIVES: Registry = Registry("objective", plugin=objective_plugin)
@dataclass(frozen=True)
class ObjectiveSpec:
    """A shipped objective, as its one registration (:func:`register_objective`) gives it.

    Attributes:
        factory: ``"package.module:attr"`` of the factory ``(run_cfg, device) -> Objective``.
        options: ``"package.module:Class"`` of its options dataclass, held in ``LossConfig`` as
            ``loss.<name>`` (help on every field, shown by ``flowgrpo config explain loss``), or ""
            for none.
        label: the progress bar's name of the objective.
        summary: one line, in ``loss.objective``'s help.
        reads: the keys of :data:`OBJECTIVE_DEPENDENT_KEYS` the objective reads (the others are
            refused when a config file or an override sets them, :func:`check_objective_keys`).
    """

    factory: str
    options: str
    label: str
    summary: str
    reads: tuple[str, ...] = ()


#: keys outside ``loss.<name>`` that only some objectives read: the credit stage's subset of trained
#: steps (the transition objectives train it; the forward-process objectives draw their own times).
#: An objective's own options are ``loss.<name>.*``, set under any objective as the others' are.
OBJECTIVE_DEPENDENT_KEYS = ("train.timestep_fraction", "train.timestep_order")


#: name -> :class:`ObjectiveSpec` of every shipped objective, in registration order
OBJECTIVE_SPECS: dict[str, ObjectiveSpec] = {}


def register_objective(name: str, factory: str, options: str = "", label: str = "", summary: str = "",
                       reads: tuple[str, ...] = ()) -> None:
    """The one registration of a shipped objective: its factory (imported on first use), its options
    dataclass (``loss.<name>.*``, added to ``LossConfig`` by :func:`with_objective_options`), its label
    a one-line summary and the shared keys it reads (``reads``). User code adds an objective without touching flowgrpo by naming it
    ``loss.objective=package.module:attr`` (its options are then its own business)."""
    OBJECTIVES.register_lazy(name, factory)
    unknown = set(reads) - set(OBJECTIVE_DEPENDENT_KEYS)
    if unknown:
        raise ValueError(f"objective {name!r} reads {sorted(unknown)}, which are not objective-dependent keys")
    OBJECTIVE_SPECS[name] = ObjectiveSpec(factory, options, label or name.upper(), summary, tuple(reads))


register_objective("grpo", "flowgrpo.objectives.grpo:build_grpo", "flowgrpo.objectives.options:GRPOOptions", "GRPO",
                   "clipped log-prob ratios on SDE transitions", reads=OBJECTIVE_DEPENDENT_KEYS)
register_objective("nft", "flowgrpo.objectives.nft:build_nft", "flowgrpo.objectives.options:NFTOptions",
                   "DiffusionNFT", "DiffusionNFT, negative-aware fine-tuning on the forward process")
register_objective("awm", "flowgrpo.objectives.awm:build_awm", "flowgrpo.objectives.options:AWMOptions",
                   "AWM", "Advantage Weighted Matching")
register_objective("dgpo", "flowgrpo.objectives.dgpo:build_dgpo", "flowgrpo.objectives.options:DGPOOptions",
                   "DGPO", "Direct Group Preference Optimization")
register_objective("crd", "flowgrpo.objectives.crd:build_crd", "flowgrpo.objectives.crd:CRDOptions", "CRD",
                   "Centered Reward Distillation: implicit rewards matched to group-centred rewards")
register_objective("flow_dppo", "flowgrpo.objectives.flow_dppo:build_flow_dppo",
                   "flowgrpo.objectives.flow_dppo:FlowDPPOOptions", "Flow-DPPO",
                   "Flow-DPPO: grpo's rows, an exact-KL trust region instead of the clip",
                   reads=OBJECTIVE_DEPENDENT_KEYS)
register_objective("diffusion_dpo", "flowgrpo.objectives.diffusion_dpo:build_diffusion_dpo",
                   "flowgrpo.objectives.diffusion_dpo:DiffusionDPOOptions", "Diffusion-DPO",
                   "Diffusion-DPO on preference pairs, online or from a file")
register_objective("flow_opd", "flowgrpo.objectives.flow_opd:build_flow_opd",
                   "flowgrpo.objectives.flow_opd:FlowOPDOptions", "Flow-OPD",
                   "Flow-OPD: on-policy distillation of routed single-task teachers, with a manifold anchor",
                   reads=OBJECTIVE_DEPENDENT_KEYS)


def _default(cfg, key: str):
    section, name = key.split(".")
    return {f.name: f.default for f in dataclasses.fields(getattr(cfg, section))}[name]


def check_objective_keys(cfg, sources: dict[str, str]) -> None:
    """Refuse, in one line, a key of :data:`OBJECTIVE_DEPENDENT_KEYS` that a config file or an override
    (``sources``: key -> layer, as :class:`~flowgrpo.config.layers.Composed` records them) sets away
    from its default while the shipped objective ``cfg.loss.objective`` does not read it: it would be
    ignored silently. A preset's or recipe's keys are left alone (``--preset shapes
    loss.objective=nft`` keeps working; the presets' own consistency is a test). Plug-in objectives
    (``package.module:attr``) are not checked: what they read is their own."""
    spec = OBJECTIVE_SPECS.get(cfg.loss.objective)
    if spec is None:
        return
    for key in OBJECTIVE_DEPENDENT_KEYS:
        if key in spec.reads or not sources.get(key, "default").startswith(("file:", "override")):
            continue
        section, name = key.split(".")
        value, default = getattr(getattr(cfg, section), name), _default(cfg, key)
        if value != default:
            readers = ", ".join(n for n, s in OBJECTIVE_SPECS.items() if key in s.reads)
            raise ConfigError(f"config key '{key}' = {value!r} has no effect with loss.objective={cfg.loss.objective} "
                              f"(read by: {readers}); leave it at its default {default!r}")


def objective_label(name: str) -> str:
    """The progress bar's name of ``loss.objective`` = ``name`` (a plug-in's: its name upper-cased)."""
    spec = OBJECTIVE_SPECS.get(name)
    return spec.label if spec else (name.upper() or "train")


def objective_help() -> str:
    """``loss.objective``'s help: every shipped objective with its summary and options key."""
    parts = [f"{name} ({spec.summary}{f'; loss.{name}.*' if spec.options else ''})" for name, spec in OBJECTIVE_SPECS.items()]
    return "training objective (flowgrpo.objectives): " + " | ".join(parts) + " | or package.module:attr"


def with_objective_options(cls: type) -> type:
    """``cls`` (the ``LossConfig`` dataclass) with one field ``<name>: Options`` per shipped objective
    that has options, in registration order: how an objective's options join the config without a
    line in ``flowgrpo/config/schema.py``."""
    extra = []
    for name, spec in OBJECTIVE_SPECS.items():
        if spec.options:
            opts = import_object(spec.options)
            extra.append((name, opts, field(default_factory=opts,
                                            metadata={"help": f"{spec.label} options (loss.objective={name})"})))
    out = make_dataclass(cls.__name__, extra, bases=(cls,))
    out.__module__, out.__qualname__, out.__doc__ = cls.__module__, cls.__qualname__, cls.__doc__
    return out


def build_objective(cfg, device=None) -> Objective:
    """The objective ``cfg.loss.objective`` of a :class:`~flowgrpo.config.RunConfig`."""
    return OBJECTIVES.build(cfg.loss.objective, cfg, device)


__all__ = ["OBJECTIVES", "OBJECTIVE_SPECS", "Collected", "Credit", "MicroLoss", "Objective", "ObjectiveSpec",
           "UpdateContext", "build_objective", "check_objective_keys", "objective_help", "objective_label", "register_objective",
           "with_objective_options"]
