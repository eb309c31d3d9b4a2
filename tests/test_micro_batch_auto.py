"""``sampler.max_micro_batch: auto`` (flowgrpo.realsize.micro_batch): the rollout micro-batch chosen from
computed memory. The arithmetic is checked against the budget it reads (the chosen size fits, one more
does not), the run's own count against a recount of the forward at the chosen size, and the config
path end to end on the tiny SD3."""

from __future__ import annotations

import dataclasses

import pytest

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError
from flowgrpo.realsize.budget import HEADROOM, LAYOUTS, MemoryInputs, per_gpu_budget
from flowgrpo.realsize.micro_batch import fit_rollout_micro_batch

GIB = 2**30


def _inputs(**kw) -> MemoryInputs:
    base = dict(transformer_bytes=20 * GIB, largest_block_bytes=2**28, trainable_params=100_000_000, trainable_bytes=4,
                full_finetune=False, reference_copy=False, reference_on_cpu=False, ema=True, ema_on_cpu=False,
                text_encoder_bytes=9 * GIB, text_encoders="resident", vae_bytes=2**27, update_activations=3 * GIB,
                backward_transient=2**26, rollout_peak=16 * GIB, rollout_micro_batch=64, vae_decode_peak=2**31,
                sample_bytes=2**22, prompt_bytes=2**20, samples=64, prompts=8)
    return MemoryInputs(**{**base, **kw})


