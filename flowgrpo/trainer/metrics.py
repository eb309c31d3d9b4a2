"""Metrics sinks: an append-only JSONL file (always) and accelerate's trackers, both resumable.

Every line is strict JSON: a NaN or infinite number (a reward mean over only dropped samples, a
diverged loss) is written as ``null`` (:func:`json_safe`), never as the bare ``NaN`` that JSON lacks."""

from __future__ import annotations

import json
import math
import numbers
from pathlib import Path
from ..text_inputs import loads_json


class MetricsLogger:
    """Writes one JSON object per iteration to ``metrics.jsonl`` and its numbers to the trackers.

    On resume from iteration k, lines after k are dropped (they belong to the lost tail of the
    interrupted run); the trackers were opened to purge their own tails
    (:func:`flowgrpo.trainer.accelerator.start_trackers`).

    Args:
        run_dir: the run directory.
        accelerator: the run's Accelerator whose trackers receive scalars and images (None: JSONL only).
        resume_iteration: the last iteration kept on resume (None: a fresh run).
    """

    def __init__(self, run_dir: Path, accelerator=None, resume_iteration: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_iteration is not None and self.path.exists():
            kept = [r for r in read_metrics(run_dir) if r.get("iteration", -1) <= resume_iteration]
            self.path.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
        self._fh = self.path.open("a")
        self.accelerator = accelerator if accelerator is not None and accelerator.trackers else None

    def log(self, record: dict) -> None:
        self._fh.write(json.dumps(json_safe(record), allow_nan=False) + "\n")
        self._fh.flush()
        if self.accelerator is not None:
            scalars = {k: v for k, v in record.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration"
                       and math.isfinite(v)}
            grouped = {k.replace(".", "/"): v for k, v in scalars.items()}
            for tracker in self.accelerator.trackers:
                # "/" groups panels in TensorBoard and W&B; MLflow's file store would turn
                # "reward/shapes" into a file and "reward/shapes/correct" into a folder under it
                tracker.log(scalars if tracker.name == "mlflow" else grouped, step=record["iteration"])

    def log_image(self, name: str, path: Path, step: int) -> None:
        """Send a written PNG (a sample grid) to the trackers that take images."""
        if self.accelerator is None:
            return
        import numpy as np
        from PIL import Image

        img = np.asarray(Image.open(path).convert("RGB"))  # [H, W, 3] uint8
        for tracker in self.accelerator.trackers:
            if tracker.name == "tensorboard":
                tracker.log_images({name: img[None]}, step=step, dataformats="NHWC")
            elif tracker.name == "wandb":
                tracker.log_images({name: [img]}, step=step)
            # other trackers keep the scalars; the PNG stays in RUN_DIR/grids/

    def close(self) -> None:
        """Close the file and end the trackers; a second call does nothing."""
        if self._fh.closed:
            return
        self._fh.close()
        if self.accelerator is not None:
            # each tracker's finish() only: accelerate's end_training() also destroys the process group, and
            # this runs on the main rank alone, so the other ranks met a dead group at their closing barrier
            # (every multi-process run with a tracker, the default tensorboard included, ended that way)
            for tracker in self.accelerator.trackers:
                tracker.finish()


def json_safe(value):
    """``value`` with every non-finite float (NaN, +-inf) replaced by None, recursively through dicts,
    lists and tuples; numbers of other types (numpy or 0-d torch scalars) become ints or floats. Plain ints,
    bools, strings and None pass unchanged: the result always serialises as strict JSON."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    number = float(value)
    return number if math.isfinite(number) else None


def read_metrics(run_dir: Path) -> list[dict]:
    """The lines of ``RUN_DIR/metrics.jsonl`` (none when it is missing). A torn last line (a run writing
    it now, or killed mid-line) is left out; any other line that is not JSON is a UserError naming it."""
    from ..errors import UserError

    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [ln for ln in path.read_text().splitlines() if ln.strip()]
    out = []
    for i, ln in enumerate(rows):
        try:
            out.append(loads_json(ln))
        except json.JSONDecodeError:
            if i < len(rows) - 1:
                raise UserError(f"{path}: line {i + 1} is not JSON") from None
    return out
