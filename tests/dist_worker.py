"""Run N iterations of a tiny trainer and save what the data-parallel tests compare.

Started by ``accelerate launch`` (several processes) or directly (one process) from
tests/test_multiprocess.py: ``python dist_worker.py OUT_DIR ITERATIONS key=value ...``. Every rank
writes OUT_DIR/rank{r}.pt with the whole iteration's advantages, its trainable weights before and after
each iteration, the metrics and the plan steps of its own training rows.
"""

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import conftest  # noqa: E402,F401  (registers the test rewards)
import torch  # noqa: E402

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.trainer.launch import close_process_group  # noqa: E402
from flowgrpo.trainer.trainer import Trainer  # noqa: E402


def _offload_policy(module) -> str | None:
    """The class name of FSDP2's offload policy on ``module`` (``OffloadPolicy`` or ``CPUOffloadPolicy``), or
    None where it is not sharded."""
    state = getattr(module, "_get_fsdp_state", None)
    group = getattr(state(), "_fsdp_param_group", None) if state else None
    return type(group.offload_policy).__name__ if group is not None else None


def main() -> None:
    out, iterations, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    trainer = Trainer(load_config("shapes", None, overrides))
    record = {"world": trainer.dp.world, "engine": trainer.engine.name, "leaf_advantages": [], "edge_advantages": [],
              "weights": [], "metrics": [], "local_trees": [],
              # elements of the trainable weights this rank holds (all of them unless sharded)
              "local_numel": sum(getattr(p, "_local_tensor", p).numel() for p in trainer.policy.trainable_parameters()),
              "numel": sum(p.numel() for p in trainer.policy.trainable_parameters()),
              # the offload policy FSDP2 holds for the denoiser (sharded runs; None elsewhere)
              "offload": _offload_policy(trainer.policy.denoiser),
              "param_devices": sorted({getattr(p, "_local_tensor", p).device.type
                                       for p in trainer.policy.trainable_parameters()})}
    idle, run_idle = [0], trainer._idle_pass  # count the lock-step padding passes (sharded runs)

    def counted_idle_pass(cond):
        idle[0] += 1
        run_idle(cond)

    trainer._idle_pass = counted_idle_pass
    row_steps, rows_of = [], trainer.objective.rows  # the plan steps of this rank's rows, per iteration

    def recorded_rows(ctx):
        rows = rows_of(ctx)
        row_steps.append([] if rows is None else sorted(set(rows.step.tolist())))
        return rows

    trainer.objective.rows = recorded_rows
    record["initial"] = trainer.state_dict()["trainable"]
    for _ in range(iterations):
        res = trainer.iteration_step()
        record["leaf_advantages"].append(res.advantages.leaf_advantages.clone())
        record["edge_advantages"].append([None if a is None else a.clone() for a in res.advantages.edge_advantages])
        record["weights"].append(trainer.state_dict()["trainable"])  # whole tensors on every rank
        record["metrics"].append(res.metrics)
        record["local_trees"].append(res.rollout.levels[0].tree.cpu().tolist())
    record["ema"] = trainer.engine.full(trainer.ema)
    record["idle_passes"] = idle[0]
    record["row_steps"] = row_steps
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"rank{trainer.dp.rank}.pt")
    close_process_group()  # as `flowgrpo train` does: no rank leaves with gloo's threads still running


if __name__ == "__main__":
    faulthandler.enable()  # a crash prints every thread's Python stack in the test's output
    main()