def _rollout_bytes(x: MemoryInputs, layout, micro: int) -> int:
    """The rollout phase of ``x`` run at ``micro`` samples per forward (the peak scaled linearly)."""
    scaled = dataclasses.replace(x, rollout_peak=x.rollout_peak * micro // x.rollout_micro_batch,
                                 rollout_micro_batch=micro)
    return per_gpu_budget(scaled, layout)["phases"]["rollout"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("device_gib", [40, 48, 64, 80])
def test_the_chosen_size_fits_and_one_more_does_not(layout, device_gib):
    x = _inputs()
    fit = fit_rollout_micro_batch(x, layout, device_gib * GIB)
    limit = device_gib * GIB * (1 - HEADROOM)
    per_process = -(-x.samples // layout.gpus)
    assert fit.cap == per_process and 1 <= fit.micro_batch <= per_process
    if fit.limited_by == "memory":
        assert _rollout_bytes(x, layout, fit.micro_batch) <= limit < _rollout_bytes(x, layout, fit.micro_batch + 1)
        assert fit.micro_batch < per_process
    else:
        assert fit.limited_by == "samples" and fit.micro_batch == per_process
        assert _rollout_bytes(x, layout, per_process) <= limit


def test_a_bigger_device_never_gets_a_smaller_batch_and_a_full_one_gets_one_with_a_warning():
    x = _inputs()
    sizes = [fit_rollout_micro_batch(x, LAYOUTS[0], gib * GIB).micro_batch for gib in range(30, 120, 4)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1] == x.samples
    tight = fit_rollout_micro_batch(x, LAYOUTS[0], 20 * GIB)  # the weights alone are over 29 GiB
    assert tight.micro_batch == 1 and tight.limited_by == "memory" and tight.room_bytes < 0
    assert "not even one sample" in tight.line() and "\n" not in tight.line()
    roomy = fit_rollout_micro_batch(x, LAYOUTS[0], 141 * GIB)
    assert roomy.line().startswith("sampler.max_micro_batch=auto -> 64 (every sample")


def test_the_key_takes_a_number_or_auto_and_names_both_on_a_bad_value():
    assert load_config(overrides=["sampler.max_micro_batch=auto"]).sampler.max_micro_batch == "auto"
    assert load_config(overrides=["sampler.max_micro_batch=3"]).sampler.max_micro_batch == 3
    with pytest.raises(ConfigError, match=r"^config key 'sampler.max_micro_batch' expects int or one of: auto, "
                                          r"got str 'most'$"):
        load_config(overrides=["sampler.max_micro_batch=most"])
    with pytest.raises(ConfigError, match=r"'sampler.max_micro_batch' must be >= 1, got 0"):
        load_config(overrides=["sampler.max_micro_batch=0"])


# ------------------------------------------------------------------------------- on the tiny SD3's own count
@pytest.fixture(scope="module")
def auto_trainer():
    from flowgrpo.trainer.trainer import Trainer

    cfg = load_config("flow-grpo", overrides=["model.name=sd3-tiny", "model.train_mode=lora", "model.guidance_scale=4.5",
                                              "model.dtype=bfloat16", "reward.weights={jpeg_compressibility: 1.0}",
                                              "data.prompts_per_iteration=2", "data.trees_per_prompt=4",
                                              "sampler.num_steps=2", "eval.evaluator=none", "sampler.max_micro_batch=auto"])
    return Trainer(cfg)


def test_off_cuda_auto_is_every_sample_of_a_process_in_one_call(auto_trainer):
    fit = auto_trainer.micro_batch_fit
    assert fit.limited_by == "no device" and fit.room_bytes is None
    assert auto_trainer.sampler.max_micro_batch == fit.micro_batch == 8
    assert "no device memory counted" in fit.line()


def test_a_device_that_holds_a_few_samples_gets_a_size_whose_recounted_forward_fits(auto_trainer):
    from flowgrpo.realsize.forecast import rollout_peak_at, run_inputs, run_layout
    from flowgrpo.realsize.micro_batch import choose_rollout_micro_batch

    x, note = run_inputs(auto_trainer, micro=8)
    assert note == "" and x.rollout_peak > 0 and x.rollout_micro_batch == 8
    layout = run_layout(auto_trainer)
    base = per_gpu_budget(dataclasses.replace(x, rollout_peak=0), layout)["phases"]["rollout"]
    one = rollout_peak_at(auto_trainer.policy, auto_trainer.cfg, 1)
    assert 0 < one < x.rollout_peak
    # a device with room for about three samples' forwards beside the run's weights and trajectory
    device = int((base + 3.5 * one) / (1 - HEADROOM))
    fit = choose_rollout_micro_batch(auto_trainer, device_bytes=device)
    assert fit.limited_by == "memory" and 1 <= fit.micro_batch < 8
    assert rollout_peak_at(auto_trainer.policy, auto_trainer.cfg, fit.micro_batch) <= fit.room_bytes
    bigger = choose_rollout_micro_batch(auto_trainer, device_bytes=10 * device)
    assert bigger.micro_batch >= fit.micro_batch
    roomy = choose_rollout_micro_batch(auto_trainer, device_bytes=100 * GIB)
    assert roomy.limited_by == "samples" and roomy.micro_batch == 8


def test_a_forward_with_a_fixed_part_is_recounted_down_to_a_size_that_fits(auto_trainer, monkeypatch):
    """A forward's fixed part (e.g. a timestep embedding's buffers) is amortised over the counted batch,
    so the linear guess overshoots at a smaller one: the recount steps down until it fits."""
    from flowgrpo.realsize import forecast
    from flowgrpo.realsize.micro_batch import choose_rollout_micro_batch

    fixed, per = 6 * GIB, GIB
    x = _inputs(samples=64, rollout_peak=fixed + 64 * per, rollout_micro_batch=64)
    monkeypatch.setattr(forecast, "run_inputs", lambda trainer, working=True, micro=None: (x, ""))
    monkeypatch.setattr(forecast, "rollout_peak_at", lambda policy, cfg, m: fixed + m * per)
    monkeypatch.setattr(forecast, "run_layout", lambda trainer: LAYOUTS[0])
    device = 60 * GIB
    linear = fit_rollout_micro_batch(x, LAYOUTS[0], device)
    fit = choose_rollout_micro_batch(auto_trainer, device_bytes=device)
    assert fit.limited_by == "memory" and fit.micro_batch < linear.micro_batch
    assert fixed + fit.micro_batch * per <= fit.room_bytes < fixed + (fit.micro_batch + 1) * per
