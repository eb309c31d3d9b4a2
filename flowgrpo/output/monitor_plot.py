"""``monitors.png``: each reward-hacking monitor against training time, with its alarm limits."""

from __future__ import annotations

from pathlib import Path


def save_monitor_curves(path: Path, records: list[dict], limits: dict[str, tuple[float | None, float | None]],
                        title: str = "") -> None:
    """One panel per monitor: its value at each evaluation of ``records`` (``monitors.jsonl`` lines:
    ``train_seconds``, ``monitors`` name -> value, ``alarms`` [{monitor, action, ...}]) against training
    minutes; dashed lines at ``limits[name]`` (lowest, highest allowed; None: no limit), a red cross
    where an alarm fired (a filled square where it was a stop)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(k for r in records for k in r.get("monitors", {})))
    if not names:
        return
    ncol = min(3, len(names))
    nrow = (len(names) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 2.8 * nrow), squeeze=False)
    for ax, name in zip(axes.flat, names):
        points = [(r.get("train_seconds", 0.0) / 60.0, r["monitors"][name], r) for r in records
                  if r.get("monitors", {}).get(name) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", ms=3, color="tab:blue")
        for bound in limits.get(name, (None, None)):
            if bound is not None:
                ax.axhline(bound, ls="--", lw=1, color="tab:gray")
        for x, y, r in points:
            actions = [a["action"] for a in r.get("alarms", []) if a["monitor"] == name]
            if actions:
                ax.plot([x], [y], marker="s" if "stop" in actions else "x", ms=8, color="tab:red", ls="none")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("training minutes", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    fig.suptitle(title or "monitors on the held-out samples (dashed: alarm limits; red: alarm fired)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
