"""The counting diagnosis (benchmarks/experiments/counting/counting_split.py): each wrong counting sample
gets exactly one failure mode, read by the verifier from drawn scenes; the per-pool measurement covers
both pools of the counting split and its shares add up."""

from __future__ import annotations

import numpy as np
import pytest

from flowgrpo.shapes.prompts import parse_prompt, split_specs
from flowgrpo.shapes.verify import detect
from flowgrpo.shapes.world import CELL, draw

from conftest import load_experiment


@pytest.fixture(scope="module")
def split():
    return load_experiment("counting/counting_split.py")


CELLS = [(0, 0), (1, 2), (3, 1), (2, 3), (0, 3)]


@pytest.mark.parametrize("glyphs, mode", [
    ([("square", "red")] * 3, "correct"),
    ([("square", "red")] * 2, "too_few"),
    ([("square", "red")] * 4, "too_many"),
    ([("square", "red")] * 3 + [("circle", "red")], "wrong_glyph"),
    ([("square", "red")] * 2 + [("square", "blue")], "wrong_glyph"),
])
def test_each_wrong_sample_has_one_failure_mode(split, glyphs, mode):
    spec = parse_prompt("three red squares")
    img = draw([(s, c, r, col) for (s, c), (r, col) in zip(glyphs, CELLS)])
    assert split.failure(spec, detect(img)) == mode


def test_a_smeared_cell_is_unknown_before_anything_else(split):
    spec = parse_prompt("two blue circles")
    img = draw([("circle", "blue", 0, 0), ("circle", "blue", 1, 1)])
    img[2 * CELL:3 * CELL, 2 * CELL:3 * CELL] = 128  # a grey block matches no glyph template
    assert split.failure(spec, detect(img)) == "unknown"


def test_measure_covers_both_pools_and_its_shares_add_up(split, monkeypatch):
    # a "policy" whose samples are the ground truth for even seeds and an empty canvas for odd ones:
    # every prompt is then right exactly half the time, and every miss is too_few
    import torch

    def fake_generate(policy, prompts, seeds, shift=1.0):
        rng = np.random.default_rng(0)
        from flowgrpo.shapes.world import render
        imgs = [render(parse_prompt(p), rng) if s % 2 == 0 else np.zeros((32, 32, 3), np.uint8)
                for p, s in zip(prompts, seeds)]
        return torch.from_numpy(np.stack(imgs)).permute(0, 3, 1, 2).float() / 255

    monkeypatch.setattr(split, "generate_ode", fake_generate)
    res = split.measure(None, 1.0, seeds=4)
    train, held = split_specs("counting")
    assert (res["train"]["prompts"], res["heldout"]["prompts"]) == (len(train), len(held))
    for pool in ("train", "heldout"):
        r = res[pool]
        assert r["accuracy"] == pytest.approx(0.5)
        assert r["modes"] == pytest.approx({"correct": 0.5, "too_few": 0.5})
        assert set(r["per_count"]) == {"2", "3", "4"}
        assert all(v == pytest.approx(0.5) for v in r["per_prompt"].values())


@pytest.fixture(scope="module")
def directions():
    return load_experiment("counting/count_directions.py")


def test_count_directions_are_one_when_the_count_is_added_apart_and_fall_when_it_is_mixed(directions):
    import torch

    specs = [*split_specs("counting")[0], *split_specs("counting")[1]]
    g = torch.Generator().manual_seed(0)
    count, colour, shape = ({k: torch.randn(16, generator=g) for k in keys} for keys in
                            ((2, 3, 4), ("red", "green", "blue", "yellow", None), ("circle", "square", "triangle")))
    additive = torch.stack([count[s.objects[0].count] + colour[s.objects[0].color] + shape[s.objects[0].shape]
                            for s in specs])
    assert directions.direction_consistency(additive, specs) == pytest.approx(1.0, abs=1e-9)
    mixed = torch.tanh(3 * additive) * torch.stack([colour[s.objects[0].color] for s in specs])
    assert directions.direction_consistency(mixed, specs) < 0.5


def test_plot_draws_every_result_from_the_json_files(split, tmp_path):
    import json

    res = {pool: {"accuracy": 0.9, "per_prompt": {"two red squares": 0.5, "four yellow triangles": 0.25}}
           for pool in ("train", "heldout")}
    files = []
    for name in ("a", "b"):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(res))
    split.main(["--plot", str(tmp_path / "p.png"), *map(str, files)])
    assert (tmp_path / "p.png").stat().st_size > 1000
    with pytest.raises(SystemExit):
        split.main(["--plot", str(tmp_path / "q.png")])  # no result to draw: an argparse error, nothing written
    assert not (tmp_path / "q.png").exists()


def test_colour_free_rl_trains_the_world_with_the_share(monkeypatch, tmp_path):
    """The script hands the trainer the world's prompt source with its share of colour-free counting
    draws (the run's seed kept), and refuses a run that does not draw from the world."""
    import flowgrpo
    from flowgrpo.shapes.prompts import free_counting_specs

    script = load_experiment("counting/colour_free_rl.py")
    got = {}
    monkeypatch.setattr(flowgrpo, "train", lambda trainer: got.setdefault("trainer", trainer) and {})
    script.main(["--share", "1.0", "train.seed=4", f"log.out_dir={tmp_path}"])
    prompts = got["trainer"].prompts
    assert prompts.seed == 4 and prompts.world.free_counting_share == 1.0
    drawn = [parse_prompt(p) for it in range(20) for p in prompts.batch(it, 8)]
    counting = [s for s in drawn if s.tag == "counting"]
    assert counting and all(s in free_counting_specs() for s in counting)
    with pytest.raises(SystemExit, match="data.prompts=shapes"):
        script.main(["--share", "0.5", f"data.prompts={tmp_path / 'p.txt'}"])
