"""Which base weights a run was trained from, so that its checkpoints are never loaded onto others.

A checkpoint holds the trained parameters only; the rest of the policy (the frozen text side, and any
parameter the newer model has and the run's does not) is rebuilt from the base weights that the run's
``model.path`` names. Where that may be ``null``, weights shipped inside the package that change
between releases (the embedded world's: the two-stage base replaced the single-stage one on
27 Nov 2026), loading an older run would silently give a model that is half the run's and half the
new base's. So a fresh run of a model listed in :data:`flowgrpo.policies.BASE_FINGERPRINTS` records a
fingerprint of its base (``RUN_DIR/base_weights.json``), and evaluating, probing, sampling or resuming
the run refuses other base weights in one error that says how to point the run at its own. Runs of
diffusers models are not fingerprinted: their weights are named by the user and are gigabytes to hash.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError
from ..policies import BASE_FINGERPRINTS
from ..text_inputs import loads_json

BASE_FILE = "base_weights.json"


def base_fingerprint(model_cfg) -> dict | None:
    """{"path", "sha256"} of the base weights ``model_cfg`` names, for a model that records them; else None."""
    if model_cfg.name not in BASE_FINGERPRINTS:
        return None
    return BASE_FINGERPRINTS.get(model_cfg.name)(model_cfg.path)


def record_base_weights(run_dir: Path, model_cfg) -> None:
    """Write ``RUN_DIR/base_weights.json`` (nothing for a model without a fingerprint)."""
    fingerprint = base_fingerprint(model_cfg)
    if fingerprint is not None:
        (Path(run_dir) / BASE_FILE).write_text(json.dumps(fingerprint, indent=2))


def check_base_weights(run_dir: Path, model_cfg) -> None:
    """Raise one UserError when a run's recorded base differs from the weights its ``model.path`` gives
    now. Runs without the record (older than it, or of models without a fingerprint) are not checked."""
    recorded_file = Path(run_dir) / BASE_FILE
    if not recorded_file.is_file():
        return
    now = base_fingerprint(model_cfg)
    recorded = loads_json(recorded_file.read_text())
    if now is None or now["sha256"] == recorded.get("sha256"):
        return
    given = f"model.path={model_cfg.path}" if model_cfg.path else "model.path=null (the weights shipped with flowgrpo)"
    raise UserError(
        f"{run_dir} was trained from the {model_cfg.name} base weights in {recorded.get('path')} (sha256 "
        f"{str(recorded.get('sha256'))[:12]}), but {given} now gives other weights ({now['path']}, sha256 "
        f"{now['sha256'][:12]}). Its checkpoints hold only the trained parameters, so loading them onto "
        f"other base weights would mix two models. Set model.path in {Path(run_dir) / 'config.yaml'} to a "
        "folder with the original weights (an earlier release's shipped weights are in its git history, "
        "e.g. git show COMMIT:flowgrpo/shapes/weights/model.safetensors).")
