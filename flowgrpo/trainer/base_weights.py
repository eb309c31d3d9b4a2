"""Which base weights a shapes run was trained from, so that its checkpoints are never loaded onto others.

A checkpoint holds the trained parameters only; the rest of the policy (the frozen text side, and any
parameter the newer model has and the run's does not) is rebuilt from the base weights that the run's
``model.path`` names. For the shapes world that is usually ``null``, the weights shipped inside the
package, and those change between releases (the two-stage base replaced the single-stage one on
27 Nov 2026). Loading an older run then silently gives a model that is half the run's and half the
new base's. So a fresh shapes run records a fingerprint of its base (``RUN_DIR/base_weights.json``),
and evaluating, probing, sampling or resuming the run refuses other base weights in one error that
says how to point the run at its own. Runs of diffusers models are not fingerprinted: their weights
are named by the user and are gigabytes to hash.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import UserError

BASE_FILE = "base_weights.json"


def shapes_base_fingerprint(model_path: str | None) -> dict:
    """{"path", "sha256"} of the shapes base weights that ``model.path`` resolves to (None: the shipped
    weights); the hash is over ``model.safetensors`` (14 MB, tens of milliseconds)."""
    from ..shapes.model import weights_folder

    folder = weights_folder(model_path)
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    return {"path": str(folder.resolve()), "sha256": digest}


def record_base_weights(run_dir: Path, model_cfg) -> None:
    """Write ``RUN_DIR/base_weights.json`` for a shapes run (nothing for other models)."""
    if model_cfg.name == "shapes":
        (Path(run_dir) / BASE_FILE).write_text(json.dumps(shapes_base_fingerprint(model_cfg.path), indent=2))


def check_base_weights(run_dir: Path, model_cfg) -> None:
    """Raise one UserError when a shapes run's recorded base differs from the weights its ``model.path``
    gives now. Runs without the record (older than it, or not shapes runs) are not checked."""
    recorded_file = Path(run_dir) / BASE_FILE
    if model_cfg.name != "shapes" or not recorded_file.is_file():
        return
    recorded = json.loads(recorded_file.read_text())
    now = shapes_base_fingerprint(model_cfg.path)
    if now["sha256"] == recorded.get("sha256"):
        return
    given = f"model.path={model_cfg.path}" if model_cfg.path else "model.path=null (the weights shipped with flowgrpo)"
    raise UserError(
        f"{run_dir} was trained from the shapes base weights in {recorded.get('path')} (sha256 "
        f"{str(recorded.get('sha256'))[:12]}), but {given} now gives other weights ({now['path']}, sha256 "
        f"{now['sha256'][:12]}). Its checkpoints hold only the trained parameters, so loading them onto "
        f"other base weights would mix two models. Set model.path in {Path(run_dir) / 'config.yaml'} to a "
        "folder with the original model.safetensors and config.json (the shipped weights of an earlier "
        "flowgrpo: git show COMMIT:flowgrpo/shapes/weights/model.safetensors).")
