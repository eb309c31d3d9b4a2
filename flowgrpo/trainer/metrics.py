"""Metrics sinks: an append-only JSONL file and TensorBoard, both resumable."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    """Writes one JSON object per iteration to ``metrics.jsonl`` and scalars to TensorBoard.

    On resume from iteration k, lines after k are dropped (they belong to the lost tail of the
    interrupted run) and TensorBoard purges its events past k.
    """

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume_iteration: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        if resume_iteration is not None and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines()
                    if ln.strip() and json.loads(ln).get("iteration", -1) <= resume_iteration]
            self.path.write_text("".join(ln + "\n" for ln in kept))
        self._fh = self.path.open("a")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_iteration + 1 if resume_iteration is not None else None
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"), purge_step=purge)

    def log(self, record: dict) -> None:
        self._fh.write(json.dumps(record, default=float) + "\n")
        self._fh.flush()
        if self.tb is not None:
            step = record["iteration"]
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "iteration" and math.isfinite(v):
                    self.tb.add_scalar(k.replace(".", "/"), v, step)
            self.tb.flush()

    def close(self) -> None:
        self._fh.close()
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
