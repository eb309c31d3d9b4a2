"""Every random stream of a training run, derived from ``(train.seed, iteration, salt)``.

An iteration draws its prompts, noise, timestep subsets and minibatch order from generators seeded
by the run's seed, the iteration number and one salt per stream, never from a generator carried
across iterations: an iteration is reproducible on its own, which is what makes ``--resume`` exact
and makes every rank draw the same numbers. The salts are written here once; changing one changes
every run's draws (so a checkpoint resumed across such a change no longer reproduces).
"""

from __future__ import annotations

import numpy as np

#: prompts of an iteration (flowgrpo.data.PromptSource)
PROMPTS = 17
#: the rollout's noise (one draw seeds every tree's stream, flowgrpo.samplers.noise)
ROLLOUT = 11
#: the random subset of trained steps (train.timestep_order=random)
STEP_SUBSET = 29
#: the update: minibatch order, anchor depths, objective draws (flowgrpo.trainer.update_loop)
UPDATE = 31
#: forward-process objectives: timesteps and noise of the training rows (flowgrpo.objectives.forward_rows)
FORWARD_ROWS = 37
#: MixGRPO's random window position, redrawn every ``strategy.shift_every`` iterations from
#: (``strategy.seed``, window period, salt) (flowgrpo.samplers.chains, ``strategy.mode=random``)
MIX_WINDOW = 97


def derive_seed(seed: int, iteration: int, salt: int, *more: int) -> int:
    """A 62-bit seed for stream ``salt`` of ``iteration`` (``more``: e.g. a tree id)."""
    return int(np.random.default_rng([seed, iteration, salt, *more]).integers(2**62))
