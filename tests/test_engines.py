"""Weight layouts (flowgrpo.trainer.engines) in one process: the choice, and the errors of a bad FSDP
launch. The sharded runs themselves are in tests/test_multiprocess.py (2 gloo processes)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import needs_deepspeed
from flowgrpo.errors import ConfigError
from flowgrpo.trainer.data_parallel import DataParallel
from flowgrpo.trainer.accelerator import weight_engine
from flowgrpo.trainer.engines import FullyShardedWeights, ReplicatedWeights


def _dp(world: int = 2, rank: int = 0) -> DataParallel:
    acc = SimpleNamespace(num_processes=world, process_index=rank, is_main_process=rank == 0,
                          device=torch.device("cpu"), distributed_type="DistributedType.MULTI_CPU",
                          state=SimpleNamespace())
    return DataParallel(acc)


def _plugin(**kw):
    base = {"fsdp_version": 2, "transformer_cls_names_to_wrap": None, "reshard_after_forward": True,
            "cpu_offload": None}
    return SimpleNamespace(**{**base, **kw})


def test_fsdp_is_chosen_only_for_an_fsdp_launch_of_several_processes(monkeypatch):
    dp = _dp()
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert type(weight_engine(dp.accelerator, dp)) is ReplicatedWeights
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    engine = weight_engine(dp.accelerator, dp)
    assert isinstance(engine, FullyShardedWeights) and engine.lockstep
    one = _dp(world=1)
    assert type(weight_engine(one.accelerator, one)) is ReplicatedWeights  # nothing to shard over


def test_sharded_runs_need_trees_that_divide_over_the_processes():
    dp = _dp(world=2, rank=1)
    assert dp.tree_shard(9) == range(4, 9)  # data parallel: shards within one tree of each other
    dp.equal_shards = True
    assert dp.tree_shard(8) == range(4, 8)
    with pytest.raises(ConfigError, match=r"9 trees .*data.prompts_per_iteration x data.trees_per_prompt.* 2 processes"):
        dp.tree_shard(9)


def test_fsdp1_is_refused_with_the_key_to_change():
    with pytest.raises(ConfigError, match="fsdp_version 1 .*fsdp_version: 2"):
        FullyShardedWeights(_dp(), _plugin(fsdp_version=1))


def test_a_wrap_class_the_model_lacks_is_named_with_the_classes_it_has(shapes_model_dir):
    from flowgrpo.shapes.model import ShapesFlowModel
    from flowgrpo.shapes.policy import ShapesPolicy

    policy = ShapesPolicy(ShapesFlowModel.load(shapes_model_dir), train_mode="lora", lora_rank=2)
    engine = FullyShardedWeights(_dp(), _plugin(transformer_cls_names_to_wrap=["FluxTransformerBlock"]))
    with pytest.raises(ConfigError, match=r"FluxTransformerBlock.*fsdp_transformer_layer_cls_to_wrap.*JointTransformerBlock"):
        engine.prepare(policy)
    # by default the wrap unit is the model's own block class (diffusers' _no_split_modules)
    assert policy.denoiser._no_split_modules == ["JointTransformerBlock"]


def test_deepspeed_is_chosen_for_a_deepspeed_launch(monkeypatch):
    from flowgrpo.trainer.deepspeed_zero import ZeroWeights

    dp = _dp()
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
    engine = weight_engine(dp.accelerator, dp)
    assert isinstance(engine, ZeroWeights) and engine.collective_state and not engine.lockstep
    # ZeRO-2 needs a backward pass from every rank in a step, no more: one idle pass only for a rank without rows
    assert engine.idle_passes(torch.tensor([3, 0])) == 0  # rank 0 has rows
    assert ZeroWeights(_dp(rank=1), _ds_plugin()).idle_passes(torch.tensor([3, 0])) == 1


def _ds_plugin(stage: int = 2, **config):
    return SimpleNamespace(zero_stage=stage, deepspeed_config={"zero_optimization": {"stage": stage}, **config})


def test_zero3_is_refused_with_the_fsdp_alternative():
    from flowgrpo.trainer.deepspeed_zero import ZeroWeights

    with pytest.raises(ConfigError, match="zero_stage 3 .*configs/accelerate/fsdp.yaml"):
        ZeroWeights(_dp(), _ds_plugin(stage=3))


@needs_deepspeed
@pytest.mark.parametrize("section, message", [("optimizer", "remove its 'optimizer' section"),
                                              ("bf16", "bf16 is enabled.*model.dtype")])
def test_deepspeed_sections_flowgrpo_owns_are_refused(section, message):
    from flowgrpo.trainer.deepspeed_zero import ZeroWeights

    engine = ZeroWeights(_dp(), _ds_plugin(**{section: {"enabled": True, "type": "AdamW"}}))
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match=message):
        engine.attach_optimizer(torch.optim.AdamW(layer.parameters()), SimpleNamespace(denoiser=layer), 1.0)
