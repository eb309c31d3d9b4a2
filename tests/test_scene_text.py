"""The shapes model's structured conditioning (flowgrpo/shapes/scene_text.py) and its pretraining command.

What the old word-level encoder could not do, checked on the encoder itself (random weights: the
property is structural, training cannot create it if the architecture erases it): swapped prompts
condition differently, the empty prompt is its own layout, held-out prompts are made of parts seen in
training, and the pretraining command runs, resumes and records what it did."""

from __future__ import annotations

import json

import pytest
import torch

from flowgrpo.shapes.model import ShapesFlowModel, ShapesModelConfig
from flowgrpo.shapes.probe import order_swap, pair_sensitivity, swap_pairs
from flowgrpo.shapes.prompts import heldout_specs, split_specs
from flowgrpo.shapes.scene_text import SceneTokenizer, SceneVocabularyError, VocabularyError
from flowgrpo.shapes.world import TAGS


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return ShapesFlowModel(ShapesModelConfig(num_layers=1, text_encoder="scene")).eval()


def _labels(model):
    return lambda prompt, _length: model.token_labels(prompt)


def test_swapped_prompts_condition_differently(model):
    """Order swaps of position prompts ("A rel B" / "B rel A"), order swaps of "and" prompts and colour
    swaps: pooled vectors and role-matched token states all differ (the old encoder: cosine 0.9995)."""
    specs = list(dict.fromkeys(heldout_specs(64) + list(split_specs("position")[1]) + list(split_specs("color_attr")[1])))
    kinds = swap_pairs(specs)
    assert all(len(v) >= 8 for v in kinds.values())
    for kind, pairs in kinds.items():
        rows = pair_sensitivity(model.encode, [(a.prompt, b.prompt) for a, b in pairs[:32]], _labels(model))
        assert max(r["pooled_cos"] for r in rows) < 0.99, kind
        assert max(r["token_cos_min"] for r in rows) < 0.99, kind
        assert min(r["token_change"] for r in rows) > 0.05, kind


def test_bag_of_words_pooling_would_fail_this_test(model):
    """The mean of the slot states (what the old encoder pooled) is identical for an order swap of an
    "and" prompt before the encoder mixes the slots: only role and order-keeping pooling separate them."""
    tok = SceneTokenizer()
    a, b = "a red circle and a blue square", "a blue square and a red circle"
    ia, ib = tok([a]), tok([b])
    assert sorted(map(tuple, ia[0, :2, 1:].tolist())) == sorted(map(tuple, ib[0, :2, 1:].tolist()))  # same groups
    assert not torch.equal(ia, ib)  # in other roles
    with torch.no_grad():
        (_, pa), (_, pb) = model.encode([a]), model.encode([b])
    assert torch.nn.functional.cosine_similarity(pa, pb).item() < 0.99


def test_empty_prompt_is_the_null_layout_and_differs_from_every_prompt(model):
    ids = SceneTokenizer()([""])
    assert ids.shape == (1, 3, 5) and int(ids.abs().sum()) == 0
    prompts = [s.prompt for t in TAGS for s in split_specs(t)[0][:3]]
    with torch.no_grad():
        _, p = model.encode(["", *prompts])
    cos = torch.nn.functional.cosine_similarity(p[:1], p[1:])
    assert cos.max().item() < 0.99


def test_unknown_words_are_one_clear_error():
    with pytest.raises(VocabularyError, match=r"\[.hexagon.\].*valid words:"):
        SceneTokenizer()(["a red hexagon"])
    with pytest.raises(SceneVocabularyError, match="shapes grammar"):
        SceneTokenizer()(["red blue green"])


