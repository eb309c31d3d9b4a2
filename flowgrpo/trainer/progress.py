"""The run's progress bar: what a user watches while a run trains.

With a time budget (``train.max_minutes``; the run stops on it) the bar fills over training
minutes and counts iterations (``DiffusionNFT ━━━━ 7:31 / 15:00  iteration 441``); without one it
fills over ``train.iterations``. Its label is the objective that trains, and every figure is named
for what it is: ``kl_ref`` the KL term against the reference model that the loss carries,
``policy_drift`` GRPO's approximate KL between the trained and the rollout policy.
"""

from __future__ import annotations

from ..objectives import objective_label


def clock(seconds: float) -> str:
    """``451.2`` -> ``"7:31"``; an hour or more as ``"1:02:03"``; negative times as ``"0:00"``."""
    m, s = divmod(int(max(0.0, seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def bar_info(m: dict, ref_kl: bool = True) -> str:
    """The bar's metrics from an iteration's metrics ``m``: the mean reward; ``kl_ref`` the KL term
    against the reference model (metric ``kl``; only with ``ref_kl``, i.e. where the loss has one);
    ``kl_ema`` a KL term against a lagging copy; ``policy_drift`` GRPO's approximate KL from the
    rollout policy (``approx_kl``) and ``clip`` its clipped fraction; objectives without ratio
    diagnostics show their ``loss``. Empty metrics give ``""``."""
    if not m:
        return ""
    parts = [f"reward {m.get('reward_mean', float('nan')):.3f}"]
    if "approx_kl" not in m and "loss" in m:
        parts.append(f"loss {m['loss']:.3g}")
    if ref_kl and "kl" in m:
        parts.append(f"kl_ref {m['kl']:.2e}")
    if "ema_kl" in m:
        parts.append(f"kl_ema {m['ema_kl']:.2e}")
    if "approx_kl" in m:
        parts.append(f"policy_drift {m['approx_kl']:.2e}")
    if "clipfrac_high" in m or "clipfrac_low" in m:
        parts.append(f"clip {m.get('clipfrac_high', 0) + m.get('clipfrac_low', 0):.2f}")
    return "  ".join(parts)


def bar_fields(objective: str, done: int, iterations: int, train_seconds: float, max_minutes: float,
               metrics: dict | None = None, ref_kl: bool = True) -> dict:
    """What the bar shows, as ``Progress.add_task`` / ``update`` keywords.

    Args: objective, ``loss.objective``; done, iterations finished; iterations, ``train.iterations``;
    train_seconds, training time so far (s); max_minutes, the time budget (0: none); metrics, the
    latest iteration's; ref_kl, whether the loss has a reference-model KL term."""
    if max_minutes:
        budget = max_minutes * 60
        completed, total = min(train_seconds, budget), budget
        status = f"{clock(train_seconds)} / {clock(budget)}  iteration {done}"
    else:
        completed, total = done, iterations
        status = f"iteration {done}/{iterations}  {clock(train_seconds)}"
    return {"description": objective_label(objective), "completed": completed,
            "total": total, "status": status, "info": bar_info(metrics or {}, ref_kl)}


def progress_bar(enabled: bool):
    """A rich ``Progress`` drawing :func:`bar_fields`; disabled, it draws nothing."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn

    console = Console()
    if not console.is_terminal:  # a log file: the whole line, not one cut to 80 columns
        console = Console(width=200)
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=24),
                    TextColumn("{task.fields[status]}  {task.fields[info]}"), console=console, disable=not enabled,
                    transient=False)
