"""A run folder on disk: atomic checkpoints, the run's config, and the trained policy's weights.

Checkpoints are written to a temporary folder, then renamed into place; a write that fails (a full
disk, a read-only folder) removes the temporary folder and stops with one line naming the checkpoint.
A checkpoint damaged later (a file cut short by a full disk or a partial copy, or bytes overwritten
inside it: every record of the zip archive torch writes carries a CRC-32, checked before loading) is
passed over with a warning naming it and the record: resume,
``flowgrpo eval``, ``export`` and ``unigenbench generate`` use the newest intact one, and when none is
intact they stop with one line (:class:`~flowgrpo.errors.UserError`). State files are read as tensors
and plain data only (:mod:`flowgrpo.safe_load`): one holding anything else, a pickle that would run
code, is refused in one line rather than passed over.

:func:`load_policy_weights` is the one way to get a run's trained weights (its EMA when the run kept
one, as the run's own evaluation and its ``lora/`` export use), as a :class:`PolicyWeights` record.
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from ..disk import write_problem
from ..errors import ConfigError, UserError
from ..safe_load import UnsafeFileError, load_tensors
from ..text_inputs import load_yaml
from .base_weights import check_base_weights

if TYPE_CHECKING:
    from ..config import RunConfig

CKPT_PREFIX = "ckpt_"
STATE_FILE = "state.pt"
CONFIG_FILE = "config.yaml"


@dataclass(frozen=True)
class Checkpoint:
    """One loaded checkpoint: its folder and the state :func:`save_checkpoint` wrote
    (``{"trainer": trainer state, "train_seconds": float}``)."""

    path: Path
    state: dict

    @property
    def iteration(self) -> int:
        """The trainer's iteration when the state records it, else the folder's (``ckpt_000012`` -> 12)."""
        recorded = self.state["trainer"].get("iteration")
        return int(recorded) if recorded is not None else checkpoint_iteration(self.path)


@dataclass(frozen=True)
class PolicyWeights:
    """A run's trained weights, as :meth:`~flowgrpo.policies.Policy.load_trainable_state_dict` takes them.

    ``kind`` says which: "ema" (the exponential moving average the run evaluates and exports) or
    "raw" (the weights the optimizer stepped); ``iteration`` and ``path`` name the checkpoint."""

    weights: dict[str, torch.Tensor]
    kind: Literal["ema", "raw"]
    iteration: int
    path: Path


def save_checkpoint(run_dir: Path, iteration: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` (tensors and plain data) as ``RUN_DIR/checkpoints/ckpt_{iteration:06d}``.

    The folder is complete or absent: it is written under a temporary name and renamed, so a
    crash (even SIGKILL) mid-write never leaves a half checkpoint that resume would pick up.
    Older checkpoints beyond ``keep`` are removed. A write that fails (``OSError``, or torch's
    ``RuntimeError`` from its stream writer, e.g. on a full disk) removes the temporary folder and
    raises a one-line :class:`~flowgrpo.errors.UserError` naming the checkpoint; older ones are kept.
    """
    root = run_dir / "checkpoints"
    final = root / f"{CKPT_PREFIX}{iteration:06d}"
    tmp = root / f".tmp_{CKPT_PREFIX}{iteration:06d}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        torch.save(state, tmp / STATE_FILE)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except (OSError, RuntimeError) as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"cannot write checkpoint {final}: {write_problem(exc, root)}; the older checkpoints "
                        "are kept (resume with --resume RUN_DIR once the problem is fixed)") from None
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint folder of ``run_dir`` holding a state file, oldest first (intact or not)."""
    root = Path(run_dir) / "checkpoints"
    if not root.exists():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(CKPT_PREFIX) and (p / STATE_FILE).exists())


def checkpoint_iteration(path: Path) -> int:
    """The iteration of checkpoint folder ``path`` (``ckpt_000012`` -> 12)."""
    return int(Path(path).name[len(CKPT_PREFIX):])


def checkpoint_damage(path: Path) -> str | None:
    """Why checkpoint folder ``path`` cannot be loaded, or None when it looks intact.

    A cheap structural check of the state file (torch's zip archive): its directory is present,
    every record lies within the file, and the pickle record is whole (CRC). A file cut short fails
    it; damage inside a tensor record is only found by :func:`load_checkpoint`."""
    file = Path(path) / STATE_FILE
    try:
        size = file.stat().st_size
        with zipfile.ZipFile(file) as zf:
            infos = zf.infolist()
            if any(i.header_offset + i.compress_size > size for i in infos):
                return "a record runs past the end of the file: cut short"
            pickles = [i for i in infos if i.filename.endswith("/data.pkl") or i.filename == "data.pkl"]
            if not pickles:
                return "no data.pkl record: not a torch checkpoint"
            zf.read(pickles[0])  # checks the CRC
    except zipfile.BadZipFile as exc:
        return f"not a whole zip archive, cut short? {exc}"
    except (OSError, zipfile.LargeZipFile) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}"
    return None


class _Damaged(Exception):
    """A checkpoint that cannot be used; its message says why (passed over for an older one)."""


def _newest_intact(run_dir: Path, take):
    """``take(path)`` of the newest checkpoint for which it does not raise :class:`_Damaged`; a
    warning names each newer damaged one. None when the run has no checkpoint; a UserError naming
    every checkpoint and its damage when none is intact."""
    ckpts = list_checkpoints(run_dir)
    damaged: list[tuple[Path, str]] = []
    for path in reversed(ckpts):
        try:
            found = take(path)
        except _Damaged as exc:
            damaged.append((path, str(exc)))
            continue
        for bad, problem in damaged:
            print(f"flowgrpo: warning: checkpoint {bad / STATE_FILE} is damaged ({problem}); "
                  f"using the older {path.name}", file=sys.stderr)
        return found
    if ckpts:
        listed = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged)
        raise UserError(f"run directory {run_dir} has no intact checkpoint ({listed}); "
                        "start a new run or restore a checkpoint from a copy")
    return None


def _intact_path(path: Path) -> Path:
    problem = checkpoint_damage(path)
    if problem is not None:
        raise _Damaged(problem)
    return path


def _load_intact(path: Path) -> Checkpoint:
    _intact_path(path)
    problem = crc_problem(Path(path) / STATE_FILE)
    if problem is not None:
        raise _Damaged(problem)
    try:
        return Checkpoint(path, _read_state(Path(path) / STATE_FILE))
    except UnsafeFileError:  # not damage: an older checkpoint of a folder someone wrote into is no refuge
        raise
    except UserError as exc:
        raise _Damaged(str(exc)) from None


def crc_problem(file: Path) -> str | None:
    """Which record of checkpoint file ``file`` (torch's zip archive) no longer matches the CRC-32
    written beside it (bytes changed after writing, e.g. overwritten weights), or None when all match.

    torch.load itself does not check the tensors' checksums, so damage inside a weight record would
    load silently. Reads the whole file in 16 MiB chunks (about the cost of loading it once); a
    record stored without a checksum (CRC 0: torch's ``compute_crc32`` turned off) is not checked."""
    try:
        with zipfile.ZipFile(file) as zf:
            for info in zf.infolist():
                if info.CRC == 0:
                    continue
                try:
                    with zf.open(info) as fh:  # reading to the end makes zipfile compare the CRC-32
                        deque(iter(lambda: fh.read(1 << 24), b""), maxlen=0)
                except zipfile.BadZipFile:
                    return f"record {info.filename} fails its CRC-32 check: its bytes changed after it was written"
    except (OSError, zipfile.BadZipFile, zipfile.LargeZipFile) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'unreadable'}"
    return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint folder that passes :func:`checkpoint_damage` (a warning names each newer
    damaged one); None when the run has no checkpoint; a UserError when it has some but none is intact."""
    return _newest_intact(run_dir, _intact_path)


def load_checkpoint(path: Path) -> dict:
    """The state saved in checkpoint folder ``path``; a UserError names the file when it cannot be read
    or its checksums show damage (:func:`crc_problem`: the record is named)."""
    file = Path(path) / STATE_FILE
    problem = crc_problem(file) if file.is_file() else None
    if problem is not None:
        raise UserError(f"checkpoint {file} is damaged: {problem}")
    return _read_state(file)


def _read_state(file: Path) -> dict:
    """Checkpoint file ``file`` read as tensors and plain data only (:func:`~flowgrpo.safe_load.load_tensors`:
    an :class:`~flowgrpo.safe_load.UnsafeFileError` when it holds anything else); a UserError naming
    it when it cannot be read."""
    try:
        return load_tensors(file)
    except UnsafeFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError, EOFError, UnpicklingError, ... for damage
        raise UserError(f"checkpoint {file} cannot be loaded ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'})") from None


def load_latest_intact(run_dir: Path) -> Checkpoint | None:
    """The newest checkpoint of ``run_dir`` that loads, passing over (with a warning naming each)
    damaged newer ones; None when the run has no checkpoint; a UserError when none loads."""
    return _newest_intact(run_dir, _load_intact)


def policy_weights(ckpt: Checkpoint, prefer_ema: bool = True) -> PolicyWeights:
    """The trained weights of a loaded checkpoint: its EMA when ``prefer_ema`` and the run kept one."""
    trainer = ckpt.state["trainer"]
    if prefer_ema and trainer.get("ema"):
        return PolicyWeights(trainer["ema"], "ema", ckpt.iteration, ckpt.path)
    return PolicyWeights(trainer["trainable"], "raw", ckpt.iteration, ckpt.path)


def load_policy_weights(run_dir: Path, prefer_ema: bool = True, checkpoint: int | Path | None = None) -> PolicyWeights:
    """The trained policy weights of run folder ``run_dir``: of ``checkpoint`` (an iteration, or a
    checkpoint folder), else of the newest intact checkpoint. The EMA weights when ``prefer_ema`` and
    the run kept them (what the run evaluated and exported), else the raw ones. One-line UserErrors:
    no checkpoint yet, no such checkpoint (listing those there are), a damaged one."""
    run_dir = Path(run_dir)
    if isinstance(checkpoint, (str, Path)):
        return policy_weights(Checkpoint(Path(checkpoint), load_checkpoint(checkpoint)), prefer_ema)
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise UserError(f"run directory {run_dir} has no checkpoint yet")
    if checkpoint is None:
        ckpt = load_latest_intact(run_dir)
    else:
        path = run_dir / "checkpoints" / f"{CKPT_PREFIX}{checkpoint:06d}"
        if path not in ckpts:
            have = ", ".join(str(checkpoint_iteration(p)) for p in ckpts)
            raise UserError(f"{run_dir} has no checkpoint {checkpoint} (available: {have})")
        ckpt = Checkpoint(path, load_checkpoint(path))
    return policy_weights(ckpt, prefer_ema)


def read_run_config(run_dir: Path, *, for_training: bool = True) -> RunConfig:
    """The resolved config a run folder was trained with (``RUN_DIR/config.yaml``), validated.

    ``for_training`` False: only what rebuilding the policy needs is checked (``config.validate``), so a
    run trained with a function as its reward or a plug-in objective can still be evaluated, sampled
    and exported. A missing, unreadable, non-text, malformed or invalid file is one UserError naming it."""
    from ..config import RunConfig, apply_dict, validate

    path = Path(run_dir) / CONFIG_FILE
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory (no {CONFIG_FILE})")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"), str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} cannot be read as YAML ({str(exc).splitlines()[0]})") from None
    except ConfigError as exc:  # invalid YAML, an alias bomb, nesting too deep (a shared run's file)
        raise UserError(f"{path} cannot be read as YAML ({str(exc).removeprefix(f'{path} ')})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} must hold a mapping of config sections, not {type(data).__name__}")
    cfg = RunConfig()
    try:
        apply_dict(cfg, data)
        validate(cfg, for_training=for_training)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return cfg


@dataclass
class TrainedPolicy:
    """A run's policy with its trained weights loaded: ``cfg`` the run's config, ``weights`` which ones."""

    cfg: RunConfig
    policy: object
    weights: PolicyWeights


def load_trained_policy(target: Path, only_model: str | None = None, *, prefer_ema: bool = True,
                        iteration: int | None = None, overrides: tuple[str, ...] = ()) -> TrainedPolicy:
    """The policy of a run folder (its newest intact checkpoint) or of one checkpoint folder
    (``RUN_DIR/checkpoints/ckpt_N``), built from the run's config with its trained weights (the EMA
    where the run kept one), seeded with the run's seed so that any randomly initialised module is
    the run's. A folder that is neither, or (with ``only_model``) a run of another ``model.name``, is one
    UserError before any model is built.

    ``prefer_ema`` False: the raw weights even where the run kept an EMA; ``iteration``: that checkpoint
    of a run folder instead of the newest; ``overrides``: ``key.sub=value`` config overrides applied to the
    run's config (validated) before the policy is built, e.g. ``model.guidance_scale=4``."""
    from ..policies import build_policy

    target = Path(target)
    if (target / STATE_FILE).exists():
        run_dir, checkpoint = target.resolve().parent.parent, target
    elif (target / CONFIG_FILE).exists():
        run_dir, checkpoint = target, None
    else:
        raise UserError(f"{target} is neither a run directory nor a checkpoint folder")
    cfg = read_run_config(run_dir, for_training=False)  # the rewards and the objective are not rebuilt
    if overrides:
        from ..config import apply_overrides, validate

        apply_overrides(cfg, overrides)
        validate(cfg, for_training=False)
    if only_model is not None and cfg.model.name != only_model:
        raise UserError(f"{run_dir} trained model {cfg.model.name!r}; only {only_model!r} runs are read here")
    check_base_weights(run_dir, cfg.model)
    trained = load_policy_weights(run_dir, prefer_ema, checkpoint if checkpoint is not None else iteration)
    torch.manual_seed(cfg.train.seed)
    policy = build_policy(cfg.model)
    policy.load_trainable_state_dict(trained.weights)
    return TrainedPolicy(cfg, policy, trained)