def test_heldout_prompts_are_made_of_parts_seen_in_training():
    """The count is a field of its own: every held-out counting prompt's count and its (colour, shape)
    occur in training captions, and every held-out two-group prompt's groups occur in training in the
    same role, so held-out prompts are recombinations, not new words."""
    train = [s for t in TAGS for s in split_specs(t)[0]]
    counts = {o.count for s in train for o in s.objects}
    nouns = {(o.color, o.shape) for s in train for o in s.objects}
    roles = {(i, o) for s in train if len(s.objects) == 2 for i, o in enumerate(s.objects)}
    for tag in TAGS:
        for spec in split_specs(tag)[1]:
            for i, o in enumerate(spec.objects):
                assert o.count in counts and (o.color, o.shape) in nouns, spec.prompt
                if len(spec.objects) == 2:
                    assert (i, o) in roles, spec.prompt


def test_order_swapped_position_prompts_have_different_field_ids():
    tok = SceneTokenizer()
    for spec in split_specs("position")[1][:20]:
        assert not torch.equal(tok([spec.prompt]), tok([order_swap(spec).prompt]))


def test_each_group_token_carries_the_relation_from_its_own_side():
    """"A left of B": the subject slot says "left of", the object slot "right of", and the order swap
    "B left of A" gives B the subject's side, so which cells a group goes to is one field of its own
    token; prompts without a relation leave the field empty, and ``group_relation=False`` (the first
    scene weights) leaves it empty everywhere."""
    from flowgrpo.shapes.scene_text import RELATION_FIELD
    from flowgrpo.shapes.world import FLIPPED, RELATIONS

    tok = SceneTokenizer()
    for spec in [s for s in split_specs("position")[0] if s.relation in RELATIONS][:24]:
        ids = tok([spec.prompt])[0]
        assert RELATION_FIELD[int(ids[0, 4])] == spec.relation
        assert RELATION_FIELD[int(ids[1, 4])] == FLIPPED[spec.relation]
        assert RELATION_FIELD[int(ids[2, 4])] == spec.relation  # the relation token itself
        swapped = tok([order_swap(spec).prompt])[0]
        assert torch.equal(swapped[0, 1:4], ids[1, 1:4]) and RELATION_FIELD[int(swapped[0, 4])] == spec.relation
    assert tok(["a red circle and a blue square"])[0, :2, 4].tolist() == [0, 0]
    old = SceneTokenizer(group_relation=False)(["a red circle left of a blue square"])[0]
    assert old[:2, 4].tolist() == [0, 0] and RELATION_FIELD[int(old[2, 4])] == "left of"


def _reload_without_key(model: ShapesFlowModel, folder, key: str) -> ShapesFlowModel:
    """Save ``model``, drop ``key`` from its config.json (as weights written before the key existed) and load."""
    model.save(folder)
    meta = json.loads((folder / "config.json").read_text())
    del meta["config"][key]
    (folder / "config.json").write_text(json.dumps(meta))
    return ShapesFlowModel.load(folder)


def test_scene_weights_without_group_relation_key_load_as_trained(tmp_path):
    """The first scene weights (no ``group_relation`` in config.json) read prompts as they were trained."""
    model = ShapesFlowModel(ShapesModelConfig(num_layers=1))
    assert model.cfg.group_relation is True
    loaded = _reload_without_key(model, tmp_path, "group_relation")
    assert loaded.cfg.group_relation is False and loaded.tokenizer.group_relation is False


def test_grid_position_code_tells_rows_and_columns_apart_where_sd3_sincos_does_not():
    """The grid code: two cells on one row or one column share half their code (cosine 0.5), other
    cells none; SD3's sincos table on the same 4 x 4 grid (the shipped weights' table) gives every
    pair of cells a cosine of 0.79 or more."""
    from flowgrpo.shapes.model import grid_position_code

    code = grid_position_code(4, 128, 8.0)
    assert code.shape == (16, 128) and torch.allclose(code.norm(dim=-1), torch.full((16,), 8.0))
    unit = torch.nn.functional.normalize(code, dim=-1)
    cos = unit @ unit.T
    for i in range(16):
        for j in range(16):
            (ri, ci), (rj, cj) = divmod(i, 4), divmod(j, 4)
            want = 1.0 if i == j else 0.5 if (ri == rj or ci == cj) else 0.0
            assert cos[i, j].item() == pytest.approx(want, abs=1e-6)
    grid = ShapesFlowModel(ShapesModelConfig(num_layers=1, position_code="grid"))
    assert torch.equal(grid.transformer.pos_embed.pos_embed[0], code)  # the model's table is the code
    sincos = ShapesFlowModel(ShapesModelConfig(num_layers=1, position_code="sincos")).transformer.pos_embed.pos_embed[0]
    unit = torch.nn.functional.normalize(sincos, dim=-1)
    assert (unit @ unit.T).min() > 0.79
    with pytest.raises(ValueError, match="position_code must be one of"):
        ShapesModelConfig(position_code="rope")
    with pytest.raises(ValueError, match="divisible by 2 \\* grid = 8"):
        grid_position_code(4, 36, 1.0)


