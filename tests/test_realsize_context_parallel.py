"""Per-GPU memory under context parallelism (flowgrpo.realsize.context_parallel): the split law against
a direct count at the split token number, and the docs' table against its data file."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from flowgrpo.realsize.activations import Geometry, activation_bytes
from flowgrpo.realsize.context_parallel import context_parallel_rows, markdown_rows, split_activations

ROOT = Path(__file__).parent.parent
DATA = ROOT / "benchmarks" / "results" / "context_parallel_memory.json"
BEGIN, END = "<!-- cp-memory-table:begin -->", "<!-- cp-memory-table:end -->"
#: Wan 2.1 1.3B at its real width with two blocks (meta device: nothing allocated)
SHALLOW = {"num_layers": 2}


def test_the_split_blocks_equal_a_direct_count_at_the_split_token_number():
    # 128 px: 8 x 8 patches a latent frame; 13 frames: 4 latent frames (256 tokens), halved: 2 latent frames
    # (5 frames, 128 tokens), counted on its own, independently of the two-point line
    geo = Geometry(resolution=128, frames=13, text_tokens=64, batch=2)
    full = activation_bytes("wan21-t2v-1.3b", geo, rank=4, **SHALLOW)
    small = activation_bytes("wan21-t2v-1.3b", replace(geo, frames=1), rank=4, **SHALLOW)
    half = activation_bytes("wan21-t2v-1.3b", replace(geo, frames=5), rank=4, **SHALLOW)
    assert (full.image_tokens, small.image_tokens, half.image_tokens) == (256, 64, 128)
    split = split_activations(full, small, 2)
    assert split.tokens_per_rank == 128
    assert split.no_checkpointing - full.outside == sum(half.blocks)
    assert split.checkpointing - full.outside == half.block_inputs + max(half.blocks)
    one = split_activations(full, small, 1)  # no split: the full count
    assert (one.checkpointing, one.no_checkpointing) == (full.checkpointing, full.no_checkpointing)
    # the text tokens do not split: halving the tokens saves less than half of the blocks' bytes
    assert sum(half.blocks) > sum(full.blocks) / 2


def test_a_degree_that_does_not_divide_the_tokens_is_refused():
    geo = Geometry(resolution=128, frames=1, text_tokens=64, batch=1)
    full = activation_bytes("wan21-t2v-1.3b", replace(geo, frames=5), rank=4, **SHALLOW)
    small = activation_bytes("wan21-t2v-1.3b", geo, rank=4, **SHALLOW)
    with pytest.raises(ValueError, match="degree 3 must be >= 1 and divide the sample's 128 tokens"):
        split_activations(full, small, 3)


def test_the_docs_table_is_the_data_file_rendered():
    rows = json.loads(DATA.read_text())["rows"]
    assert {r["recipe"] for r in rows} == {"wan21-t2v-14b", "wan22-a14b"}
    assert all((r["resolution"], r["frames"]) == (480, 81) for r in rows)
    for recipe in ("wan21-t2v-14b", "wan22-a14b"):  # each degree's activations fall, the state does not
        mine = sorted((r for r in rows if r["recipe"] == recipe), key=lambda r: r["degree"])
        assert [r["degree"] for r in mine] == [1, 2, 4]
        assert len({r["state"] for r in mine}) == 1
        assert mine[0]["activations"] > mine[1]["activations"] > mine[2]["activations"]
    text = (ROOT / "docs" / "distributed.md").read_text()
    table = text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()
    assert table == markdown_rows(rows)


@pytest.mark.slow
def test_the_data_file_is_what_the_function_computes():
    rows = [r for r in json.loads(DATA.read_text())["rows"] if r["recipe"] == "wan21-t2v-14b"]
    assert context_parallel_rows("wan21-t2v-14b") == rows
