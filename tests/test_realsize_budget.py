"""Issue 46 item 2: every module a recipe loads is counted, the phases and layouts lay them out as the
trainer holds them, and a run prints the figure it needs with a warning when the device lacks it."""

import dataclasses
import inspect

import pytest
import torch

from flowgrpo.realsize import budget as budget_mod
from flowgrpo.realsize.budget import LAYOUTS, MemoryInputs, first_fit, per_gpu_budget
from flowgrpo.realsize.components import REAL_COMPONENTS, build_component, component_bytes, recipe_components
from flowgrpo.realsize.configs import REAL_TRANSFORMERS, recipe_names


def test_t5_xxl_encoder_count_equals_its_config_derived_layer_sizes():
    """T5 v1.1 XXL's encoder from its config numbers alone: embedding, per layer 4 attention
    projections of d x (heads x d_kv), gated FF (wi_0, wi_1: d x d_ff, wo: d_ff x d), 2 RMS norms;
    the first layer's relative-position bias (buckets x heads) and the final norm."""
    part = next(p for p in REAL_COMPONENTS["FluxPipeline"] if p.name == "text_encoder_2")
    c = part.config
    d, inner, ff, layers = c["d_model"], c["num_heads"] * c["d_kv"], c["d_ff"], c["num_layers"]
    expected = c["vocab_size"] * d + layers * (4 * d * inner + 3 * d * ff + 2 * d) + 32 * c["num_heads"] + d
    model = build_component(part)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == expected == 4_762_310_656
    counted = component_bytes("flux1-dev")["text_encoder_2"]
    assert counted["params"] == expected and counted["bytes"] == 2 * expected  # bf16
    assert counted["bytes"] / 1e9 == pytest.approx(9.52, abs=0.01)  # "T5-XXL alone is 9.5 GB in bf16"


def _module_components(pipeline: str) -> set[str]:
    """The pipeline class's ``__init__`` arguments annotated with a module class, optional ones left out."""
    cls = getattr(__import__("diffusers"), pipeline)
    names = set()
    for name, param in inspect.signature(cls.__init__).parameters.items():
        ann = param.annotation
        if inspect.isclass(ann) and issubclass(ann, torch.nn.Module) and name not in cls._optional_components:
            names.add(name)
    return names


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_module_component_of_the_pipeline_is_counted(recipe):
    entry = REAL_TRANSFORMERS[recipe]
    counted = {p.name for p in recipe_components(recipe)} | set(entry.experts)
    required = _module_components(entry.pipeline)
    assert required, entry.pipeline
    assert required <= counted, f"{recipe}: {sorted(required - counted)} not counted"
    assert any(p.is_text_encoder for p in recipe_components(recipe)) and "vae" in counted


def test_published_sizes_of_the_big_text_encoders():
    """Parameter totals the model cards state, from the config numbers: Qwen2.5-VL-7B 8.29 B, Qwen3-4B
    4.02 B, Mistral-Small-3.1 24.0 B, UMT5-XXL's encoder 5.68 B."""
    sizes = {r: component_bytes(r)["text_encoder"]["params"] / 1e9
             for r in ("qwen-image", "z-image", "flux2-dev", "wan21-t2v-1.3b")}
    assert sizes["qwen-image"] == pytest.approx(8.29, abs=0.01)
    assert sizes["z-image"] == pytest.approx(4.02, abs=0.01)
    assert sizes["flux2-dev"] == pytest.approx(24.0, abs=0.05)
    assert sizes["wan21-t2v-1.3b"] == pytest.approx(5.68, abs=0.01)


def _inputs(**kw) -> MemoryInputs:
    base = dict(transformer_bytes=20 * 2**30, largest_block_bytes=2**28, trainable_params=100_000_000, trainable_bytes=4,
                full_finetune=False, reference_copy=False, reference_on_cpu=False, ema=True, ema_on_cpu=False,
                text_encoder_bytes=9 * 2**30, text_encoders="resident", vae_bytes=2**27, update_activations=3 * 2**30,
                backward_transient=2**26, rollout_peak=2**30, rollout_micro_batch=16, vae_decode_peak=2**31,
                sample_bytes=2**22, prompt_bytes=2**20, samples=64, prompts=8)
    return MemoryInputs(**{**base, **kw})


