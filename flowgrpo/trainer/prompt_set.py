"""``model.precompute_prompts``: the run's whole prompt set, encoded once before training.

A training run encodes prompts from three places: the ``data.prompts`` file (every iteration draws
from it), the held-out evaluator's prompts (before, during and after training, and the monitors'
velocity measurement, which reuses them) and the empty prompt (classifier-free guidance, DiffusionNFT's
self-guidance). :func:`run_prompts` lists them; :func:`precompute_run_prompts` hands them to the
policy's :meth:`~flowgrpo.policies.diffusers.switches.SwitchedPolicy.precompute_prompts`, which keeps
the encodings in CPU memory and frees the text encoders.

The set must be known before the first rollout, so a procedural source (``data.prompts=shapes``, which
draws fresh prompts every iteration without end) is refused with a one-line ConfigError rather than
encoded lazily: a lazy cache would keep the text encoders, which is what ``model.offload_text_encoders``
already does (the encoders on the CPU, an LRU cache of encodings). Prompts that other parts bring at
update time (an offline Diffusion-DPO pair file) are not in the set; such a prompt stops the run with
an error naming it.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..evaluation import build_evaluator


def evaluator_prompts(evaluator) -> list[str] | None:
    """The prompts an evaluator draws: its ``rows``' prompts (the bench and edit evaluators, read from
    prompt files) or its ``prompts`` (text, or objects with a ``prompt``: UniGenBench); None when it
    lists neither (its prompts are not known ahead)."""
    rows = getattr(evaluator, "rows", None)
    if rows is not None:
        return [r["prompt"] for r in rows]
    prompts = getattr(evaluator, "prompts", None)
    if isinstance(prompts, list):
        return [p if isinstance(p, str) else p.prompt for p in prompts]
    return None


def run_prompts(cfg, prompts, policy) -> list[str]:
    """Every prompt a run of ``cfg`` encodes, in first-seen order: the prompt source's rows, then the
    evaluator's prompts (the empty prompt is the policy's to add). ConfigError naming the reason where
    the set is not finite or not known ahead."""
    rows = getattr(prompts, "rows", None)
    if rows is None:
        raise ConfigError(f"model.precompute_prompts=true needs a finite prompt set, and data.prompts="
                          f"{cfg.data.prompts!r} draws fresh prompts every iteration: use a .txt / .jsonl prompt "
                          "file, or model.offload_text_encoders=true (encoders on the CPU, encodings cached)")
    out = [r["prompt"] for r in rows]
    evaluator, _ = build_evaluator(cfg.eval, policy, cfg.sampler.shift)
    if evaluator is not None:
        held = evaluator_prompts(evaluator)
        if held is None:
            raise ConfigError(f"model.precompute_prompts=true cannot list the prompts of eval.evaluator="
                              f"{cfg.eval.evaluator} ahead of the run: set eval.evaluator=none, or use "
                              "model.offload_text_encoders=true")
        out += held
    return list(dict.fromkeys(out))


def precompute_run_prompts(cfg, prompts, policy, is_main: bool = True) -> None:
    """Encode the run's prompts into ``policy`` and free its text encoders (see the module docstring);
    ConfigError for a policy that cannot (no text encoders, an edit model, not a diffusers adapter)."""
    if not callable(getattr(policy, "precompute_prompts", None)):
        raise ConfigError(f"model.precompute_prompts=true applies to diffusers models with text encoders; "
                          f"{type(policy).__name__} has none to free")
    texts = run_prompts(cfg, prompts, policy)
    stored, freed = policy.precompute_prompts(texts)
    if is_main:
        print(f"model.precompute_prompts: {len({*texts, ''})} prompts encoded ({stored / 2**20:.1f} MiB in CPU "
              f"memory); text encoders freed ({freed / 2**20:.1f} MiB)")
