"""Loading a pipeline folder: an incomplete one is named in one line before anything loads; a load through
the generic adapter prints no diffusers FutureWarning, and with log.progress=false no library progress
bar or warning about the adapter's own internal pipeline calls (train and export, run as the CLI)."""

from __future__ import annotations

import shutil

import pytest

from flowgrpo.config import load_config
from flowgrpo.errors import UserError
from flowgrpo.policies.tiny.families import save_tiny_pipeline
from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

from conftest import run_cli

#: what must not reach stderr: diffusers' torch_dtype FutureWarning, loading / denoising bars (tqdm's
#: "| 0/5 [" counters), Qwen-Image's warning about the adapter's own guidance-free probe calls
NOISE = ("torch_dtype", "FutureWarning", "Loading pipeline components", "Loading weights", "it/s]",
         "negative_prompt is passed")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    return save_tiny_pipeline("qwen-image", tmp_path_factory.mktemp("qwen") / "qwen-image")


def _no_load(*args, **kwargs):
    raise AssertionError("a pipeline was loaded although the folder is incomplete")


@pytest.mark.parametrize("component", ["transformer", "vae"])
def test_an_incomplete_pipeline_folder_is_named_before_anything_loads(qwen_dir, tmp_path, monkeypatch, capsys,
                                                                      component):
    import flowgrpo.policies.diffusers.common as common
    import flowgrpo.policies.diffusers.generic.loading as generic
    from flowgrpo.cli import main

    monkeypatch.setattr(common, "load_pipeline", _no_load)
    monkeypatch.setattr(generic, "load_pipeline", _no_load)
    broken = tmp_path / "broken"
    shutil.copytree(qwen_dir, broken)
    shutil.rmtree(broken / component)
    with pytest.raises(UserError) as info:
        load_config(None, None, [f"model.name={broken}"])
    msg = str(info.value)
    assert f"pipeline folder {broken} is incomplete" in msg and f"{component}/ is missing" in msg, msg
    (broken / component).mkdir()  # an empty folder is as good as none
    assert main(["train", f"model.name={broken}", "eval.evaluator=none", f"log.out_dir={tmp_path / 'runs'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"component(s) {component}," in err and str(broken) in err, err
    assert not (tmp_path / "runs").exists()


def test_a_dedicated_adapter_checks_its_model_path_before_loading(tmp_path, monkeypatch):
    import flowgrpo.policies.diffusers.common as common
    from flowgrpo.policies import build_policy

    monkeypatch.setattr(common, "load_pipeline", _no_load)
    base = tmp_path / "sd3"
    tiny_sd3_pipeline(seed=0).save_pretrained(base)
    shutil.rmtree(base / "text_encoder_2")
    cfg = load_config(None, None, ["model.name=sd3", f"model.path={base}"])
    with pytest.raises(UserError, match=r"component\(s\) text_encoder_2, but text_encoder_2/ is missing"):
        build_policy(cfg.model)


def test_train_and_export_through_the_generic_adapter_are_quiet(qwen_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\na mountain lake at dawn\n")
    common = [f"model.name={qwen_dir}", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=32",
              "model.lora_rank=4", "reward.weights={jpeg_compressibility: 1.0}", f"data.prompts={prompts}",
              "data.prompts_per_iteration=2", "data.trees_per_prompt=2", "sampler.num_steps=3", "train.threads=1",
              "log.trackers=[]", f"log.out_dir={tmp_path}", "eval.evaluator=none", "train.iterations=1"]
    train = ["train", "--preset", "flow-grpo", "--recipe", "shapes", *common]
    quiet = run_cli([*train, "log.progress=false", "log.run_name=quiet"])
    assert quiet.returncode == 0, quiet.stderr
    assert not [n for n in NOISE if n in quiet.stderr], quiet.stderr
    fused = run_cli(["export", str(tmp_path / "quiet"), "--to", str(tmp_path / "fused"), "--fuse"])
    assert fused.returncode == 0, fused.stderr
    assert "torch_dtype" not in fused.stderr and "FutureWarning" not in fused.stderr, fused.stderr
    # log.progress=true: the libraries' loading bars are back (the switch decides, not a blanket silence),
    # still without the FutureWarning or the internal calls' warning
    loud = run_cli([*train, "log.progress=true", "log.run_name=loud"])
    assert loud.returncode == 0, loud.stderr
    assert "Loading pipeline components" in loud.stderr
    assert not [n for n in ("torch_dtype", "FutureWarning", "negative_prompt is passed") if n in loud.stderr]


def test_library_bars_follow_the_switch_and_respect_hf_hub_disable(monkeypatch):
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    from flowgrpo.policies.diffusers.common import show_library_progress

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    try:
        show_library_progress(False)
        assert not diffusers_logging.is_progress_bar_enabled() and not transformers_logging.is_progress_bar_enabled()
        show_library_progress(True)
        assert diffusers_logging.is_progress_bar_enabled() and transformers_logging.is_progress_bar_enabled()
        monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # the user's own switch wins over log.progress=true
        show_library_progress(False)
        show_library_progress(True)
        assert not diffusers_logging.is_progress_bar_enabled()
    finally:
        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
        show_library_progress(True)
