"""A model's configuration checked against its weight files before anything is allocated.

A shapes weights folder or a diffusers pipeline folder whose ``config.json`` says ``num_layers:
1000000`` grew past 1.5 GiB of RSS (and on, to the machine's limit) while the loader built the
model, before any weight was read. Every loader calls :func:`check_model_folder` (a shapes model's
folder, :meth:`flowgrpo.shapes.model.ShapesFlowModel.load`) or :func:`check_pipeline_folder` (every
model component of a pipeline folder, :func:`flowgrpo.policies.diffusers.common.load_pipeline`)
first. Each builds the model that the configuration describes with its parameters on the meta
device, counting them as they are registered, and stops as soon as the count passes
:data:`PARAMS_PER_STORED_VALUE` times the values the folder's weight files hold (read from the
safetensors headers; other weight files count by their bytes): one UserError naming the folder, the
configuration's largest setting and both numbers, while nothing of size has been allocated.
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import UserError
from .text_inputs import loads_json

#: how many parameters a model may have per value its weight files store before its configuration is
#: refused: 4-bit files store two values a byte and a class may initialise a few weights it does not
#: load; an absurd configuration overshoots by orders of magnitude (1,000,000 layers for 24: 40,000x)
PARAMS_PER_STORED_VALUE = 4
#: parameters allowed beyond that, so that tiny models with a few initialised weights pass
PARAMS_SLACK = 2**20
#: weight files other than safetensors, counted as two values a byte (their headers are not read)
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".gguf")


class _TooLarge(Exception):
    """Raised inside a counted build once its parameters pass the limit (stops the build)."""


def stored_values(folder: Path) -> int:
    """The values the weight files directly in ``folder`` hold: each safetensors header's tensor sizes,
    plus two per byte of any other weight file; 0 when it has none."""
    total = 0
    for file in sorted(Path(folder).iterdir()):
        if file.suffix == ".safetensors":
            total += _safetensors_values(file)
        elif file.suffix in _OTHER_WEIGHTS and file.is_file():
            total += 2 * file.stat().st_size
    return total


def _safetensors_values(file: Path) -> int:
    """The number of values in a safetensors file, from its header alone (0 for an unreadable one: the
    loader names it)."""
    try:
        with open(file, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            if not 0 < size <= min(file.stat().st_size, 100 * 2**20):
                return 0
            header = loads_json(fh.read(size))
    except (OSError, ValueError):
        return 0
    return sum(math.prod(v.get("shape", [])) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))


@contextlib.contextmanager
def _counted_build(limit: int, meta_device: bool) -> Iterator[list[int]]:
    """Count (into the yielded one-item list) the parameters registered by modules built in the block,
    moving each to the meta device as it is registered, and raise :class:`_TooLarge` once they pass
    ``limit``. ``meta_device``: build under ``torch.device("meta")`` too, so that nothing is allocated
    (some models compute on their tensors while they are built, which the meta device cannot)."""
    import torch
    from torch import nn

    count, seen, register = [0], {}, nn.Module.register_parameter

    def counted(module, name, param):
        register(module, name, param)
        if param is None or id(param) in seen:  # a shared weight counts once
            return
        meta = param if param.is_meta else type(param)(param.to("meta"), requires_grad=param.requires_grad)
        module._parameters[name] = meta
        seen[id(meta)] = meta  # held, so that no later parameter takes its id
        count[0] += meta.numel()
        if count[0] > limit:
            raise _TooLarge

    nn.Module.register_parameter = counted
    try:
        with torch.device("meta") if meta_device else contextlib.nullcontext():
            yield count
    finally:
        nn.Module.register_parameter = register


def count_parameters(build: Callable[[], object], limit: int) -> int | None:
    """The parameters of the model ``build()`` makes, counted on the meta device; ``limit + 1`` as soon
    as they pass ``limit`` (the build is stopped there); None when the model cannot be built so (the
    loader will then say why it cannot be loaded)."""
    for meta_device in (True, False):
        try:
            with _counted_build(limit, meta_device) as count:
                build()
            return count[0]
        except _TooLarge:
            return limit + 1
        except Exception:  # noqa: BLE001 - not buildable on the meta device: try without it, then leave it
            continue
    return None


def check_model_folder(folder: Path, config_file: Path, settings: dict, build: Callable[[], object]) -> None:
    """A UserError when the model ``build()`` makes from ``config_file`` (its ``settings``) has more
    parameters than :data:`PARAMS_PER_STORED_VALUE` per value the weight files in ``folder`` hold
    (plus :data:`PARAMS_SLACK`); found before anything of size is allocated. A folder without weight
    files is left to the loader."""
    held = stored_values(folder)
    if held == 0:
        return
    limit = PARAMS_PER_STORED_VALUE * held + PARAMS_SLACK
    built = count_parameters(build, limit)
    if built is not None and built > limit:
        ints = {k: v for k, v in settings.items() if isinstance(v, int) and not isinstance(v, bool)}
        largest = max(ints, key=ints.get) if ints else None
        setting = f" (its largest setting: {largest}={ints[largest]})" if largest else ""
        raise UserError(f"{config_file} describes a model of more than {limit:,} parameters{setting}, but the weight "
                        f"files in {folder} hold {held:,} values: is a size in the config wrong? Nothing was built")


def check_pipeline_folder(path: str | Path) -> None:
    """:func:`check_model_folder` for every model component of the diffusers pipeline folder ``path``
    (those its ``model_index.json`` names from diffusers or transformers with a ``config.json``);
    anything else (a hub id, a folder without an index) is left to the loader."""
    folder = Path(path)
    index = folder / "model_index.json"
    if not index.is_file():
        return
    try:
        components = loads_json(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    for name, spec in components.items():
        config_file = folder / name / "config.json"
        if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in ("diffusers", "transformers")
                and config_file.is_file()):
            continue
        cls = getattr(importlib.import_module(spec[0]), str(spec[1]), None)
        settings = _json_mapping(config_file)
        if cls is None or settings is None or not hasattr(cls, "config_class" if spec[0] == "transformers" else "from_config"):
            continue
        check_model_folder(folder / name, config_file, settings, _builder(spec[0], cls, folder / name, settings))


def _builder(library: str, cls, folder: Path, settings: dict) -> Callable[[], object]:
    """How to build ``cls`` from its configuration alone (no weights): diffusers' ``from_config``, or
    transformers' config class and constructor."""
    if library == "diffusers":
        return lambda: cls.from_config(settings)
    return lambda: cls(cls.config_class.from_pretrained(str(folder), local_files_only=True))


def _json_mapping(file: Path) -> dict | None:
    """The JSON object in ``file``, or None when it is not one (the loader names the problem)."""
    try:
        data = loads_json(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
