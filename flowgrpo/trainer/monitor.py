"""The reward-hacking monitors in a training run: the monitored evaluator and the rules' callback.

:func:`monitored_evaluator` is the run's evaluator (``eval.evaluator``) with the monitors measured on
its held-out samples (:class:`flowgrpo.monitors.measure.MonitoredEvaluator`), and adds a
:class:`MonitorAlarms` callback to the trainer, which at every evaluation:

* judges each monitor's rule (``monitor.<name>``, :mod:`flowgrpo.monitors.config`) against the value
  of the evaluation before training: ``warn`` prints one line the first time a rule fires, ``stop``
  prints one line and asks the run loop to stop (``trainer.callbacks.request_stop``: a checkpoint,
  the evaluation after training and the summary follow as at the end of the time budget);
* appends a line to ``RUN_DIR/monitors.jsonl``: ``stage`` (before / during / after), ``iteration``
  (iterations done), ``train_seconds``, ``monitors`` (name -> value) and ``alarms`` (every rule
  breached at that evaluation: ``monitor``, ``action``, ``message``);
* draws ``RUN_DIR/monitors.png`` (:func:`flowgrpo.output.monitor_plot.save_monitor_curves`) after
  training and at every evaluation where a rule fires.

The values during training are in ``metrics.jsonl`` too (``monitor.<name>``, and the trackers); the
values before and after training in ``eval_before.json`` and ``summary.json`` (``monitors``). A resumed
run takes its before-training values from ``eval_before.json`` and keeps ``monitors.jsonl`` up to its
checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..evaluation import build_evaluator
from ..monitors.config import MonitorConfig, monitor_rules
from ..monitors.measure import MonitoredEvaluator
from ..output.monitor_plot import save_monitor_curves
from ..callbacks import Callback
from .metrics import json_safe
from ..text_inputs import loads_json

RECORDS = "monitors.jsonl"
PLOT = "monitors.png"


def monitored_evaluator(cfg, trainer) -> tuple[object | None, str]:
    """The evaluator ``eval.evaluator`` selects for ``trainer.policy`` (with its note, as
    :func:`flowgrpo.evaluation.build_evaluator`), wrapped to measure the monitors when ``monitor.enabled``;
    the trainer's callbacks then end with a :class:`MonitorAlarms` (replacing an earlier one)."""
    evaluator, note = build_evaluator(cfg.eval, trainer.policy, cfg.sampler.shift)
    mcfg = cfg.monitor
    if evaluator is None or not mcfg.enabled:
        return evaluator, note
    from ..rewards import build_reward
    from ..rewards.base import wants_metadata, wants_references

    rewards = {name: build_reward(name, **mcfg.reward_options.get(name, {})) for name in mcfg.rewards}
    for name, fn in rewards.items():
        if wants_metadata(fn) or wants_references(fn):
            raise ConfigError(f"config key 'monitor.rewards': {name!r} reads prompt metadata or reference images, "
                              "which the evaluation samples do not carry; monitor it with `flowgrpo eval --bench`")
    wrapped = MonitoredEvaluator(evaluator, mcfg, rewards, cfg.sampler.shift, cfg.reward.frame_stride,
                                 velocity=_base_velocity_available(trainer))
    items = trainer.callbacks.items
    items[:] = [cb for cb in items if not isinstance(cb, MonitorAlarms)] + [MonitorAlarms(mcfg)]
    return wrapped, note


#: the largest denoiser (bytes) of which the monitors take a frozen copy of their own (the shapes world's
#: is 14 MB; a real transformer is gigabytes, which a run does not spend unasked)
REFERENCE_COPY_LIMIT = 1 << 30


def _base_velocity_available(trainer) -> bool:
    """Whether the policy can give the base model's velocity beside its own (``adapter_disabled``). LoRA
    disables its adapter. A full fine-tune needs a frozen copy of the denoiser: the objective's when a
    term keeps one (KL, anchor); otherwise one taken here when the denoiser is under
    :data:`REFERENCE_COPY_LIMIT` and the engine does not shard it (FSDP, ZeRO), else not measured (a
    note says so). Edit models (reference images) are not measured."""
    policy = trainer.policy
    if trainer.cfg.monitor.velocity_samples == 0 or policy.takes_references:
        return False
    if getattr(policy, "train_mode", None) == "full" and not trainer.objective.needs_reference:
        denoiser = getattr(policy, "denoiser", policy)
        size = sum(p.numel() * p.element_size() for p in denoiser.parameters())
        # a sharded denoiser, or a context-parallel one (its copy would carry the split hooks), is not copied
        if trainer.engine.lockstep or trainer.dp.context_parallel > 1 or size > REFERENCE_COPY_LIMIT:
            if trainer.dp.is_main:
                print(f"note: monitor.velocity_norm is not measured: a full fine-tune without a reference copy of "
                      f"its {size / 2**30:.1f} GiB denoiser{' (sharded)' if trainer.engine.lockstep else ''}; "
                      "a KL or anchor term keeps one (e.g. loss.grpo.kl_beta > 0)")
            return False
        policy.snapshot_reference()
    return True


