"""Policy adapters: one interface (:class:`Policy`) over every supported flow model.

Factories take a :class:`~flowgrpo.config.ModelConfig` and return a :class:`Policy`; heavy model
code is imported only when its name is asked for. ``model.name`` is an adapter name, or a local
diffusers pipeline directory (or a hub id already in the local cache), whose ``model_index.json``
names the pipeline class and so the adapter (:data:`PIPELINE_ADAPTERS`; a Wan 2.2 ``WanPipeline``
goes to the generic one); any other pipeline class goes to the generic adapter (``pipeline``,
:mod:`flowgrpo.policies.diffusers.generic`), which trains it when its scheduler is flow-matching
(or a multistep solver on flow sigmas, as Wan's UniPC) or says in one line what it lacks.

Subpackages: :mod:`.base` (the interface and what every adapter inherits), :mod:`.diffusers` (the
adapters over diffusers pipelines), :mod:`.tiny` (tiny random pipelines for tests and benchmarks).
The shapes model's adapter lives with its world, in :mod:`flowgrpo.shapes.policy`.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..registry import Registry
from .base import Conditioning, Policy
from ..text_inputs import loads_json

POLICIES: Registry[Policy] = Registry("model")
for _name, _target in (("shapes", "flowgrpo.shapes.policy:build_shapes_policy"),
                       ("sd3", "flowgrpo.policies.diffusers.sd3:build_sd3_policy"),
                       ("sd3-tiny", "flowgrpo.policies.tiny.sd3:build_tiny_sd3_policy"),
                       ("flux", "flowgrpo.policies.diffusers.flux:build_flux_policy"),
                       ("wan", "flowgrpo.policies.diffusers.wan:build_wan_policy"),
                       ("pipeline", "flowgrpo.policies.diffusers.generic.loading:build_pipeline_policy")):
    POLICIES.register_lazy(_name, _target)

#: models whose base weights a run fingerprints (``model.name`` -> ``fn(model_path) -> {"path", "sha256"}``):
#: those whose default weights can change under a run between releases (:mod:`flowgrpo.trainer.base_weights`)
BASE_FINGERPRINTS: Registry = Registry("base-weights fingerprint")
BASE_FINGERPRINTS.register_lazy("shapes", "flowgrpo.shapes.model:base_fingerprint")

#: diffusers pipeline class (``_class_name`` of ``model_index.json``) -> adapter name
PIPELINE_ADAPTERS = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "WanPipeline": "wan",
}


def _pipeline_dir(name: str) -> Path | None:
    """A local pipeline directory for ``name``: the path itself, or a hub id's snapshot in the local
    Hugging Face cache (never downloaded)."""
    path = Path(name).expanduser()
    if (path / "model_index.json").is_file():
        return path
    if "/" in name and not path.exists():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(name, local_files_only=True, allow_patterns=["model_index.json"]))
        except Exception:  # not in the cache (or not a hub id): the caller reports it
            return None
        return local if (local / "model_index.json").is_file() else None
    return None


def _model_index(index: Path) -> dict:
    """The content of a model_index.json; a one-line UserError naming the file when it cannot be read
    or is not a JSON object (a broken folder, not a bug of flowgrpo)."""
    try:
        content = loads_json(index.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: invalid JSON or invalid UTF-8
        raise UserError(f"{index}: not a readable JSON object ({type(exc).__name__}: {exc})") from None
    if not isinstance(content, dict):
        kind = {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(content), "number")
        raise UserError(f"{index}: expected a JSON object with the pipeline's _class_name, got a JSON {kind}")
    return content


def _flow_solver_config(directory: Path) -> bool:
    """Whether ``directory``'s scheduler config is a multistep solver on flow sigmas predicting flow
    (Wan's UniPC: ``use_flow_sigmas`` with ``prediction_type="flow_prediction"``), which the generic
    adapter replaces by flow-matching Euler at its ``flow_shift``."""
    try:
        config = loads_json((directory / "scheduler" / "scheduler_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and bool(config.get("use_flow_sigmas")) \
        and config.get("prediction_type") == "flow_prediction"


def _generic_blocker(content: dict, directory: Path) -> str | None:
    """Why the generic adapter cannot train the pipeline of a model_index.json (None: it may): it needs a
    ``transformer`` and a flow-matching scheduler (or a flow-sigma solver it swaps for one)."""
    if "transformer" not in content:
        return "model_index.json names no transformer component"
    scheduler = content.get("scheduler")
    name = scheduler[-1] if isinstance(scheduler, list) and scheduler else scheduler
    if not (isinstance(name, str) and ("FlowMatch" in name or _flow_solver_config(directory))):
        return f"its scheduler {name!r} is not a flow-matching one"
    return None


def _missing_components(content: dict, directory: Path) -> list[str]:
    """The components a model_index.json names (``"name": [library, class]`` with a class) whose folder
    ``directory/name/`` is absent or empty: diffusers loads each from there, so the pipeline cannot load."""
    return [name for name, value in content.items()
            if not name.startswith("_") and isinstance(value, list) and len(value) == 2 and value[1] is not None
            and not ((directory / name).is_dir() and any((directory / name).iterdir()))]


def _check_complete(content: dict, directory: Path) -> None:
    """A one-line UserError naming the components of ``content`` (a model_index.json) missing from
    ``directory``: checked before anything loads, as diffusers would load the others first and then
    blame a config.json."""
    missing = _missing_components(content, directory)
    if missing:
        raise UserError(f"pipeline folder {directory} is incomplete: model_index.json names the component(s) "
                        f"{', '.join(missing)}, but {', '.join(m + '/' for m in missing)} "
                        f"{'is' if len(missing) == 1 else 'are'} missing or empty there")


def _generic_layout(cls: str, content: dict) -> bool:
    """Whether a pipeline of a class with a dedicated adapter is in a layout only the generic adapter
    trains: a ``WanPipeline`` with a second expert (Wan 2.2 A14B) or per-token timesteps (Wan 2.2
    TI2V-5B); the ``wan`` adapter trains Wan 2.1."""
    if cls != "WanPipeline":
        return False
    second = content.get("transformer_2")
    has_second = isinstance(second, list) and len(second) == 2 and second[1] is not None
    return has_second or bool(content.get("expand_timesteps"))


def resolve_adapter(model_cfg) -> tuple[str, str | None]:
    """(adapter name, pipeline directory or None) for ``model_cfg.name``: which adapter builds the
    policy, and from which folder.

    An adapter name selects that adapter (with ``model.path``); a pipeline directory or cached hub id
    selects the adapter for its pipeline class (the generic ``pipeline`` adapter for a class without
    a dedicated one). Anything else raises a UserError naming the valid adapters.
    """
    name = model_cfg.name
    if name in POLICIES:
        path = Path(model_cfg.path).expanduser() if model_cfg.path else None
        if path is not None and (path / "model_index.json").is_file():
            _check_complete(_model_index(path / "model_index.json"), path)
        return name, model_cfg.path
    directory = _pipeline_dir(name)
    if directory is None:
        raise UserError(f"model.name {name!r} is neither an adapter ({', '.join(POLICIES.names())}) nor a "
                        "diffusers pipeline directory (or a hub id in the local cache) with a model_index.json")
    content = _model_index(directory / "model_index.json")
    cls = content.get("_class_name")
    if not isinstance(cls, str):
        why = "model_index.json names no _class_name string"
    else:
        dedicated = cls in PIPELINE_ADAPTERS and not _generic_layout(cls, content)
        why = None if dedicated else _generic_blocker(content, directory)
    if why is not None:
        raise UserError(f"{directory}: pipeline class {cls!r} is not supported: {why} (dedicated adapters: "
                        f"{', '.join(sorted(PIPELINE_ADAPTERS))}; other flow-matching transformer pipelines go "
                        "through the generic adapter)")
    _check_complete(content, directory)
    return (PIPELINE_ADAPTERS[cls] if dedicated else "pipeline"), str(directory)


def build_policy(model_cfg) -> Policy:
    """Instantiate the policy for ``model_cfg.name`` (an adapter name or a pipeline directory)."""
    import dataclasses

    adapter, directory = resolve_adapter(model_cfg)
    if directory is not None and directory != model_cfg.path:
        model_cfg = dataclasses.replace(model_cfg, path=directory)
    return POLICIES.build(adapter, model_cfg)


__all__ = ["Conditioning", "PIPELINE_ADAPTERS", "POLICIES", "Policy", "build_policy", "resolve_adapter"]
