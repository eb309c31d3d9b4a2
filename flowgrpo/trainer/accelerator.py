"""The run's :class:`accelerate.Accelerator` (processes, collective timeout, experiment trackers),
and the weight engine its launch asked for (:mod:`flowgrpo.trainer.engines`).

One process (``flowgrpo train``) or many (``accelerate launch -m flowgrpo train`` / ``flowgrpo
train --num-processes N``): accelerate reads the launcher's environment, so the same code runs
both. Trackers are accelerate's (``log.trackers``); they log from the main process only.
"""

from __future__ import annotations

import importlib.util
import os
from datetime import timedelta
from pathlib import Path

import torch

from ..errors import ConfigError
from .deepspeed_zero import ZeroWeights
from .engines import FullyShardedWeights, ReplicatedWeights

#: tracker name -> (module it imports, pip package that provides it)
_TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                     "mlflow": ("mlflow", "mlflow"), "comet_ml": ("comet_ml", "comet-ml"), "aim": ("aim", "aim"),
                     "clearml": ("clearml", "clearml"), "dvclive": ("dvclive", "dvclive"),
                     "swanlab": ("swanlab", "swanlab"), "trackio": ("trackio", "trackio")}


def make_accelerator(cfg):
    """The Accelerator for a :class:`~flowgrpo.config.RunConfig`: CPU when no GPU is visible,
    collectives that give up after ``dist.timeout_s``, and the ``log.trackers``."""
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration

    for name in cfg.log.trackers:
        module, package = _TRACKER_PACKAGES.get(name, (name, name))
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key 'log.trackers': tracker {name!r} needs the '{package}' package "
                              f"(pip install {package}), or remove it from log.trackers")
    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.dist.timeout_s))
    # the run directory is not known yet: start_trackers points the trackers at it
    where = ProjectConfiguration(project_dir=cfg.log.out_dir, logging_dir=cfg.log.out_dir)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[timeout],
                              log_with=list(cfg.log.trackers) or None, project_config=where)
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    if kind not in _SUPPORTED_TYPES:
        raise ConfigError(f"accelerate distributed type {kind} is not supported by the trainer; it runs "
                          f"{', '.join(sorted(_SUPPORTED_TYPES))}: use configs/accelerate/ddp.yaml, "
                          "configs/accelerate/fsdp.yaml, configs/accelerate/zero2.yaml or `flowgrpo train --num-processes N`")
    return accelerator


#: accelerate distributed types the trainer runs: replicated weights (gradients summed per step),
#: FSDP2 sharding or DeepSpeed ZeRO 1/2 (flowgrpo.trainer.engines)
_SUPPORTED_TYPES = {"NO", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_MUSA",
                    "MULTI_HPU", "MULTI_SDAA", "FSDP", "DEEPSPEED"}


def _flat_config(data: dict, prefix: str = "") -> dict:
    """``section.key -> value`` with scalars kept and anything else as text (trackers' hparams)."""
    out = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and prefix == "":
            out.update(_flat_config(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


def start_trackers(accelerator, cfg, run_dir: Path, resume_iteration: int | None) -> None:
    """Open the trackers of ``log.trackers`` for ``run_dir`` (main process; no-op without trackers).

    TensorBoard writes under RUN_DIR/tensorboard/ (on resume its events past the checkpoint are
    purged); MLflow uses a file store in RUN_DIR/mlruns unless MLFLOW_TRACKING_URI is set; W&B keeps its files in
    RUN_DIR and names the run after it."""
    if not cfg.log.trackers:
        return

    from ..config import to_dict

    accelerator.project_configuration.set_directories(str(run_dir))
    accelerator.project_configuration.logging_dir = str(Path(run_dir) / "tensorboard")
    init_kwargs: dict = {"wandb": {"dir": str(run_dir), "name": Path(run_dir).name},
                         "mlflow": {"run_name": Path(run_dir).name}}
    if "mlflow" in cfg.log.trackers and "MLFLOW_TRACKING_URI" not in os.environ:
        # MLflow's own default is a database in the working directory; a file store in the run
        # directory keeps the run self-contained (`mlflow ui --backend-store-uri RUN_DIR/mlruns`)
        # (MLflow 3 keeps file stores behind an opt-in; a server or database is one env var away)
        os.environ["MLFLOW_TRACKING_URI"] = (Path(run_dir) / "mlruns").resolve().as_uri()
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    if resume_iteration is not None:
        init_kwargs["tensorboard"] = {"purge_step": resume_iteration + 1}
    accelerator.init_trackers(cfg.log.project, config=_flat_config(to_dict(cfg)), init_kwargs=init_kwargs)


def weight_engine(accelerator, dp) -> ReplicatedWeights:
    """The weight layout the launch asked for: FSDP2 or DeepSpeed ZeRO when the accelerate config says
    so and the run has several processes, else whole weights on every rank."""
    kind = str(accelerator.distributed_type).rsplit(".", 1)[-1]
    use = lambda what: kind == what or os.environ.get(f"ACCELERATE_USE_{what}", "false").lower() == "true"  # noqa: E731
    if dp.processes == 1:
        return ReplicatedWeights(dp)
    if use("FSDP"):
        plugin = getattr(accelerator.state, "fsdp_plugin", None)
        if plugin is None:  # on the CPU accelerate keeps MULTI_CPU: the plugin reads the launcher's FSDP_* variables
            from accelerate.utils import FullyShardedDataParallelPlugin

            plugin = FullyShardedDataParallelPlugin()
        return FullyShardedWeights(dp, plugin)
    if use("DEEPSPEED"):
        plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        if plugin is None:  # on the CPU, as for FSDP: ACCELERATE_DEEPSPEED_* variables
            from accelerate.utils import DeepSpeedPlugin

            plugin = DeepSpeedPlugin()
        return ZeroWeights(dp, plugin)
    return ReplicatedWeights(dp)
