"""Reward-hacking monitors: what a run is not trained on, measured at every held-out evaluation.

* :mod:`.stats` -- image statistics as pure functions (dark-pixel share, saturation, grid and
  high-frequency energy);
* :mod:`.measure` -- the monitors of one evaluation: those statistics, held-out rewards (scored,
  never trained on) and the policy's velocity norm against the base model's on the same states,
  attached to the evaluator's result (:class:`.measure.MonitoredEvaluator`);
* :mod:`.config` -- the ``monitor`` configuration section and its warn / stop rules.

The run loop's side (the rules judged after each evaluation, ``monitors.jsonl``, ``monitors.png``)
is :mod:`flowgrpo.trainer.monitor`. Usage and the measured demonstration: docs/monitors.md.
"""
