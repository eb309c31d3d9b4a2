"""World presets: the methods tuned on one recipe's world resolve exactly as before they moved.

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

from flowgrpo.config import RECIPE_METHOD, compose_config, to_dict, validate

BEFORE = json.loads((Path(__file__).parent / "data" / "world_presets_before_move.json").read_text())


@pytest.mark.parametrize("label", sorted(BEFORE["configs"]))
def test_train_resolves_as_before_the_world_presets_moved(label):
    composed = compose_config(RECIPE_METHOD if label == "default" else label, None, [], None)
    validate(composed.config)
    want = BEFORE["configs"][label]
    assert composed.recipe == want["recipe"]
    assert json.loads(json.dumps(to_dict(composed.config))) == want["config"]
    assert dict(sorted(composed.sources.items())) == want["sources"]
