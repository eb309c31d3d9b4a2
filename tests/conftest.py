"""Shared fixtures: one CPU thread, no hub, a random-init shapes model, test rewards, a tiny policy.

The shipped shapes-world weights are not needed by any test: a randomly initialised
``ShapesFlowModel`` is saved once per session and passed as ``model.path``.
"""

from __future__ import annotations

import importlib.util
import os

# Before torch is imported anywhere: tiny models on a shared 2-core CPU run far faster on one
# thread, and subprocesses (the CLI tests) inherit these.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from flowgrpo.policies.base import Policy  # noqa: E402
from flowgrpo.rewards import REWARDS, RewardOutput  # noqa: E402

#: skip a test where DeepSpeed is not installed (it is in the test extras; `pip install 'flowgrpo[deepspeed]'`)
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="DeepSpeed is not installed (pip install 'flowgrpo[deepspeed]')")


# --------------------------------------------------------------------------- test rewards
# Registered once per session (the registry refuses duplicate names).

BRIGHTNESS = "test_brightness"
NAN_EVERY_THIRD = "test_nan_every_third"
CONSTANT = "test_constant"


def _brightness(images):
    return images.float().flatten(1).mean(1)


if BRIGHTNESS not in REWARDS:

    @REWARDS.register(BRIGHTNESS)
    class BrightnessReward:
        """Mean pixel value: a continuous reward, so every group carries signal."""

        name = BRIGHTNESS

        def __call__(self, images, prompts, groups=None):
            return RewardOutput(_brightness(images))


if NAN_EVERY_THIRD not in REWARDS:

    @REWARDS.register(NAN_EVERY_THIRD)
    class NanEveryThirdReward:
        """Brightness, but NaN for every third sample (indices 0, 3, 6, ...): a failing scorer."""

        name = NAN_EVERY_THIRD

        def __call__(self, images, prompts, groups=None):
            r = _brightness(images).clone()
            r[::3] = float("nan")
            return RewardOutput(r)


if CONSTANT not in REWARDS:

    @REWARDS.register(CONSTANT)
    class ConstantReward:
        """Always 1: every group has zero std, so nothing carries signal."""

        name = CONSTANT

        def __call__(self, images, prompts, groups=None):
            return RewardOutput(torch.ones(images.shape[0]))


# --------------------------------------------------------------------------- shapes model


@pytest.fixture(scope="session")
def shapes_model_dir(tmp_path_factory) -> Path:
    """A random-init ShapesFlowModel saved to a temp dir (seed 0); pass as ``model.path``."""
    from flowgrpo.shapes.model import ShapesFlowModel

    d = tmp_path_factory.mktemp("shapes_random")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ShapesFlowModel().save(d)
    return d


def tiny_overrides(model_dir, **extra) -> list[str]:
    """Overrides for a run that takes seconds: 2 prompts x 4 samples, 4 steps, tiny eval."""
    base = {
        "model.path": str(model_dir),
        "data.prompts_per_iteration": 2,
        "data.trees_per_prompt": 4,
        "sampler.num_steps": 4,
        "eval.num_prompts": 4,
        "eval.seeds_per_prompt": 1,
        "eval.num_steps": 4,
        "log.progress": "false",
        "log.trackers": "[tensorboard]",
        "train.iterations": 2,
        "train.threads": 1,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_config(shapes_model_dir):
    """Factory: ``tiny_config(**{"train.lr": 1e-3})`` -> validated RunConfig on the random model."""
    from flowgrpo.config import load_config

    def make(**extra):
        return load_config("shapes", None, tiny_overrides(shapes_model_dir, **extra))

    return make


# --------------------------------------------------------------------------- experiment scripts

EXPERIMENTS = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"


def load_experiment(relpath: str):
    """The module of the script ``benchmarks/experiments/<relpath>`` (scripts there are not a package)."""
    spec = importlib.util.spec_from_file_location(Path(relpath).stem, EXPERIMENTS / relpath)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- CLI helpers


def flowgrpo_command() -> list[str]:
    """The installed ``flowgrpo`` console script next to this interpreter (else ``python -m flowgrpo.cli``)."""
    script = Path(sys.executable).parent / "flowgrpo"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "flowgrpo.cli"]


def cli_env() -> dict:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg",
               PYTHONUNBUFFERED="1")
    return env