class MonitorAlarms(Callback):
    """The monitors' rules, records and plot in a run (module docstring)."""

    def __init__(self, mcfg: MonitorConfig):
        self.rules = monitor_rules(mcfg)
        self.keys = {name: f"monitor.{name}" if not name.startswith("reward.") else "monitor.reward_rule"
                     for name in self.rules}
        self.before: dict[str, float] | None = None
        self.run_dir: Path | None = None
        self.records: list[dict] = []
        self.fired: set[str] = set()
        self.pending: dict | None = None
        self.seconds = 0.0

    def on_run_start(self, trainer, run_dir: Path, resumed: bool) -> None:
        self.run_dir, self.pending, self.seconds = Path(run_dir), None, 0.0
        path = self.run_dir / RECORDS
        self.records, self.before = [], None
        if resumed and path.exists():
            self.records = [r for r in map(json.loads, filter(str.strip, path.read_text().splitlines()))
                            if r["stage"] != "after" and r["iteration"] <= trainer.iteration]
            before = self.run_dir / "eval_before.json"
            if before.exists():
                self.before = loads_json(before.read_text()).get("monitors") or None
        self.fired = {a["monitor"] for r in self.records for a in r["alarms"]}
        self.seconds = max([r["train_seconds"] for r in self.records] + [0.0])
        path.write_text("".join(json.dumps(r) + "\n" for r in self.records))

    def on_evaluation(self, trainer, result, stage) -> None:
        values = dict(getattr(result, "monitors", {}) or {})
        if not values or self.run_dir is None:
            return
        if stage == "before":
            self.before = values
        alarms = [] if stage == "before" or self.before is None else self._judge(trainer, values, stage)
        record = {"stage": stage, "iteration": trainer.iteration, "train_seconds": self.seconds,
                  "monitors": values, "alarms": alarms}
        if stage == "during":  # written with its iteration's training time, at the iteration's end
            self.pending = record
        else:
            self._write(record)

    def on_iteration_end(self, trainer, metrics: dict) -> None:
        self.seconds = float(metrics.get("train_seconds", self.seconds))
        if self.pending is not None:
            self.pending["train_seconds"] = self.seconds
            self._write(self.pending)
            self.pending = None

    def _judge(self, trainer, values: dict[str, float], stage: str) -> list[dict]:
        """Each rule breached by ``values``; the first breach of a rule prints its line, a stop rule's
        asks the run to stop."""
        alarms = []
        for name, rule in self.rules.items():
            if name not in values or name not in self.before:
                continue
            message = rule.breach(name, values[name], self.before[name])
            if message is None:
                continue
            alarms.append({"monitor": name, "action": rule.action, "message": message})
            stopping = rule.action == "stop" and stage == "during" and trainer.callbacks.stop_reason is None
            if name in self.fired and not stopping:
                continue
            self.fired.add(name)
            where = f"at iteration {trainer.iteration}" if stage == "during" else "after training"
            tail = "; stopping the run (checkpoint, evaluation after training, summary)" if stopping else ""
            print(f"monitor {rule.action}: {message} {where} ({self.keys[name]}={rule.text!r}){tail}")
            if stopping:
                trainer.callbacks.request_stop(f"monitor stop: {message}")
        return alarms

    def _write(self, record: dict) -> None:
        self.records.append(json_safe(record))
        with (self.run_dir / RECORDS).open("a") as fh:
            fh.write(json.dumps(self.records[-1], allow_nan=False) + "\n")
        if record["stage"] != "after" and not record["alarms"]:
            return  # drawn after training and where an alarm fires (a figure costs seconds of CPU)
        limits = {name: rule.bounds(self.before[name]) for name, rule in self.rules.items()
                  if self.before and self.before.get(name) is not None}
        save_monitor_curves(self.run_dir / PLOT, self.records, limits)
