"""Switches that move things off the GPU (issue 46 item 2), each equal to the plain path on the CPU in float32.

* ``model.precompute_prompts``: the run's prompts encoded once into CPU memory and the text encoders
  freed (their parameters on the meta device); the velocities of the tiny SD3, FLUX and Wan, and a
  one-iteration sd3-tiny update (metrics and LoRA weights), equal the plain path's; a prompt outside the
  set, a procedural prompt source and an edit model are refused in one line;
* ``model.reference_device=cpu``: full fine-tuning's frozen reference copy in CPU memory, its
  transformer blocks streamed per forward; the reference velocities and a one-iteration full
  fine-tune with the KL term equal the resident copy's;
* ``train.ema_device=cpu``: the EMA in CPU memory; the same EMA after an iteration, and through a
  checkpoint round trip.

On this machine the device is the CPU, so "moving" is a copy between CPU tensors: the tests check
that the stored weights are never what a forward reads (the streamed copy makes fresh tensors per
call), and the memory those switches save on a GPU is not measured here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from flowgrpo.config import load_config
from flowgrpo.errors import ConfigError, UserError
from flowgrpo.policies.diffusers.flux import FluxPolicy
from flowgrpo.policies.diffusers.sd3 import SD3Policy
from flowgrpo.policies.diffusers.wan import WanPolicy
from flowgrpo.policies.base.streamed import block_list_entries
from flowgrpo.policies.tiny.flux import tiny_flux_components
from flowgrpo.policies.tiny.sd3 import tiny_sd3_components
from flowgrpo.policies.tiny.wan import tiny_wan_components
from flowgrpo.trainer.trainer import Trainer
from conftest import fresh_tiny_policy, tiny_overrides
from test_engine_levers import PROMPTS, TIMING, perturb_lora, write_prompts
from test_engine_levers import assert_same_iteration as same_iteration

MODELS = {  # adapter, component builder, policy options (guidance on: the empty prompt is encoded too)
    "SD3": (SD3Policy, tiny_sd3_components, dict(resolution=64, max_sequence_length=16, guidance_scale=2.0)),
    "FLUX": (FluxPolicy, tiny_flux_components, dict(resolution=32, max_sequence_length=16, guidance_scale=3.5)),
    "Wan": (WanPolicy, tiny_wan_components, dict(resolution=32, num_frames=5, max_sequence_length=16,
                                                 guidance_scale=4.0)),
}


def make(model: str, **options):
    """A fresh LoRA policy over copies of the model's tiny modules."""
    cls, build, defaults = MODELS[model]
    return fresh_tiny_policy(cls, build, lora_rank=4, lora_alpha=8.0, **{**defaults, **options})