def run_cli(args: list[str], cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(flowgrpo_command() + list(args), cwd=cwd, env=cli_env(), capture_output=True,
                          text=True, timeout=timeout)


# A complete CLI training run shared by the end-to-end test (test_cli) and as the uninterrupted
# baseline of the resume test (test_resume). The reward mixes the verifiable shapes reward with a
# little JPEG compressibility so every group has signal (a random model rarely satisfies a prompt)
# and every iteration really updates the weights.
RUN_ITERATIONS = 6
RUN_EXTRA = {
    "train.iterations": RUN_ITERATIONS,
    "log.checkpoint_every": 1,
    "reward.weights": "{shapes: 1.0, jpeg_compressibility: 0.01}",
    "train.lr": "1e-3",
}


@pytest.fixture(scope="session")
def cli_run_dir(tmp_path_factory, shapes_model_dir) -> Path:
    """RUN_DIR of an uninterrupted ``flowgrpo train --preset shapes`` (GRPO, whose ratio diagnostics
    the run-directory tests read) of RUN_ITERATIONS iterations."""
    out = tmp_path_factory.mktemp("cli_runs")
    args = ["train", "--preset", "shapes", *tiny_overrides(shapes_model_dir, **RUN_EXTRA), f"log.out_dir={out}", "log.run_name=full"]
    proc = run_cli(args)
    assert proc.returncode == 0, f"flowgrpo train failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return out / "full"


# --------------------------------------------------------------------------- a tiny analytic policy


class TinyPolicy(Policy):
    """A cheap policy for sampler tests: v = tanh(W x) + prompt bias + sigma (4 x 4 x 4 latents).

    Counts its model calls (``calls``) and the rows of each call (``rows``).
    """

    latent_shape = (4, 4, 4)

    def __init__(self, seed: int = 0):
        super().__init__(guidance_scale=1.0)
        g = torch.Generator().manual_seed(seed)
        d = 4 * 4 * 4
        self.weight = torch.nn.Parameter(torch.randn(d, d, generator=g) / d**0.5)
        self.calls = 0
        self.rows: list[int] = []

    def _encode(self, prompts):
        vals = [float(sum(map(ord, p)) % 97) / 97.0 for p in prompts]
        return {"bias": torch.tensor(vals, dtype=torch.float32)}

    def _forward(self, x, sigma, enc):
        self.calls += 1
        self.rows.append(x.shape[0])
        h = torch.tanh(x.flatten(1) @ self.weight.T).view_as(x)
        return h + enc["bias"].view(-1, 1, 1, 1) + sigma.view(-1, 1, 1, 1)

    def decode(self, latents):
        return ((latents[:, :3].float() + 1) / 2).clamp(0, 1)

    def trainable_parameters(self):
        return [self.weight]

    def adapter_disabled(self):
        import contextlib

        return contextlib.nullcontext()


@pytest.fixture
def tiny_policy() -> TinyPolicy:
    return TinyPolicy()


# --------------------------------------------------------------------------- tiny adapters over shared modules

_TINY_COMPONENTS: dict = {}


def tiny_components(build) -> dict:
    """Fresh copies of ``build(0)``'s tiny modules (a ``tiny_*_components`` builder), built once per
    builder, so every policy made from them starts from the same random weights."""
    import copy

    if build not in _TINY_COMPONENTS:
        _TINY_COMPONENTS[build] = build(0)
    return {k: copy.deepcopy(v) if isinstance(v, torch.nn.Module) else v for k, v in _TINY_COMPONENTS[build].items()}


def fresh_tiny_policy(cls, build, **options):
    """An adapter ``cls`` over :func:`tiny_components` of ``build`` (``cls.from_components(..., **options)``)."""
    return cls.from_components(tiny_components(build), **options)


# --------------------------------------------------------------------------- a trained tiny SD3 LoRA run


def train_tiny_sd3_lora_run(root: Path, prompts: list[str], *, seq: int, steps: int, guidance: float,
                            extra: tuple[str, ...] = ()):
    """(base pipeline dir, run dir, prompt file, config): a 2-iteration tiny SD3 LoRA run (rank 4, lr
    3e-2 and EMA 0.5 so the weights visibly move, a checkpoint per iteration) on ``prompts``, in ``root``."""
    from flowgrpo.config import load_config
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline
    from flowgrpo.trainer.run import train

    base = root / "base"
    tiny_sd3_pipeline(seed=0).save_pretrained(base)
    prompt_file = root / "prompts.txt"
    prompt_file.write_text("\n".join(prompts) + "\n")
    cfg = load_config("shapes", None, [
        "model.name=sd3", f"model.path={base}", "model.train_mode=lora", "model.resolution=64",
        f"model.max_sequence_length={seq}", "model.lora_rank=4", "model.lora_alpha=8", f"model.guidance_scale={guidance}",
        "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompt_file}", "data.prompts_per_iteration=2",
        "data.trees_per_prompt=2", f"sampler.num_steps={steps}", "sampler.strategy=flow_grpo", "train.iterations=2",
        "train.threads=1", "train.lr=3e-2", "train.ema_decay=0.5", "log.progress=false", "log.trackers=[]",
        "log.checkpoint_every=1", f"log.out_dir={root}", "log.run_name=run", *extra,
    ], recipe="shapes")
    train(cfg)
    return base, root / "run", prompt_file, cfg