def test_ddp_row_differs_from_one_gpu_by_the_gradient_sum_and_the_shared_trajectory():
    x = _inputs()
    one, ddp = per_gpu_budget(x, LAYOUTS[0]), per_gpu_budget(x, LAYOUTS[1])
    assert one["ddp_sum"] == 0 and ddp["ddp_sum"] == 8 * x.trainable_params  # flat float32 sum + reduce's clone
    assert ddp["trajectory"] == 8 * 2**22 + 2**20 and one["trajectory"] == 64 * 2**22 + 8 * 2**20
    assert ddp["phases"]["step"] - one["phases"]["step"] == ddp["ddp_sum"] - (one["trajectory"] - ddp["trajectory"])
    assert ddp["phases"]["update"] - one["phases"]["update"] == ddp["trajectory"] - one["trajectory"]


def test_fsdp_offload_row_below_fsdp_below_replicated():
    x = _inputs()
    totals = [per_gpu_budget(x, layout)["total"] for layout in LAYOUTS[1:]]
    assert totals[0] > totals[1] > totals[2]
    fsdp, off = per_gpu_budget(x, LAYOUTS[2]), per_gpu_budget(x, LAYOUTS[3])
    assert fsdp["transformer"] == -(-x.transformer_bytes // 8) + 2 * x.largest_block_bytes
    assert off["transformer"] == 2 * x.largest_block_bytes and off["adamw"] == off["gradients"] == off["ema"] == 0


def test_switches_move_exactly_their_bytes_off_the_gpu():
    resident = per_gpu_budget(_inputs(), LAYOUTS[0])
    for mode in ("visiting", "precomputed"):
        off = per_gpu_budget(_inputs(text_encoders=mode), LAYOUTS[0])
        assert resident["phases"]["update"] - off["phases"]["update"] == 9 * 2**30
        # they still visit to encode; precomputed: once, before AdamW's moments exist, with whole
        # weights parked in host memory meanwhile (LoRA included: it lives in the transformer)
        parked = resident["adamw"] + resident["transformer"] + resident["lora_weights"] if mode == "precomputed" else 0
        assert resident["phases"]["encode"] - off["phases"]["encode"] == parked
    # FSDP shards are not parked: only the moments are missing at the encode
    sharded = per_gpu_budget(_inputs(), LAYOUTS[2])
    sharded_pre = per_gpu_budget(_inputs(text_encoders="precomputed"), LAYOUTS[2])
    assert sharded["phases"]["encode"] - sharded_pre["phases"]["encode"] == sharded["adamw"]
    full = dict(full_finetune=True, trainable_params=10 * 2**30, trainable_bytes=2, reference_copy=True)
    on_gpu = per_gpu_budget(_inputs(**full), LAYOUTS[0])
    cpu = per_gpu_budget(_inputs(**full, reference_on_cpu=True, ema_on_cpu=True), LAYOUTS[0])
    assert on_gpu["reference"] == 20 * 2**30 and cpu["reference"] == 2**28  # one streamed block
    assert on_gpu["ema"] == 20 * 2**30 and cpu["ema"] == 0 and on_gpu["lora_weights"] == 0
    assert on_gpu["total"] - cpu["total"] == 40 * 2**30 - 2**28


def test_lagging_copies_are_whole_weight_copies_under_full_fine_tuning_and_leave_with_old_policy_device_cpu():
    full = dict(full_finetune=True, trainable_params=10 * 2**30, trainable_bytes=2, update_activations=2**30)
    none = per_gpu_budget(_inputs(**full), LAYOUTS[0])
    two = per_gpu_budget(_inputs(**full, lagging_copies=2), LAYOUTS[0])
    assert two["old_policy"] == 2 * 20 * 2**30 and none["old_policy"] == 0
    assert two["phases"]["rollout"] - none["phases"]["rollout"] == 40 * 2**30
    # the update holds the live weights' stash while a copy runs (20 GiB) or, later, the activations and
    # backward's buffers (1 GiB + 64 MiB): the larger, not both
    assert two["phases"]["update"] - none["phases"]["update"] == 40 * 2**30 + 20 * 2**30 - (2**30 + 2**26)
    cpu = per_gpu_budget(_inputs(**full, lagging_copies=2, lagging_on_cpu=True), LAYOUTS[0])
    assert cpu["old_policy"] == 0 and cpu["phases"] == none["phases"]
    sharded = per_gpu_budget(_inputs(**full, lagging_copies=1), LAYOUTS[2])  # FSDP shards the copy
    assert sharded["old_policy"] == -(-20 * 2**30 // 8)


def test_the_objectives_name_their_lagging_copies():
    from flowgrpo.config import load_config
    from flowgrpo.realsize.recipe_budget import objective_copies

    def copies(*overrides):
        return objective_copies(load_config("shapes", overrides=list(overrides)))[1]

    assert copies("loss.objective=grpo") == 0 and copies("loss.objective=nft") == 1
    assert copies("loss.objective=awm", "loss.awm.ema_kl_beta=0") == 1
    assert copies("loss.objective=awm", "loss.awm.ema_kl_beta=0.1") == 2 and copies("loss.objective=crd") == 2


def test_first_fit_takes_the_first_layout_under_the_headroom():
    budgets = {"a": {"total": 80 * 10**9}, "b": {"total": int(72 * 10**9)}, "c": {"total": 10}}
    assert first_fit(budgets, 80) == "b" and first_fit(budgets, 24) == "c"
    assert first_fit({"a": {"total": 10**12}}, 24) is None and budget_mod.HEADROOM == 0.10


def test_no_grad_peak_of_an_mlp_on_meta():
    """x [B, 1024] -> Linear 4096 -> ReLU -> Linear 1024, float32: the largest live set is the hidden
    [B, 4096] and the ReLU's output beside it; weights and the input are not counted."""
    from flowgrpo.realsize.peaks import no_grad_peak

    b = 32
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to("meta")
    x = torch.empty(b, 1024, device="meta")
    assert no_grad_peak(lambda: mlp(x), [mlp], x) == 2 * b * 4096 * 4


def test_recipe_row_counts_every_module_and_names_fitting_layouts():
    from flowgrpo.realsize.table import markdown_table, memory_row

    row = memory_row("wan21-t2v-1.3b", gpus=8, resolution=128, frames=5, micro_batch=1)
    assert set(row["budget"]) == {layout.name for layout in LAYOUTS}
    one = row["budget"]["1 GPU"]
    assert one["text_encoders"] == row["components"]["text_encoder"]["bytes"] > 10 * 2**30  # UMT5-XXL
    assert one["vae"] == row["components"]["vae"]["bytes"] > 0 and one["rollout_peak"] > 0 < one["vae_decode_peak"]
    ddp = row["budget"]["8 GPUs DDP"]
    assert ddp["phases"]["step"] - one["phases"]["step"] == ddp["ddp_sum"] - (one["trajectory"] - ddp["trajectory"])
    assert ddp["ddp_sum"] == 8 * row["lora_params"] > 0 and row["fits_80"] == "1 GPU"
    md = markdown_table([row])
    assert "| 8 GPUs FSDP+offload |" in md and "fits 24 GB" in md


# ---------------------------------------------------------------------------- the line at the start of a run
@pytest.fixture(scope="module")
def tiny_trainer():
    from flowgrpo.config import load_config
    from flowgrpo.trainer.trainer import Trainer

    cfg = load_config("flow-grpo", overrides=["model.name=sd3-tiny", "model.train_mode=lora", "model.guidance_scale=4.5",
                                              "reward.weights={jpeg_compressibility: 1.0}", "data.prompts_per_iteration=2",
                                              "data.trees_per_prompt=2", "sampler.num_steps=3", "eval.evaluator=none"])
    return Trainer(cfg)


def test_run_figure_counts_the_loaded_modules(tiny_trainer):
    from flowgrpo.realsize.forecast import run_inputs

    policy = tiny_trainer.policy
    x, note = run_inputs(tiny_trainer)
    assert note == "" and x.update_activations > 0 and x.rollout_peak > 0 and x.vae_decode_peak > 0
    encoders = sum(t.numel() * t.element_size() for m in policy.text_encoders() for t in (*m.parameters(), *m.buffers()))
    assert x.text_encoder_bytes == encoders > 0
    assert x.trainable_params == sum(p.numel() for p in policy.trainable_parameters()) and x.trainable_bytes == 4
    lora = sum(p.numel() * p.element_size() for p in policy.trainable_parameters())
    weights = sum(t.numel() * t.element_size() for t in (*policy.denoiser.parameters(), *policy.denoiser.buffers()))
    assert x.transformer_bytes == weights - lora
    bare, _ = run_inputs(tiny_trainer, working=False)
    assert dataclasses.replace(bare, update_activations=x.update_activations, backward_transient=x.backward_transient,
                               rollout_peak=x.rollout_peak, vae_decode_peak=x.vae_decode_peak) == x


def test_run_line_warns_when_the_device_lacks_the_memory(tiny_trainer, monkeypatch, capsys):
    from flowgrpo.realsize import forecast

    line, fits = forecast.memory_line(tiny_trainer)  # CPU: no device memory to check
    assert fits and line.startswith("memory: needs ~") and "not checked" in line and "\n" not in line
    monkeypatch.setattr(forecast, "free_device_memory", lambda device: (2**20, 80 * 2**30))
    line, fits = forecast.memory_line(tiny_trainer)
    assert not fits and line.startswith("warning: memory: this run needs ~") and "0.0 GiB free" in line
    assert forecast.DOC in line and "\n" not in line
    monkeypatch.setattr(forecast, "free_device_memory", lambda device: (80 * 2**30, 80 * 2**30))
    line, fits = forecast.memory_line(tiny_trainer)
    assert fits and "device has 80.0 GiB free" in line and not line.startswith("warning")
    forecast.print_memory_forecast(tiny_trainer)
    assert capsys.readouterr().out.count("\n") == 1


def test_a_rollout_peak_that_cannot_run_on_meta_is_fitted_on_the_cpu_and_matches_a_direct_count():
    """HunyuanVideo 1.5 asks whether its image embeddings are all zero (no meta run): its rollout peak
    is the quadratic through three one-block CPU forwards (its [B, L, L] attention mask is the square
    term); here against direct counts of a narrow copy at larger sizes and at depth 3."""
    from flowgrpo.realsize.activations import Geometry, example_inputs
    from flowgrpo.realsize.configs import build_transformer, transformer_config
    from flowgrpo.realsize.peaks import _tensor_bytes, no_grad_peak, rollout_forward_peak

    real = transformer_config("hunyuanvideo15")
    narrow = dataclasses.replace(real, config={
        **real.config, "num_attention_heads": 2, "attention_head_dim": 32, "text_embed_dim": 64, "text_embed_2_dim": 32,
        "image_embed_dim": 32, "rope_axes_dim": [8, 12, 12], "num_refiner_layers": 1})

    def direct(geo, layers: int) -> int:
        model = build_transformer(narrow, device="cpu", dtype=torch.float32, num_layers=layers).eval()
        inputs, _ = example_inputs(narrow, geo, device="cpu", dtype=torch.float32)
        return no_grad_peak(lambda: model(**inputs, return_dict=False), [model], inputs) + _tensor_bytes(inputs)

    meta = build_transformer(narrow, dtype=torch.float32)  # the caller's meta copy: not run
    for side in (16, 28):
        geo = Geometry(side * 16, 5, 32, 2)
        fitted = rollout_forward_peak(meta, narrow, geo, torch.float32)
        assert fitted == pytest.approx(direct(geo, 3), rel=2e-3)
