"""The credit stage's one record of what trains (issue 30, item 2): the transition objectives read its
edge masks, the forward-process objectives its leaves, and both come from the same estimator mask and
the same strategy pruning."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from flowgrpo.config import load_config
from flowgrpo.objectives.base import Credit
from flowgrpo.trainer.trainer import Trainer

SHRINK = ["sampler.num_steps=6", "data.prompts_per_iteration=2", "data.trees_per_prompt=1", "train.threads=1",
          "strategy.splits=[0, 2]", "strategy.depth_prune=0"]


def _credit(signal, valid=None, kept=None):
    adv = SimpleNamespace(leaf_mask=torch.tensor(signal))
    return Credit(advantages=adv, edge_masks=[None], pruned_edges=None, steps=[],
                  leaf_valid=None if valid is None else torch.tensor(valid),
                  leaf_kept=None if kept is None else torch.tensor(kept))


def test_trained_leaves_combines_validity_signal_and_pruning():
    signal = [True, True, False, False, True]  # leaves 2, 3: a group without reward spread
    valid = [True, True, True, False, True]  # leaf 3: a NaN reward
    kept = [True, False, True, True, True]  # leaf 1: pruned by the strategy
    cr = _credit(signal, valid, kept)
    assert cr.trained_leaves().tolist() == [True, False, True, False, True]  # the authors' rows, minus pruning
    assert cr.trained_leaves(only_signal=True).tolist() == [True, False, False, False, True]
    assert _credit(signal).trained_leaves().tolist() == [True] * 5  # nothing recorded: every leaf
    assert _credit(signal).trained_leaves(True).tolist() == signal


def _trainer(shapes_model_dir, objective, width_prune):
    cfg = load_config("branch-grpo", None, [f"model.path={shapes_model_dir}", *SHRINK, f"loss.objective={objective}",
                                            f"strategy.width_prune={width_prune}",
                                            "reward.weights={jpeg_compressibility: 1.0}"], recipe="shapes")
    return Trainer(cfg)


def test_width_pruning_reaches_the_forward_process_rows(shapes_model_dir):
    """Under width pruning a DiffusionNFT update trains on the kept leaves' samples only: the leaves
    below the pruned edges get no row (before the record, forward_rows read no pruning at all)."""
    trainer = _trainer(shapes_model_dir, "nft", "top")
    col = trainer.collect(0)
    cr = trainer.credit(col)
    whole = col.view.whole
    kept = cr.leaf_kept
    assert kept is not None and 0 < int(kept.sum()) < whole.num_leaves  # "top" keeps half of each split
    # the leaf view agrees with the edge view: a leaf is kept exactly when the edge into it trains
    depth, node = whole.leaf_depth.cpu(), whole.leaf_node.cpu()
    edge_kept = torch.tensor([bool(cr.edge_masks[d][n]) if cr.edge_masks[d] is not None else True
                              for d, n in zip(depth.tolist(), node.tolist())])
    signal = cr.advantages.leaf_mask.cpu().bool()
    assert torch.equal(kept & signal, edge_kept & signal)
    ctx = trainer.update_context(col, cr)
    rows = trainer.objective.rows(ctx)
    trained = set(rows.leaf.unique().tolist())
    assert trained == set(cr.trained_leaves(trainer.cfg.loss.nft.rows == "signal").nonzero().flatten().tolist())
    assert not trained & set((~kept).nonzero().flatten().tolist())


def test_without_pruning_every_valid_leaf_trains(shapes_model_dir):
    trainer = _trainer(shapes_model_dir, "nft", "none")
    col = trainer.collect(0)
    cr = trainer.credit(col)
    assert cr.leaf_kept is None and bool(cr.leaf_valid.all())
    if trainer.cfg.loss.nft.rows == "all":
        rows = trainer.objective.rows(trainer.update_context(col, cr))
        assert set(rows.leaf.unique().tolist()) == set(range(col.view.whole.num_leaves))
