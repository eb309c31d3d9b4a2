"""Rewards overlapped with sampling: collect time with a slow served reward, serial against waves.

    flowgrpo bench overlap [--out DIR] [--json PATH]
    python -m flowgrpo.benchmarks.bench_overlap [--out DIR] [--json PATH] [--delay 0.2] [--iterations 4]
        [--waves 4 8] [--concurrency 8] [--preset shapes-nft]

A reward server runs in a child process (uvicorn on a loopback socket) and serves the shapes verifier
behind a fixed delay per reward call (``--delay`` seconds, 0.2 by default: a remote reward model or
judge). The trainer scores through the ``remote`` reward, one group per request
(``batch_size`` = group size). For each setting it runs ``--iterations`` iterations of the preset
and reports the median per iteration of

- ``sample_s``: the rollout's model calls (main thread),
- ``collect_s``: the whole collect stage (sampling, decoding, scoring not hidden behind sampling),
- ``bound_s``: max(sampling, scoring), with the scoring time taken from the serial setting
  (collect - sample), the best that overlapping can reach,

for: ``serial`` (one batch, scored after it), ``waves W`` (W waves, each scored on a worker thread
while the next samples), ``serial+concurrent`` and ``waves W+concurrent`` (``--concurrency``
requests in flight, which the server batches into fewer reward calls). The settings
run interleaved, one iteration each in turn, so machine load affects them alike. Writes
``overlap.csv`` and ``overlap.png``; every setting trains on the same numbers (tests check that).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

from flowgrpo.config import load_config
from flowgrpo.rewards import build_reward
from flowgrpo.rewards.base import RewardOutput

from . import output_dir, print_table, write_csv, write_json

COLUMNS = ("setting", "waves", "concurrency", "iterations", "sample_s", "collect_s", "bound_s", "collect_vs_serial",
           "collect_vs_bound")


class DelayedReward:
    """A reward that answers after ``delay`` seconds per call (the server calls it once per batch)."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.name = getattr(inner, "name", "delayed")

    def __call__(self, images, prompts, groups=None) -> RewardOutput:
        time.sleep(self.delay)
        return self.inner(images, prompts, groups)


def _trainer(preset: str, url: str, waves: int, concurrency: int, group: int, seed: int, extra: tuple[str, ...]):
    from flowgrpo.trainer.trainer import Trainer

    overrides = [*extra, "reward.weights={remote: 1.0}", f"reward.options.remote.url={url}",
                 f"reward.options.remote.batch_size={group}", f"reward.options.remote.concurrency={concurrency}",
                 f"reward.waves={waves}", f"train.seed={seed}", "log.progress=false"]
    return Trainer(load_config(preset, None, overrides))


def _serve(sock, delay: float) -> None:
    """The server process: the shapes verifier behind ``delay`` seconds per call, on ``sock``."""
    import uvicorn

    from flowgrpo.serve import create_app

    app = create_app(DelayedReward(build_reward("shapes"), delay), max_batch=256)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


@contextlib.contextmanager
def _server_process(delay: float):
    """A reward server in its own process (so that its Python work does not hold this process's GIL)."""
    import multiprocessing

    from flowgrpo.serve.server import bind_socket, poll_health

    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    proc = multiprocessing.get_context("fork").Process(target=_serve, args=(sock, delay), daemon=True)
    proc.start()
    try:
        if not poll_health(url, proc.is_alive):
            raise RuntimeError("the benchmark's reward server did not start")
        yield url
    finally:
        proc.terminate()
        proc.join(10)
        sock.close()


def run_bench_overlap(json_path=None, out_dir=None, delay: float = 0.2, iterations: int = 4,
                      waves: tuple[int, ...] = (4, 8), concurrency: int = 8, preset: str = "shapes-nft",
                      seed: int = 0, overrides: tuple[str, ...] = ()) -> dict:
    """Run the benchmark (see the module docstring); returns the JSON it writes. ``overrides``:
    ``key=value`` config overrides applied to the preset (e.g. a smaller run for a smoke test)."""
    out = output_dir(out_dir)
    group = load_config(preset, None, list(overrides)).data.trees_per_prompt
    settings = {"serial": (1, 1), **{f"waves {w}": (w, 1) for w in waves}, "serial+concurrent": (1, concurrency),
                **{f"waves {w}+concurrent": (w, concurrency) for w in waves}}
    times: dict[str, dict[str, list[float]]] = {k: {"sample": [], "collect": []} for k in settings}
    with _server_process(delay) as url:
        trainers = {k: _trainer(preset, url, w, c, group, seed, tuple(overrides)) for k, (w, c) in settings.items()}
        for it in range(iterations + 1):  # iteration 0 warms up (first calls, allocations)
            for name, tr in trainers.items():
                col = tr.collect(it)
                if it:
                    times[name]["sample"].append(col.seconds)
                    times[name]["collect"].append(col.collect_seconds)
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in times.items()}
    scoring = {"": med["serial"]["collect"] - med["serial"]["sample"],
               "+concurrent": med["serial+concurrent"]["collect"] - med["serial+concurrent"]["sample"]}
    rows = []
    for name, (w, c) in settings.items():
        score_s = scoring["+concurrent" if name.endswith("+concurrent") else ""]
        bound = max(med[name]["sample"], score_s) if w > 1 else med[name]["sample"] + score_s
        rows.append({"setting": name, "waves": w, "concurrency": c, "iterations": iterations,
                     "sample_s": round(med[name]["sample"], 4), "collect_s": round(med[name]["collect"], 4),
                     "bound_s": round(bound, 4),
                     "collect_vs_serial": round(med[name]["collect"] / med["serial"]["collect"], 3),
                     "collect_vs_bound": round(med[name]["collect"] / bound, 3)})
    print_table(COLUMNS, [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS] for r in rows],
                title=f"collect stage of {preset} (bench overlap)",
                caption=f"served shapes reward, {delay * 1000:.0f} ms per call; medians of {iterations} iterations")
    write_csv(out / "overlap.csv", rows, COLUMNS)
    _plot(rows, out / "overlap.png", delay)
    data = {"preset": preset, "overrides": list(overrides), "delay_s": delay, "iterations": iterations, "rows": rows}
    write_json(json_path, data)
    return data


def _plot(rows: list[dict], path, delay: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.8))
    names = [r["setting"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["collect_s"] for r in rows], 0.4, label="collect (measured)")
    ax.bar([i + 0.2 for i in x], [r["bound_s"] for r in rows], 0.4, label="bound", alpha=0.6)
    ax.plot(list(x), [r["sample_s"] for r in rows], "k_", markersize=30, label="sampling alone")
    ax.set_xticks(list(x), names, rotation=15, fontsize=8)
    ax.set_ylabel("seconds per iteration")
    ax.set_title(f"Collect stage with a served reward ({delay * 1000:.0f} ms per call)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--delay", type=float, default=0.2)
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--waves", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--preset", default="shapes-nft")
    a = ap.parse_args(argv)
    run_bench_overlap(a.json, a.out, a.delay, a.iterations, tuple(a.waves), a.concurrency, a.preset)


if __name__ == "__main__":
    main()
