"""The Python API: configure, assemble and run training from user code (docs/api.md).

Re-exported lazily by ``flowgrpo`` (``import flowgrpo`` stays light: torch loads on first use)::

    import flowgrpo

    cfg = flowgrpo.load_config(overrides=["train.iterations=2", "reward.weights={'my_pkg.rewards:sharp': 1.0}"])
    summary = flowgrpo.train(cfg, callbacks=[lambda trainer, metrics: print(metrics["reward_mean"])])

    trainer = flowgrpo.Trainer.from_config(cfg, rewards={"sharp": my_function})  # parts replace config choices
    flowgrpo.train(trainer=trainer)

* :func:`load_config` -- defaults <- preset <- config file <- overrides, validated (plug-ins named by
  import path are imported and checked here);
* :func:`train` -- a whole run (run directory, evaluation, checkpoints, ``summary.json``) from a
  config, a list or dict of overrides, or an assembled :class:`Trainer`;
* :class:`Trainer` -- assembled from parts or :meth:`Trainer.from_config`;
  :class:`Callback` -- iteration-end, evaluation and checkpoint events;
  :class:`CallableReward` -- any callable ``(images, prompts, **metadata) -> scores`` as a reward.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .config import RunConfig, load_config
from .errors import UserError
from .rewards.callable import CallableReward
from .callbacks import Callback
from .trainer.checkpoint import read_run_config
from .trainer.run import train as run_training
from .trainer.trainer import Trainer

ConfigSpec = RunConfig | Sequence[str] | Mapping[str, object] | None


def config_from(spec: ConfigSpec = None) -> RunConfig:
    """A validated :class:`RunConfig` from ``spec``: None (the default run), a RunConfig (as is), a list
    of overrides ``["train.iterations=2", ...]`` or a dict ``{"train.iterations": 2, ...}`` of them, both
    applied to the default preset."""
    if spec is None:
        return load_config()
    if isinstance(spec, RunConfig):
        return spec
    if isinstance(spec, Mapping):
        return load_config(overrides=[f"{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in spec.items()])
    if isinstance(spec, (list, tuple)) and all(isinstance(o, str) for o in spec):
        return load_config(overrides=list(spec))
    raise UserError(f"a config is a RunConfig, a list of 'key.sub=value' overrides or a dict of them, got "
                    f"{type(spec).__name__}")


def train(config: ConfigSpec = None, *, trainer: Trainer | None = None,
          callbacks: Iterable[Callback | Callable] = (), run_dir: str | Path | None = None,
          resume: str | Path | None = None) -> dict:
    """Run training as ``flowgrpo train`` does and return the summary (RUN_DIR/summary.json's dict).

    Args:
        config: what :func:`config_from` takes (not with ``trainer``).
        trainer: a :class:`Trainer` assembled from parts (default: ``Trainer.from_config(config)``).
        callbacks: :class:`Callback` s or functions ``(trainer, metrics)`` called after each iteration.
        run_dir: the run directory (default: ``log.out_dir/log.run_name``, or preset + time stamp).
        resume: a run directory to continue (its ``config.yaml`` is the config unless one is given).
    """
    for name, value in (("resume", resume), ("run_dir", run_dir)):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise TypeError(f"train({name}=...) is a folder path, got {type(value).__name__}")
    if trainer is not None and config is not None:
        raise UserError("train() takes a config or a trainer, not both (the trainer holds its config)")
    if trainer is None:
        cfg = read_run_config(Path(resume)) if resume is not None and config is None else config_from(config)
        trainer = Trainer.from_config(cfg)
    trainer.callbacks.extend(callbacks)
    folder = Path(resume) if resume is not None else (Path(run_dir) if run_dir is not None else None)
    return run_training(trainer.cfg, folder, resume=resume is not None, trainer=trainer)


__all__ = ["CallableReward", "Callback", "RunConfig", "Trainer", "config_from", "load_config", "train"]
