"""What ``flowgrpo train --resume RUN_DIR`` may change of the run it continues.

A resumed run is the recorded run, continued: its checkpoint's weights, optimizer moments, curriculum
and clock were made under the recorded configuration (``RUN_DIR/config.yaml``). ``--resume RUN
--preset mix-grpo`` and ``--resume RUN train.lr=0.003`` used to run on with the old settings without
a word. Now (:func:`resumed_config`):

* ``--preset`` or ``--recipe`` naming another method or model family than the recorded one is
  refused in one line (the same names are accepted: they change nothing);
* a ``--config`` file and ``key=value`` overrides are applied to the recorded configuration. A key of
  :data:`CONTINUE_KEYS` may change: the changes are named in one printed note and recorded in the
  run's ``config.yaml`` (so a later ``--resume`` keeps them). Any other key that changes is refused
  in one line naming the key, its recorded value and the one asked for.
"""

from __future__ import annotations

import copy
from pathlib import Path

from ..errors import UserError

#: The keys a resumed run may change. They say how far the run goes and what it writes and shows, not
#: what it computes, so the run stays the recorded one continued: its budgets (``flowgrpo train --resume
#: RUN train.max_minutes=60 eval.every_minutes=5`` extends a run, docs/shapes_world.md), when it
#: evaluates (evaluation does not train; the clock pauses for it), how often it writes checkpoints and
#: sample grids, its trackers and progress bar, how long ranks wait for one another, how many of them
#: split each video's tokens (``dist.context_parallel``: the same update, on another number of processes),
#: its CPU threads, and ``model.path``: where the same base weights lie now (docs/cli.md: pointing a shapes run back
#: at its original weights; its base_weights.json checks they are the same). Everything else (the
#: model, sampler, method, rewards, prompts, learning rate, seeds, evaluation sets) is what the
#: checkpoint was made with: a new value would make a run that is neither the recorded one nor a new
#: one, so it is refused (start a new run instead).
CONTINUE_KEYS = (
    "train.iterations", "train.max_minutes",
    "eval.every", "eval.every_minutes",
    "log.checkpoint_every", "log.grid_every", "log.trackers", "log.project", "log.progress",
    "dist.timeout_s", "dist.context_parallel", "train.threads", "model.path",
)


def resumed_config(run_dir: Path, preset: str | None = None, recipe: str | None = None,
                   config_file: str | None = None, overrides: list[str] = (), quiet: bool = False):
    """The recorded configuration of ``run_dir`` with what ``--config`` / ``overrides`` change among
    :data:`CONTINUE_KEYS` (named in a note unless ``quiet``), validated; a UserError for a ``preset``
    or ``recipe`` other than the recorded one and for any other key they change (module docstring)."""
    from ..config import apply_overrides, apply_dict, validate
    from ..trainer.checkpoint import read_run_config

    recorded = read_run_config(run_dir)
    _check_same(run_dir, "--preset", preset, recorded.preset, "method")
    _check_same(run_dir, "--recipe", recipe, recorded.recipe, "recipe")
    cfg = copy.deepcopy(recorded)
    if config_file:
        data = _config_file(config_file)
        _check_same(run_dir, f"--config {config_file}'s base:", data.pop("base", None), recorded.preset, "method")
        apply_dict(cfg, data)
    apply_overrides(cfg, overrides)
    validate(cfg)
    changes = changed_keys(recorded, cfg)
    refused = [c for c in changes if c[0] not in CONTINUE_KEYS]
    if refused:
        key, old, new = refused[0]
        more = f" (and {', '.join(k for k, _, _ in refused[1:])})" if len(refused) > 1 else ""
        raise UserError(f"--resume {run_dir}: {key} was {old!r} in the recorded run, asked {new!r}{more}; a resumed "
                        f"run keeps its settings but for {', '.join(CONTINUE_KEYS)}: start a new run to change it")
    if changes and not quiet:
        print(f"note: resuming {run_dir} with " + ", ".join(f"{k}={new!r} (was {old!r})" for k, old, new in changes))
    return cfg


def changed_keys(before, after) -> list[tuple[str, object, object]]:
    """``(key, before, after)`` for each flattened key (:func:`~flowgrpo.config.layers.flatten`) whose value
    differs between the two configurations, in the configuration's order."""
    from ..config.layers import flatten

    old, new = flatten(before), flatten(after)
    return [(k, old.get(k), new.get(k)) for k in [*old, *(k for k in new if k not in old)] if old.get(k) != new.get(k)]


def _check_same(run_dir: Path, option: str, asked: str | None, recorded: str, what: str) -> None:
    """A UserError when ``option`` names ``asked``, another layer than the run's ``recorded`` one."""
    if asked and asked != recorded:
        raise UserError(f"--resume {run_dir}: {option} {asked} differs from the run's {what} {recorded or '(none)'!r}; "
                        f"a resumed run keeps its {what} (drop {option.split()[0]}, or start a new run with it)")


def _config_file(path: str) -> dict:
    """The mapping of ``--config`` file ``path`` (checked to be text by the caller); a UserError for a
    missing one."""
    from ..presets import load_yaml_mapping

    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file not found: {file}")
    return load_yaml_mapping(file.read_text(encoding="utf-8"), f"config file {file}")