def test_weights_without_position_code_key_load_as_sincos_with_their_own_table(tmp_path):
    """config.json files written before ``position_code`` existed hold SD3's sincos table, which the
    state dict restores (the table is a persistent buffer)."""
    old = ShapesFlowModel(ShapesModelConfig(num_layers=1))
    assert old.cfg.position_code == "sincos"  # the default: what the shipped weights have
    loaded = _reload_without_key(old, tmp_path, "position_code")
    assert loaded.cfg.position_code == "sincos"
    assert torch.equal(loaded.transformer.pos_embed.pos_embed, old.transformer.pos_embed.pos_embed)


def test_weights_without_text_encoder_key_load_as_the_word_encoder(tmp_path):
    """config.json files written before the scene encoder (no ``text_encoder`` key) are word models."""
    loaded = _reload_without_key(ShapesFlowModel(ShapesModelConfig(num_layers=1, text_encoder="words")), tmp_path,
                                 "text_encoder")
    assert loaded.cfg.text_encoder == "words"
    h, _ = loaded.encode(["a red circle"])
    assert h.shape[1] == loaded.cfg.max_tokens
    with pytest.raises(ValueError, match="text_encoder must be one of"):
        ShapesModelConfig(text_encoder="bag")


def test_pretrain_command_runs_resumes_and_records_its_settings(tmp_path):
    from flowgrpo.shapes import pretrain

    args = ["--out", str(tmp_path), "--batch", "4", "--eval-every", "2", "--eval-prompts", "6", "--threads", "1",
            "--layers", "1", "--heads", "2", "--head-dim", "16", "--text-dim", "32", "--warmup", "1",
            "--sigma-shift", "3", "--caption-noise", "counting=0.3", "--position-code", "grid", "--lead-prob", "0.5", "--cell-offset-bias", "--caption-dropout", "0.2"]
    pretrain.main([*args, "--steps", "2"])
    log = [json.loads(line) for line in (tmp_path / "pretrain_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2] and 0.0 <= log[0]["accuracy_cfg1"] <= 1.0
    pretrain.main([*args, "--steps", "4"])  # same --out: resumes at step 2
    log = [json.loads(line) for line in (tmp_path / "pretrain_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4]
    recorded = json.loads((tmp_path / "pretrain_args.json").read_text())
    assert recorded["args"]["sigma_shift"] == 3.0 and recorded["caption_noise"]["counting"] == 0.3
    model = ShapesFlowModel.load(tmp_path / "snapshots" / "final")
    assert model.cfg.text_encoder == "scene" and model.cfg.num_layers == 1 and model.cfg.text_dim == 32
    assert model.cfg.position_code == "grid" and recorded["args"]["position_code"] == "grid" and model.cfg.cell_offset_bias
    assert recorded["args"]["caption_dropout"] == 0.2
    assert recorded["args"]["lead_prob"] == 0.5 and "lead_rng" in torch.load(tmp_path / "state.pt", weights_only=False)


def test_pretrain_device_choices(tmp_path, monkeypatch):
    from flowgrpo.shapes import pretrain

    assert pretrain.resolve_device("cpu") == torch.device("cpu")
    assert pretrain.resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(SystemExit, match="valid choices are auto, cpu, cuda, cuda:N"):
        pretrain.resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: no CUDA device here"):
        pretrain.main(["--out", str(tmp_path), "--steps", "1", "--device", "cuda"])
    assert not (tmp_path / "state.pt").exists()  # refused before any training state is written


def test_pretrain_starts_from_other_weights(tmp_path):
    from safetensors.torch import load_file

    from flowgrpo.shapes import pretrain

    tiny = ["--batch", "4", "--eval-every", "100", "--eval-prompts", "2", "--threads", "1", "--layers", "1", "--heads", "2",
            "--head-dim", "16", "--text-dim", "32", "--warmup", "1", "--device", "cpu"]
    pretrain.main(["--out", str(tmp_path / "a"), "--steps", "1", *tiny])
    src = tmp_path / "a" / "snapshots" / "final"
    a = load_file(str(src / "model.safetensors"))
    pretrain.main(["--out", str(tmp_path / "m"), "--steps", "0", "--seed", "5", "--init-model", str(src), *tiny])
    pretrain.main(["--out", str(tmp_path / "t"), "--steps", "0", "--seed", "5", "--init-transformer", str(src), *tiny])
    m = load_file(str(tmp_path / "m" / "snapshots" / "final" / "model.safetensors"))
    t = load_file(str(tmp_path / "t" / "snapshots" / "final" / "model.safetensors"))
    assert all(torch.equal(a[k], m[k]) for k in a)  # every weight, the text encoder's too
    assert all(torch.equal(a[k], t[k]) for k in a if k.startswith("transformer."))
    assert not all(torch.equal(a[k], t[k]) for k in a if k.startswith("text_encoder."))  # fresh text side
    with pytest.raises(SystemExit, match="give one of --init-transformer"):
        pretrain.main(["--out", str(tmp_path / "x"), "--init-model", str(src), "--init-transformer", str(src), *tiny])
    with pytest.raises(SystemExit, match="--init-model .*do not fit"):
        pretrain.main(["--out", str(tmp_path / "y"), "--init-model", str(src), "--cell-offset-bias", *tiny])


def test_base_recipe_runs_its_stages_in_order_and_skips_finished_ones(tmp_path, monkeypatch, capsys):
    """The shipped base's two-stage recipe, with the real stage arguments and one step each: stage 2 starts
    from stage 1's final snapshot, and a rerun trains nothing again."""
    import dataclasses

    from flowgrpo.shapes import base_recipe

    monkeypatch.setattr(base_recipe, "STAGES", tuple(dataclasses.replace(s, steps=1) for s in base_recipe.STAGES))
    final = base_recipe.main(["--out", str(tmp_path), "--threads", "1", "--device", "cpu", "--seed", "3"])
    assert final == tmp_path / "stage2" / "snapshots" / "final"
    first = json.loads((tmp_path / "stage1" / "pretrain_args.json").read_text())
    second = json.loads((tmp_path / "stage2" / "pretrain_args.json").read_text())
    assert first["caption_noise"]["position"] == 0.0 and first["args"]["batch"] == 512
    assert {t for t, w in first["tag_weights"].items() if w > 0} == {"position"}  # stage 1: position only
    assert second["args"]["init_model"] == str(tmp_path / "stage1" / "snapshots" / "final")
    assert second["caption_noise"]["position"] == 0.2 and second["tag_weights"]["position"] == 3.0  # the defaults
    assert ShapesFlowModel.load(final).cfg.cell_offset_bias and first["args"]["seed"] == second["args"]["seed"] == 3
    assert base_recipe.finished(tmp_path / "stage1", 1) and not base_recipe.finished(tmp_path / "stage1", 2)
    before = (final / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    base_recipe.main(["--out", str(tmp_path), "--threads", "1", "--device", "cpu"])
    assert capsys.readouterr().out.count("already finished") == 2
    assert (final / "model.safetensors").stat().st_mtime_ns == before
    assert len((tmp_path / "stage2" / "pretrain_log.jsonl").read_text().splitlines()) == 1


def test_count_tokens_hold_each_groups_count_alone():
    """With count tokens the count leaves the group token for a token of its own per group; without them
    the layout is the shipped one, and weights without the key load without them."""
    tok, plain = SceneTokenizer(count_tokens=True), SceneTokenizer()
    ids, old = tok(["three red squares", "a red circle left of a blue square"]), plain(["three red squares"])
    assert ids.shape == (2, 5, 5) and old.shape == (1, 3, 5)
    count = 1  # the field index of the count
    assert ids[0, 0, count] == 0 and old[0, 0, count] != 0  # the group token lost its count ...
    assert ids[0, 3, count] == old[0, 0, count] and ids[0, 3, 2:].eq(0).all()  # ... to a token holding only it
    assert ids[0, 4].eq(ids[0, 1]).all()  # no object group: its count slot is the empty one too
    assert ids[1, 3, count] == ids[1, 4, count] != 0 and ids[1, 3, 0] != ids[1, 4, 0]  # two groups, two roles
    assert torch.equal(ids[:, :3, 2:], torch.cat([old, plain(["a red circle left of a blue square"])])[:, :, 2:])
    assert SceneTokenizer.labels("two blue circles", count_tokens=True) == [
        "<group>", "<none>", "<relation>", "<count>", "<none>"]
    assert tok([""]).eq(0).all()


def test_count_token_model_encodes_five_tokens_and_old_weights_load_without_them(tmp_path):
    model = ShapesFlowModel(ShapesModelConfig(num_layers=1, count_tokens=True)).eval()
    hidden, pooled = model.encode(["two blue circles", "three blue circles", ""])
    assert hidden.shape == (3, 5, model.cfg.text_dim) and pooled.shape == (3, model.cfg.text_dim)
    assert not torch.allclose(hidden[0, 3], hidden[1, 3])  # the count token tells two from three
    loaded = _reload_without_key(ShapesFlowModel(ShapesModelConfig(num_layers=1)), tmp_path, "count_tokens")
    assert loaded.cfg.count_tokens is False and loaded.encode(["two blue circles"])[0].shape[1] == 3
    with pytest.raises(ValueError, match="count_tokens needs the scene text encoder"):
        ShapesModelConfig(text_encoder="words", count_tokens=True)


def test_pretrain_adopts_weights_without_count_tokens(tmp_path):
    """``--count-tokens --init-model`` of weights without them: every weight of the same shape is copied, the
    grown role table keeps the old rows, and the pooled map's new columns start at zero, so a prompt's pooled
    vector is a function of the old three tokens' new states only."""
    from safetensors.torch import load_file

    from flowgrpo.shapes import pretrain

    tiny = ["--batch", "4", "--eval-every", "100", "--eval-prompts", "2", "--threads", "1", "--layers", "1",
            "--heads", "2", "--head-dim", "16", "--text-dim", "32", "--warmup", "1", "--device", "cpu"]
    pretrain.main(["--out", str(tmp_path / "a"), "--steps", "1", *tiny])
    src = tmp_path / "a" / "snapshots" / "final"
    pretrain.main(["--out", str(tmp_path / "c"), "--steps", "0", "--count-tokens", "--init-model", str(src), *tiny])
    a = load_file(str(src / "model.safetensors"))
    c = load_file(str(tmp_path / "c" / "snapshots" / "final" / "model.safetensors"))
    assert ShapesFlowModel.load(tmp_path / "c" / "snapshots" / "final").cfg.count_tokens
    roles, pool = "text_encoder.fields.0.weight", "text_encoder.pool.weight"
    assert c[roles].shape[0] == a[roles].shape[0] + 2 and torch.equal(c[roles][: a[roles].shape[0]], a[roles])
    dim = a[pool].shape[0]
    assert torch.equal(c[pool][:, : 3 * dim], a[pool]) and c[pool][:, 3 * dim:].eq(0).all()
    assert all(torch.equal(a[k], c[k]) for k in a if k not in (roles, pool))
