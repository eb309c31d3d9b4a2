"""The ``monitor`` section of a run's configuration and its alarm rules.

A rule is a short string, ``limits`` then an ``action``, judged against the value the same monitor had
in the evaluation before training:

* ``+0.2`` fires when the value rises more than 0.2 above its before-training value (the monitor's
  own units), ``-0.2`` when it falls more than 0.2 below it; ``+100%`` / ``-5%``: the limit is that
  fraction of the before-training value's magnitude (a before-training value of 0 makes a relative
  rule fire on any change in its direction);
* one or two limits (``+0.2 -0.2``: either way), then ``warn`` (print one line, record it) or ``stop``
  (print one line, record it, end the run cleanly: checkpoint, evaluation after training, summary);
* ``off`` (or ``false``, which is what YAML makes of a bare ``off``): measured and logged, never judged.

Examples: ``monitor.dark_share="+0.2 stop"``, ``monitor.velocity_norm="+20% warn"``,
``monitor.reward_rule="-5% warn"``. :func:`parse_rule` reads one; :func:`check_monitor` checks the
section when the configuration is validated.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError, UserError
from ..fields import help_field as _f
from .stats import DARK_LEVEL, GRID_PERIOD, HIGH_FREQ_CUTOFF

#: a rule as configured: its text, or false for off (YAML reads a bare `off` as false)
Rule_ = str | bool
_RULE_HELP = ("rule against the before-training value: limits (+0.2: rises more than 0.2; -0.2: falls more "
              "than 0.2; +100%: rises more than 100 % of its magnitude) then warn | stop, or off (false)")


@dataclass
class MonitorConfig:
    enabled: bool = _f(True, "at every held-out evaluation (before, during and after training; needs an evaluator, "
                             "eval.evaluator) measure the monitors on its samples: image statistics, held-out rewards "
                             "and the velocity norm against the base model; logged as monitor.<name> in metrics.jsonl "
                             "and the trackers, plotted in monitors.png, judged by the rules below (docs/monitors.md)")
    rewards: list = _f([], "held-out rewards: names from `flowgrpo.rewards.REWARDS` scored on the evaluation samples "
                           "and never trained on (monitor.reward.<name>; e.g. [pickscore, aesthetic])")
    reward_options: dict = _f({}, "held-out reward name -> {option: value} passed to its factory, as reward.options")
    reward_rule: Rule_ = _f("-10% warn", f"every held-out reward's {_RULE_HELP}")
    dark_share: Rule_ = _f("+0.2 warn", f"fraction of pixels darker than monitor.dark_level: {_RULE_HELP}")
    dark_level: float = _f(DARK_LEVEL, "luminance (0-1, Rec. 601 luma) below which a pixel counts as dark", gt=0.0, le=1.0)
    saturation: Rule_ = _f("+0.2 -0.2 warn", f"mean HSV saturation (0-1): {_RULE_HELP}")
    grid_energy: Rule_ = _f("+100% warn", f"share of the luminance variance that repeats every monitor.grid_period "
                                        f"pixels (grid artefacts): {_RULE_HELP}")
    grid_period: int = _f(GRID_PERIOD, "grid period in pixels: the VAE's 8 x a 2 x 2 patch (SD3, FLUX, Wan); "
                                       "its spectrum holds the 8-pixel grid's too", ge=2)
    high_freq: Rule_ = _f("+100% warn", f"share of the luminance power above monitor.high_freq_cutoff: {_RULE_HELP}")
    high_freq_cutoff: float = _f(HIGH_FREQ_CUTOFF, "radial frequency (cycles per pixel, Nyquist 0.5) above which "
                                                   "power counts as high-frequency", gt=0.0, lt=0.71)
    velocity_norm: Rule_ = _f("+20% warn", f"mean velocity norm of the evaluated policy over the base model's on the "
                                         f"same states (1 before training): {_RULE_HELP}")
    velocity_samples: int = _f(8, "noises (each with an evaluation prompt) whose ODE the velocity norm follows; "
                                  "0 = not measured (it costs 2 x samples x steps model calls per evaluation)", ge=0)
    velocity_steps: int = _f(10, "Euler steps of that ODE (on the model's grid with sampler.shift)", ge=1)
    batch_size: int = _f(8, "samples per call of a held-out reward and per velocity forward", ge=1)


#: the rule field of each measured statistic (the image statistics' names are :data:`.stats.STAT_NAMES`)
STAT_RULES = ("dark_share", "saturation", "grid_energy", "high_freq", "velocity_norm")

_LIMIT = re.compile(r"^([+-])(\d+(?:\.\d*)?|\.\d+)(%?)$")


@dataclass(frozen=True)
class Rule:
    """A parsed rule: the largest allowed rise and fall (None: unlimited), each absolute or a fraction
    of the before-training value's magnitude, and what a breach does."""

    text: str
    action: Literal["warn", "stop"]
    rise: float | None = None
    rise_relative: bool = False
    fall: float | None = None
    fall_relative: bool = False

    def bounds(self, before: float) -> tuple[float | None, float | None]:
        """The lowest and highest value this rule allows around ``before`` (None: unlimited)."""
        low = None if self.fall is None else before - self.fall * (abs(before) if self.fall_relative else 1.0)
        high = None if self.rise is None else before + self.rise * (abs(before) if self.rise_relative else 1.0)
        return low, high

    def breach(self, name: str, value: float, before: float) -> str | None:
        """A phrase saying how ``value`` passed a limit relative to ``before``, or None within them (or
        when either is not a finite number)."""
        if not (math.isfinite(value) and math.isfinite(before)):
            return None
        low, high = self.bounds(before)
        for word, sign, limit, relative, bound in (("above", "+", self.rise, self.rise_relative, high),
                                                   ("below", "-", self.fall, self.fall_relative, low)):
            if bound is None or (value <= bound if word == "above" else value >= bound):
                continue
            change = abs(value - before)
            by = f"{change / abs(before):.0%}" if relative and before else f"{change:.3g}"
            return (f"{name} {value:.4g} is {by} {word} its before-training {before:.4g} "
                    f"(limit {sign}{_limit_text(limit, relative)})")
        return None


