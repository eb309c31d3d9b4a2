"""World presets: the methods tuned on one recipe's world live in ``flowgrpo/presets/worlds/<recipe>/``,
apart from the papers' methods (``flowgrpo/presets/*.yaml``), are listed apart by ``flowgrpo presets``
and resolve exactly as before they moved.

``tests/data/world_presets_before_move.json`` holds what ``flowgrpo train`` resolved (compose_config
and validate, as ``flowgrpo.commands.train``) with no ``--preset``, with ``--preset shapes`` and with
``--preset shapes-nft`` while ``shapes.yaml`` and ``shapes-nft.yaml`` sat among the papers' methods in
``flowgrpo/presets/`` (issue 45 item 2): every value and the layer that set it. A deliberate change to
these presets or the shapes recipe later is a new snapshot, with its reason in the commit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowgrpo.config import (DEFAULT_PRESET, RECIPE_METHOD, compose_config, preset_names, read_preset, recipe_names,
                             to_dict, validate)
from flowgrpo.errors import ConfigError
from flowgrpo.presets import WORLDS, preset_dir, preset_world

BEFORE = json.loads((Path(__file__).parent / "data" / "world_presets_before_move.json").read_text())
PRESETS = Path(__file__).resolve().parent.parent / "flowgrpo" / "presets"


@pytest.mark.parametrize("label", sorted(BEFORE["configs"]))
def test_train_resolves_as_before_the_world_presets_moved(label):
    composed = compose_config(RECIPE_METHOD if label == "default" else label, None, [], None)
    validate(composed.config)
    want = BEFORE["configs"][label]
    assert composed.recipe == want["recipe"]
    assert json.loads(json.dumps(to_dict(composed.config))) == want["config"]
    assert dict(sorted(composed.sources.items())) == want["sources"]


def test_the_default_is_a_world_preset():
    assert DEFAULT_PRESET == "shapes-nft" and preset_world(DEFAULT_PRESET) == "shapes"


def test_world_presets_sit_apart_from_the_papers_methods():
    papers = sorted(p.stem for p in PRESETS.glob("*.yaml"))
    worlds: dict[str, list[str]] = {}
    for p in sorted(PRESETS.glob(f"{WORLDS}/*/*.yaml"), key=lambda p: (p.parent.name, p.stem)):
        worlds.setdefault(p.parent.name, []).append(p.stem)
    assert worlds == {"shapes": ["shapes", "shapes-nft"]}
    assert set(worlds) <= set(recipe_names()), "a world folder is named for the recipe its presets were tuned on"
    assert "shapes" not in papers and "shapes-nft" not in papers
    # one namespace: the papers' methods sorted, then each world's, no name twice
    assert preset_names() == papers + [n for w in sorted(worlds) for n in worlds[w]]
    assert len(set(preset_names())) == len(preset_names())
    assert [preset_world(n) for n in papers] == [None] * len(papers)
    assert all(preset_world(n) == w for w, names in worlds.items() for n in names)
    assert Path(str(preset_dir())) == PRESETS


def test_a_world_preset_reads_and_fails_as_any_preset():
    assert read_preset("shapes-nft")["base"] == "diffusion-nft"
    assert read_preset("shapes")["sampler"] == {"strategy": "mix_grpo"}
    with pytest.raises(ConfigError, match=r"unknown preset 'nope'; valid presets: awm, .*, shapes, shapes-nft$"):
        read_preset("nope")
    with pytest.raises(ConfigError, match="unknown preset"):
        preset_world("nope")


def test_a_name_shipped_twice_is_refused(tmp_path, monkeypatch):
    import flowgrpo.presets as presets

    (tmp_path / "worlds" / "toy").mkdir(parents=True)
    for path in (tmp_path / "grpo.yaml", tmp_path / "worlds" / "toy" / "grpo.yaml"):
        path.write_text("description: x\n")
    monkeypatch.setattr(presets, "preset_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match="preset grpo is shipped twice: flowgrpo/presets and flowgrpo/presets/worlds/toy"):
        presets.preset_names()


def test_the_presets_command_lists_the_world_presets_apart(capsys):
    from flowgrpo.cli import main

    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    papers, world = out.split("\n\n")
    assert papers.startswith("the papers' methods (flowgrpo/presets):\n") and "  flow-grpo " in papers
    assert world.startswith("tuned for the shapes world (flowgrpo/presets/worlds/shapes; settings measured with "
                            "--recipe shapes):\n")
    assert [ln.split()[0] for ln in world.splitlines()[1:]] == ["shapes", "shapes-nft"]
    assert [ln.split()[0] for ln in papers.splitlines()[1:]] == preset_names()[:-2]
