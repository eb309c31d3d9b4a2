"""The recipe memory table (bench memory --recipe / --all), its markdown section, the realsize CLI and
the random-weight pipeline folder."""

import json

import pytest

from flowgrpo.realsize import table as table_mod
from flowgrpo.realsize.activations import ActivationCount


@pytest.fixture
def fast_activations(monkeypatch):
    """Activations are tested in test_realsize_memory; here a fixed count keeps the table tests fast."""
    monkeypatch.setattr(table_mod, "activation_bytes",
                        lambda recipe, geo, rank=32: ActivationCount(outside=1, blocks=[2**30] * 3, block_inputs=2**20,
                                                                     image_tokens=64))


def test_row_keys_and_totals(fast_activations):
    row = table_mod.memory_row("wan21-t2v-1.3b", gpus=8, resolution=128, frames=5, micro_batch=1)
    for key in ("transformer_params", "lora_params", "per_gpu", "geometry", "activations", "wrapped_by_block"):
        assert key in row
    assert row["transformer_params"] == 1_418_996_800
    assert row["geometry"]["resolution"] == 128 and row["geometry"]["frames"] == 5
    one = row["per_gpu"]["1 GPU"]
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
    assert row["per_gpu"]["8 GPUs FSDP"]["total"] < one["total"]


def test_markdown_replaces_only_between_markers(tmp_path, fast_activations):
    rows = table_mod.memory_rows(["sd35-medium"], gpus=8)
    md = table_mod.markdown_table(rows)
    assert md.count("| 8 GPUs FSDP |") == 1 and "sd35-medium" in md and "8 GPUs FSDP" in md
    doc = tmp_path / "recipes.md"
    doc.write_text(f"# Recipes\nbefore\n{table_mod.BEGIN}\nold table\n{table_mod.END}\nafter\n")
    assert table_mod.replace_marked(doc, md)
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Recipes\nbefore\n") and text.endswith(f"{table_mod.END}\nafter\n")
    assert table_mod.replace_marked(doc, "| x |\n") and "sd35-medium" not in doc.read_text()
    plain = tmp_path / "plain.md"
    plain.write_text("no markers\n")
    assert not table_mod.replace_marked(plain, md) and plain.read_text() == "no markers\n"


def test_bench_memory_recipe_cli_writes_json(tmp_path, fast_activations, capsys):
    from flowgrpo.cli import main

    out = tmp_path / "mem.json"
    assert main(["bench", "memory", "--recipe", "sd35-medium", "--gpus", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    row = data["rows"][0]
    assert data["gpus"] == 4 and row["recipe"] == "sd35-medium" and row["lora_params"] > 0
    assert set(row["per_gpu"]) == {"1 GPU", "4 GPUs", "4 GPUs FSDP"}
    assert all(isinstance(b["total"], int) for b in row["per_gpu"].values())
    assert "sd35-medium" in capsys.readouterr().out


def test_bench_memory_without_recipe_keeps_the_measured_runs(monkeypatch, tmp_path):
    from flowgrpo.benchmarks import bench_memory

    called = {}
    monkeypatch.setattr(bench_memory, "measure", lambda name, *a, **k: called.setdefault(name, True) and
                        {"run": name, "processes": 1, "peak_rss_mb": 1.0, "peak_cuda_mb": None, "wall_s": 0.1})
    result = bench_memory.run_bench_memory(None, only=["imports-only"], quiet=True, out_dir=tmp_path)
    assert list(called) == ["imports-only"] and result["rows"][0]["run"] == "imports-only"


def test_realsize_lora_layers_cli(capsys):
    from flowgrpo.cli import main

    assert main(["realsize", "lora-layers", "--recipe", "wan21-t2v-1.3b", "--rank", "8"]) == 0
    out = capsys.readouterr().out
    assert "blocks" in out and "300" in out  # 30 blocks x (2 attentions x 4 + 2 feed-forward)


def test_write_pipeline_folder_loads_with_real_widths(tmp_path):
    import torch
    from diffusers import StableDiffusion3Pipeline

    from flowgrpo.realsize.pipeline_folder import write_pipeline

    out = write_pipeline("sd35-medium", tmp_path / "sd35", num_layers=1, pos_embed_max_size=32)
    pipe = StableDiffusion3Pipeline.from_pretrained(str(out), torch_dtype=torch.bfloat16, local_files_only=True)
    t = pipe.transformer.config
    assert (t.attention_head_dim, t.num_attention_heads, t.joint_attention_dim) == (64, 24, 4096)
    assert pipe.text_encoder.config.projection_dim + pipe.text_encoder_2.config.projection_dim == t.pooled_projection_dim
    assert pipe.text_encoder_3.config.d_model == t.joint_attention_dim and pipe.vae.config.latent_channels == 16
    assert pipe.tokenizer.model_max_length == 77
    assert next(pipe.transformer.parameters()).dtype == torch.bfloat16


def test_write_pipeline_covers_every_recipe_and_refuses_others(tmp_path, monkeypatch):
    from flowgrpo.realsize import pipeline_folder
    from flowgrpo.realsize.configs import REAL_TRANSFORMERS

    assert {e.pipeline for e in REAL_TRANSFORMERS.values()} <= set(pipeline_folder.WRITERS)
    monkeypatch.delitem(pipeline_folder.WRITERS, "HunyuanVideo15Pipeline")
    with pytest.raises(ValueError, match="not supported yet"):
        pipeline_folder.write_pipeline("hunyuanvideo15", tmp_path / "h")


def test_realsize_write_pipeline_cli(tmp_path, capsys, monkeypatch):
    import json as _json

    from flowgrpo.cli import main

    out = tmp_path / "wan"
    assert main(["realsize", "write-pipeline", "--recipe", "wan21-t2v-1.3b", "--out", str(out), "--num-layers", "1"]) == 0
    assert "model.name=" in capsys.readouterr().out
    config = _json.loads((out / "transformer" / "config.json").read_text())
    assert (config["num_layers"], config["num_attention_heads"], config["text_dim"]) == (1, 12, 4096)
    assert _json.loads((out / "text_encoder" / "config.json").read_text())["d_model"] == 4096
    from flowgrpo.realsize import pipeline_folder

    monkeypatch.delitem(pipeline_folder.WRITERS, "Flux2Pipeline")
    assert main(["realsize", "write-pipeline", "--recipe", "flux2-dev", "--out", str(tmp_path / "f")]) == 2
