"""How much of the machine a run got: its iterations' CPU-seconds per wall-second (:func:`cores_used`,
from the ``cpu_s`` and ``iter_s`` of each ``metrics.jsonl`` line; ``flowgrpo compare``'s ``cores``
column), and the note a run on the CPU clock prints when it shared its cores. Both per-iteration
figures are timings (``*_s``): they differ between runs of the same seed, and nothing else depends on
them.

Why a CPU-clocked run needs it: ``train.clock=cpu`` gives each run its budget in its own CPU time, so
that runs sharing a machine get the same budget. That holds only while each process keeps a core to
itself. Processes time-sliced on one core spend more CPU time on the same work, most likely by evicting
each other's caches: on the 2-core VM this project is measured on, one forward pass of the shapes model
took 0.072 CPU-seconds alone and 0.122 beside two other one-thread training runs (1.7x). A budget of
CPU minutes then buys fewer iterations, and recipes compared that way are compared unfairly.
"""

from __future__ import annotations

#: below this share of the cores a run asked for, a CPU-clocked run says that it shared them
SHARED_BELOW = 0.85


def cores_used(records: list[dict]) -> float | None:
    """CPU-seconds of the process per wall-second over a run's iterations (1.0: one core kept busy; 0.5:
    half of one): the sum of ``cpu_s`` over the sum of ``iter_s``, on the ``metrics.jsonl`` lines that
    have both (a run resumed from one written before ``cpu_s`` existed); None without any."""
    both = [(r["cpu_s"], r["iter_s"]) for r in records
            if isinstance(r.get("cpu_s"), (int, float)) and isinstance(r.get("iter_s"), (int, float))]
    wall = sum(w for _, w in both)
    return sum(c for c, _ in both) / wall if wall > 0 else None


def shared_core_note(clock: str, threads: int, used: float | None) -> str | None:
    """The note for a run on ``train.clock=cpu`` that used under :data:`SHARED_BELOW` of the ``threads``
    cores it asked for (``train.threads``; 0, torch's default, is not judged), else None."""
    if clock != "cpu" or used is None or threads < 1 or used >= SHARED_BELOW * threads:
        return None
    return (f"note: this run used {used:.2f} of the {threads} core(s) it asked for (train.threads={threads}); "
            "processes sharing a core spend more CPU time on the same work, so its train.clock=cpu budget "
            "bought fewer iterations than on a machine with a core per run (compare iteration counts, or "
            "run at most one single-thread run per core)")
