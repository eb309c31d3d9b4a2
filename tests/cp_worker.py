"""One iteration of a tiny Wan trainer, saving what the context-parallel tests compare.

Started by ``accelerate launch`` (several processes, ``dist.context_parallel=N`` among the overrides)
or directly (one process) from tests/test_context_parallel.py: ``python cp_worker.py OUT_DIR key=value
...``. Every process writes OUT_DIR/process{i}.pt: the velocities of fixed latents before and after the
iteration (the LoRA is zero at first, so "after" is where the update shows), the rollout's states and
SDE log-probs, the advantages, the trainable weights after the iteration and the metrics.
"""

import faulthandler
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import conftest  # noqa: E402,F401  (registers the test rewards)
import torch  # noqa: E402

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.trainer import context_parallel  # noqa: E402
from flowgrpo.trainer.launch import close_process_group  # noqa: E402
from flowgrpo.trainer.trainer import Trainer  # noqa: E402


def velocities(trainer: Trainer) -> torch.Tensor:
    """v(x, sigma) [2, C, F, h, w] of two fixed latents at sigma 0.9 and 0.4, with guidance (every rank the same inputs)."""
    policy = trainer.policy
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(2, *policy.latent_shape, generator=gen)
    cond = policy.encode_prompts(["a cat walking on a beach", "a red ball rolling"])
    with torch.no_grad():
        return policy.velocity(x, torch.tensor([0.9, 0.4]), cond).float().cpu()


def main() -> None:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    trainer = Trainer(load_config("flow-grpo", None, overrides, recipe="shapes"))
    record = {"processes": trainer.dp.processes, "world": trainer.dp.world, "leader": trainer.dp.is_leader,
              "split": context_parallel.is_enabled(trainer.policy.transformer),
              "velocity_before": velocities(trainer)}
    res = trainer.iteration_step()
    levels = res.rollout.levels
    record.update(states=[lv.x.float().cpu() for lv in levels],
                  log_probs=[None if lv.log_prob is None else lv.log_prob.cpu() for lv in levels],
                  leaf_advantages=res.advantages.leaf_advantages.clone(), metrics=res.metrics,
                  weights=trainer.state_dict()["trainable"], velocity_after=velocities(trainer))
    out.mkdir(parents=True, exist_ok=True)
    torch.save(record, out / f"process{trainer.accelerator.process_index}.pt")
    close_process_group()


if __name__ == "__main__":
    faulthandler.enable()
    main()