def velocity(policy, prompts=PROMPTS):
    x = torch.randn(len(prompts), *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return policy.velocity(x, torch.tensor([0.7, 0.3][:len(prompts)]), policy.encode_prompts(prompts))


# --------------------------------------------------------------------------------- precompute_prompts


@pytest.mark.parametrize("model", ["SD3", "FLUX", "Wan"])
def test_precomputed_prompts_give_the_plain_velocities_and_free_the_encoders(model):
    plain, pre = make(model), make(model)
    encoders = pre.text_encoders()
    weights = sum(p.numel() for m in encoders for p in m.parameters())
    stored, freed = pre.precompute_prompts([*PROMPTS, "an unused prompt", PROMPTS[0]])
    assert weights > 0 and freed >= 4 * weights and stored > 0  # float32 weights (and buffers) freed
    assert all(p.is_meta for m in encoders for p in (*m.parameters(), *m.buffers()))
    assert set(pre._precomputed) == {"", *PROMPTS, "an unused prompt"}  # the empty prompt always
    assert all(t.device.type == "cpu" for row in pre._precomputed.values() for t in row.values())
    v0, v1 = velocity(plain), velocity(pre)
    # equal up to float32 rounding: the encoders ran on batches of other sizes (CLIP's pooled projection
    # differs by an ulp or two between a batch of 2 and one of 4)
    print(f"{model} precompute_prompts velocity max |diff| {(v1 - v0).abs().max().item():.3g}")
    torch.testing.assert_close(v1, v0, rtol=1e-6, atol=1e-6)
    pre.to("cpu").float()  # moves and casts pass the freed encoders by
    with pytest.raises(UserError, match=r"prompt 'a dog' was not encoded before training: model.precompute_prompts"):
        pre.encode_prompts(["a dog"])
    with pytest.raises(RuntimeError, match="ran already"):
        pre.precompute_prompts(PROMPTS)


@pytest.mark.parametrize("model", ["SD3", "Wan"])
def test_the_transformer_waits_in_host_memory_while_the_prompts_are_encoded(model, monkeypatch):
    """On CUDA (forced here: parks_on is True for the CPU) the transformer is moved to host memory
    before the first encode and back after the last, in place (the same Parameter objects, which the
    optimizer holds), and put back even when an encode fails; the encodings are made on its device."""
    from flowgrpo.policies.diffusers import parking

    monkeypatch.setattr(parking, "parks_on", lambda device: True)
    plain, pre = make(model), make(model)
    params = [id(p) for p in pre.transformer.parameters()]
    events, encode_now, to = [], pre._encode_now, pre.transformer.to

    def spy_to(*args, **kwargs):
        events.append(("to", str(args[0])))
        return to(*args, **kwargs)

    def spy_encode(prompts):
        events.append(("encode", str(pre.device)))
        return encode_now(prompts)

    monkeypatch.setattr(pre.transformer, "to", spy_to, raising=False)
    monkeypatch.setattr(pre, "_encode_now", spy_encode, raising=False)
    pre.precompute_prompts(PROMPTS, batch_size=1)  # three encodes: "", and the two prompts
    assert events == [("to", "cpu"), *[("encode", "cpu")] * 3, ("to", "cpu")]
    assert [id(p) for p in pre.transformer.parameters()] == params and pre._parked_device is None
    torch.testing.assert_close(velocity(pre), velocity(plain), rtol=1e-6, atol=1e-6)

    failing = make(model)
    monkeypatch.setattr(failing, "_encode_now", lambda prompts: (_ for _ in ()).throw(RuntimeError("encoder died")),
                        raising=False)
    moved = []
    monkeypatch.setattr(failing.transformer, "to", lambda *a, **k: moved.append(str(a[0])), raising=False)
    with pytest.raises(RuntimeError, match="encoder died"):
        failing.precompute_prompts(PROMPTS)
    assert moved == ["cpu", "cpu"] and failing._parked_device is None  # back on its device, override cleared
    assert parking.parkable_networks(failing) == [failing.transformer]


def sd3_config(tmp_path, *extra, mode: str = "lora"):
    """A one-iteration flow_grpo run of sd3-tiny (KL on, guidance 4.5) writing under ``tmp_path``. Adam's
    eps is 1e-2: with 1e-8 its first step is lr * sign(g), and a gradient entry near zero flips with float
    rounding (tests/test_multiprocess.py's module docstring), which would hide the comparison."""
    return load_config("shapes", None, [
        "model.name=sd3-tiny", f"model.train_mode={mode}", "model.resolution=64", "model.max_sequence_length=16",
        "model.lora_rank=4", "model.lora_alpha=8", "model.guidance_scale=4.5", "reward.weights={jpeg_compressibility: 1.0}",
        f"data.prompts={write_prompts(tmp_path)}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2",
        "sampler.num_steps=2", "sampler.strategy=flow_grpo", "train.iterations=1", "train.threads=1", "train.lr=1e-3",
        "train.ema_decay=0.5", "train.adam_eps=1e-2", "loss.grpo.kl_beta=0.04", "log.progress=false", "log.trackers=[]", "eval.evaluator=none",
        f"log.out_dir={tmp_path}", *extra,
    ], recipe="shapes")


def one_iteration(cfg):
    """(metrics without timings, trainable weights after, trainer) of one iteration."""
    torch.manual_seed(0)
    trainer = Trainer(cfg)
    if cfg.model.train_mode == "lora":
        perturb_lora(trainer.policy)
    metrics = trainer.iteration_step().metrics
    for k in TIMING:
        metrics.pop(k, None)
    return metrics, trainer.policy.trainable_state_dict(), trainer


def max_differences(a, b) -> tuple[float, float]:
    """(largest |metric difference|, largest |weight difference|)."""
    (m0, w0, _), (m1, w1, _) = a, b
    assert set(m0) == set(m1) and set(w0) == set(w1)
    metric = max((abs(m1[k] - v) for k, v in m0.items() if isinstance(v, float) and not math.isnan(v)), default=0.0)
    return metric, max(float((w1[n] - w).abs().max()) for n, w in w0.items())


def assert_same_iteration(a, b, what: str) -> None:
    """test_engine_levers' check (metrics and weights within 1e-5 relative, 1e-6 absolute), then the
    largest differences printed."""
    same_iteration(a, b, rel=1e-5, atol=1e-6)
    metric, weight = max_differences(a, b)
    print(f"{what}: max |metric difference| {metric:.3g}, max |weight difference| {weight:.3g}")


def test_precompute_prompts_one_iteration_matches_plain(tmp_path):
    plain = one_iteration(sd3_config(tmp_path / "plain"))
    pre = one_iteration(sd3_config(tmp_path / "pre", "model.precompute_prompts=true"))
    policy = pre[2].policy
    assert all(p.is_meta for m in policy.text_encoders() for p in m.parameters())
    assert set(policy._precomputed) == {"", *PROMPTS, "a mountain lake at dawn"}
    assert_same_iteration(plain, pre, "precompute_prompts")


def test_precompute_prompts_refuses_a_procedural_source_in_one_line(tmp_path, capsys):
    from flowgrpo.cli import main

    rc = main(["train", "model.name=sd3-tiny", "model.precompute_prompts=true", "data.prompts=shapes",
               "reward.weights={jpeg_compressibility: 1.0}", "train.iterations=1", "log.progress=false",
               "log.trackers=[]", "eval.evaluator=none", f"log.out_dir={tmp_path}", "log.run_name=run"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "model.precompute_prompts=true needs a finite prompt set, and data.prompts='shapes' draws fresh" in lines[0]
    assert not (tmp_path / "run").exists()


def test_precompute_prompts_refuses_models_it_cannot_serve(tmp_path):
    with pytest.raises(ConfigError, match="model.precompute_prompts=true applies to diffusers models"):
        Trainer(load_config("shapes", None, ["model.precompute_prompts=true", "train.threads=1",
                                             "log.trackers=[]", "log.progress=false"], recipe="shapes"))
    from flowgrpo.trainer.prompt_set import evaluator_prompts

    class Rows:
        rows = [{"prompt": "a"}, {"prompt": "b"}]

    assert evaluator_prompts(Rows()) == ["a", "b"] and evaluator_prompts(object()) is None  # no listed prompts


# --------------------------------------------------------------------------------- reference_device


def test_streamed_reference_gives_the_resident_reference_velocity():
    resident, streamed = make("SD3", train_mode="full"), make("SD3", train_mode="full")
    streamed.set_reference_device("cpu")
    resident.snapshot_reference()
    streamed.snapshot_reference()
    for p in (resident, streamed):  # the trained weights move away from the base, so the reference differs
        with torch.no_grad():
            for w in p.trainable_parameters():
                w.mul_(1.1)
    frozen = streamed._frozen
    blocks = block_list_entries(frozen)
    stored = {id(t): t.data for b in blocks for t in b.parameters()}
    seen = []
    # a pre-hook registered after the streaming one sees what the forward reads
    blocks[0].register_forward_pre_hook(lambda m, a: seen.append([t.data for t in m.parameters()]))
    x = torch.randn(2, *streamed.latent_shape, generator=torch.Generator().manual_seed(0))
    refs = []
    for p in (resident, streamed):
        with torch.no_grad():
            refs.append(p.reference_velocity(x, torch.tensor([0.7, 0.3]), p.encode_prompts(PROMPTS)))
    assert torch.equal(refs[0], refs[1])  # the same float tensors, only copied
    assert not torch.equal(refs[1], velocity(streamed))  # and not the trained weights' velocity
    # inside a forward the block reads fresh copies; outside it holds the stored (CPU) tensors again
    assert seen and all(s.data_ptr() != stored[id(t)].data_ptr() for s, t in zip(seen[0], blocks[0].parameters()))
    assert all(t.data_ptr() == stored[id(t)].data_ptr() for b in blocks for t in b.parameters())
    assert not any(t.requires_grad for t in frozen.parameters())
    with pytest.raises(ConfigError, match="model.reference_device=cpu applies to model.train_mode=full"):
        make("SD3").set_reference_device("cpu")


def test_reference_and_ema_on_the_cpu_match_a_full_fine_tune(tmp_path):
    # two minibatches: the second one's KL is non-zero (the first runs at the reference weights)
    plain = one_iteration(sd3_config(tmp_path / "plain", "train.minibatches=2", mode="full"))
    off = one_iteration(sd3_config(tmp_path / "off", "train.minibatches=2", "model.reference_device=cpu",
                                   "train.ema_device=cpu", mode="full"))
    trainer = off[2]
    assert trainer.policy._frozen is not None and plain[2].policy._frozen is not None
    assert all(t.device.type == "cpu" for t in trainer.ema.values())
    assert_same_iteration(plain, off, "reference_device=cpu + ema_device=cpu (full)")
    ema_diff = max(float((trainer.ema[n] - e).abs().max()) for n, e in plain[2].ema.items())
    moved = max(float((e - plain[1][n]).abs().max()) for n, e in plain[2].ema.items())
    print(f"EMA max |difference| {ema_diff:.3g} (EMA vs weights {moved:.3g})")
    assert ema_diff <= 1e-6 and moved > 0
    live = trainer.policy.trainable_state_dict()
    with trainer.ema_weights():  # evaluation's swap: the EMA runs, the live weights wait on the CPU
        assert all(torch.equal(t, trainer.ema[n]) for n, t in trainer.policy.trainable_state_dict().items())
    assert all(torch.equal(t, live[n]) for n, t in trainer.policy.trainable_state_dict().items())
    state = trainer.state_dict()  # a checkpoint round trip keeps the EMA on the CPU
    trainer.load_state_dict(state)
    assert all(t.device.type == "cpu" for t in trainer.ema.values())
    assert all(torch.equal(trainer.ema[n], t) for n, t in state["ema"].items())


@pytest.mark.parametrize("objective", ["nft", "awm"])
def test_old_policy_on_the_cpu_matches_a_full_fine_tune(tmp_path, objective):
    """train.old_policy_device=cpu: the lagging copies (NFT's old policy; AWM's rollout weights and EMA
    reference) and the live weights' stash while a copy runs live in host memory; two minibatches, so
    the second one's old-policy velocity is of weights that differ from the live ones."""
    extra = [f"loss.objective={objective}", f"loss.{objective}.timesteps=2", "train.minibatches=2"]
    if objective == "awm":
        extra.append("loss.awm.ema_kl_beta=0.1")
    plain = one_iteration(sd3_config(tmp_path / "plain", *extra, mode="full"))
    off = one_iteration(sd3_config(tmp_path / "off", *extra, "train.old_policy_device=cpu", mode="full"))
    assert off[2].objective.old_home == "cpu" and plain[2].objective.old_home is None
    copies = [c for c in (getattr(off[2].objective, n, None) for n in ("old", "ema")) if c is not None]
    assert len(copies) == off[2].objective.lagging_copies and all(c.home == "cpu" for c in copies)
    assert all(t.device.type == "cpu" for c in copies for t in c.weights.values())
    assert_same_iteration(plain, off, f"old_policy_device=cpu ({objective}, full)")
    state = off[2].objective.state_dict()  # a checkpoint round trip keeps the copies at home
    off[2].objective.load_state_dict(state)
    kept = [c for c in (getattr(off[2].objective, n, None) for n in ("old", "ema")) if c is not None]
    assert kept and all(t.device.type == "cpu" for c in kept for t in c.weights.values())


def test_old_policy_on_the_cpu_is_refused_under_fsdp_in_one_line(tmp_path, monkeypatch):
    import flowgrpo.trainer.accelerator as acc

    class FakeFSDPEngine:
        name = "fsdp"
        lockstep = True

        def prepare(self, policy):
            raise AssertionError("refused before the weights are laid out")

    monkeypatch.setattr(acc, "weight_engine", lambda accelerator, dp: FakeFSDPEngine())
    with pytest.raises(ConfigError, match=r"^train.old_policy_device=cpu keeps whole weights, and FSDP shards them"):
        Trainer(sd3_config(tmp_path, "loss.objective=nft", "train.old_policy_device=cpu", mode="full"))


def test_reference_device_cpu_refused_for_lora(tmp_path):
    with pytest.raises(ConfigError, match="model.reference_device=cpu applies to model.train_mode=full"):
        Trainer(sd3_config(tmp_path, "model.reference_device=cpu"))


# two CLI runs, about 2 minutes on 2 busy cores (CI budget): `pytest -m slow` runs it; the trainer-API test
# above checks the same on the tiny SD3 in the default run
@pytest.mark.slow
def test_flowgrpo_train_full_fine_tune_with_reference_and_ema_on_the_cpu(shapes_model_dir, tmp_path):
    """Two iterations of `flowgrpo train` (Flow-GRPO with its KL on the shapes world, every transformer weight
    trained): with the reference copy and the EMA on the CPU the metrics, raw weights and EMA equal the plain
    run's."""
    from conftest import run_cli
    from flowgrpo.trainer.checkpoint import load_policy_weights

    runs = {}
    for name, extra in (("plain", []), ("on_cpu", ["model.reference_device=cpu", "train.ema_device=cpu"])):
        ov = tiny_overrides(shapes_model_dir, **{"model.train_mode": "full", "loss.grpo.kl_beta": 0.5,
                                                 "train.minibatches": 2, "train.adam_eps": "1e-2", "train.lr": "1e-4",
                                                 "log.trackers": "[]", "eval.evaluator": "none",
                                                 # the CLI knows the built-in rewards: compressibility gives spread
                                                 "reward.weights": "{shapes: 1.0, jpeg_compressibility: 0.01}",
                                                 "log.out_dir": str(tmp_path), "log.run_name": name})
        done = run_cli(["train", "--preset", "flow-grpo", *ov, *extra], timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([{k: v for k, v in r.items() if not (k.endswith("_s") or "seconds" in k)} for r in rows],
                      load_policy_weights(tmp_path / name, prefer_ema=False).weights,
                      load_policy_weights(tmp_path / name, prefer_ema=True).weights)
    (m0, w0, e0), (m1, w1, e1) = runs["plain"], runs["on_cpu"]
    assert len(m0) == len(m1) == 2 and all(r["kl"] > 0 for r in m0[1:])
    for a, b in zip(m0, m1):
        assert set(a) == set(b)
        for k, v in a.items():
            assert b[k] == pytest.approx(v, rel=1e-6, abs=1e-7) if isinstance(v, float) else b[k] == v, k
    worst = max(max(float((w1[n] - w).abs().max()) for n, w in w0.items()),
                max(float((e1[n] - e).abs().max()) for n, e in e0.items()))
    print(f"flowgrpo train, full fine-tune, reference + EMA on the CPU: max |weight or EMA difference| {worst:.3g}")
    assert worst <= 1e-6 and any(not torch.equal(w, e0[n]) for n, w in w0.items())