def _limit_text(limit: float, relative: bool) -> str:
    return f"{limit * 100:g}%" if relative else f"{limit:g}"


def parse_rule(text: str | bool, key: str = "rule") -> Rule | None:
    """The :class:`Rule` a rule string states (module docstring), None for ``off`` (or False); a
    ConfigError naming ``key`` otherwise."""
    words = [] if text is False else str(text).split()
    if words in (["off"], []):
        return None
    problem = None
    if words[-1] not in ("warn", "stop"):
        problem = "ends with an action, warn or stop"
    limits: dict[str, tuple[float, bool]] = {}
    for word in words[:-1] if problem is None else []:
        match = _LIMIT.match(word)
        if match is None:
            problem = f"has limits like +0.2, -0.2 or +100%, not {word!r}"
            break
        side = "rise" if match.group(1) == "+" else "fall"
        if side in limits:
            problem = f"gives the {side} limit twice"
            break
        relative = match.group(3) == "%"
        limits[side] = (float(match.group(2)) / (100.0 if relative else 1.0), relative)
    if problem is None and not limits:
        problem = "needs at least one limit before its action"
    if problem is not None:
        raise ConfigError(f"config key '{key}' = {text!r}: a rule {problem} (e.g. '+0.2 warn', '-5% stop', "
                          "'+0.2 -0.2 warn' or 'off')")
    rise, fall = limits.get("rise", (None, False)), limits.get("fall", (None, False))
    return Rule(str(text), words[-1], rise[0], rise[1], fall[0], fall[1])


def monitor_rules(mcfg: MonitorConfig) -> dict[str, Rule]:
    """Monitor name -> its rule (``off`` ones left out): the statistics by their own fields, each held-out
    reward (``reward.<name>``) by ``monitor.reward_rule``."""
    rules = {name: parse_rule(getattr(mcfg, name), f"monitor.{name}") for name in STAT_RULES}
    reward_rule = parse_rule(mcfg.reward_rule, "monitor.reward_rule")
    rules.update({f"reward.{name}": reward_rule for name in mcfg.rewards})
    return {name: rule for name, rule in rules.items() if rule is not None}


def check_monitor(mcfg: MonitorConfig) -> None:
    """Refuse, one line naming the key, a rule that does not parse, a held-out reward that is not a
    registered name (or import path) and options of a reward the section does not name."""
    from ..rewards import REWARDS

    if any(not isinstance(name, str) for name in mcfg.rewards):
        raise ConfigError(f"config key 'monitor.rewards' must be a list of reward names, got {mcfg.rewards!r}")
    monitor_rules(mcfg)
    for name in mcfg.rewards:
        try:
            REWARDS.check(name)
        except UserError as exc:
            raise ConfigError(f"config key 'monitor.rewards': {exc}") from None
    for name, opts in mcfg.reward_options.items():
        if name not in mcfg.rewards:
            raise ConfigError(f"config key 'monitor.reward_options.{name}': {name!r} is not one of the held-out "
                              f"rewards (monitor.rewards: {', '.join(mcfg.rewards) or 'none'})")
        if not isinstance(opts, dict):
            raise ConfigError(f"config key 'monitor.reward_options.{name}' must be a mapping of option -> value")
