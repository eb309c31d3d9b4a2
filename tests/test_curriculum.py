"""The signal curriculum (data.curriculum=signal): weights, prompt drawing, trainer wiring and resume."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from conftest import CONSTANT

from flowgrpo.config import load_config
from flowgrpo.curriculum import SignalCurriculum, groups_with_signal
from flowgrpo.data import PromptSource
from flowgrpo.errors import ConfigError
from flowgrpo.shapes.world import RELATIONS, TAGS
from flowgrpo.trainer.trainer import Trainer


def test_unseen_keys_are_uniform_and_a_key_without_signal_sinks_to_the_floor():
    cur = SignalCurriculum(floor=0.1, rate=0.5)
    keys = ["a", "b", "c"]
    assert cur.weights(keys).tolist() == pytest.approx([1 / 3] * 3)
    for _ in range(20):
        cur.observe(["a", "b"], [False, True])
    w = cur.weights(keys)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] == pytest.approx(0.1 / 2.1, rel=1e-3)  # a at the floor, b and c at 1
    assert w[1] == pytest.approx(w[2])
    cur.observe(["a"], [True])  # signal comes back: a rises at once
    assert cur.weights(keys)[0] > 0.2


def test_curriculum_state_round_trips_and_bad_settings_are_refused():
    cur = SignalCurriculum(floor=0.2, rate=0.3)
    cur.observe(["x", "y", "x"], [False, True, False])
    other = SignalCurriculum(floor=0.2, rate=0.3)
    other.load_state_dict(json.loads(json.dumps(cur.state_dict())))
    assert other.signal == cur.signal
    with pytest.raises(ValueError, match="floor"):
        SignalCurriculum(floor=0.0)
    with pytest.raises(ValueError, match="rate"):
        SignalCurriculum(rate=1.5)


def test_groups_with_signal_reads_the_estimators_mask():
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.tensor([False, False, True, True, False, True])
    assert groups_with_signal(groups, mask, 4) == [False, True, True, False]


def test_shapes_prompts_follow_the_curriculum_weights():
    cur = SignalCurriculum(floor=0.1)
    cur.signal = {"position": 0.0}  # position taught nothing lately: drawn at 0.1 / 5.1 of the time
    src = PromptSource("shapes", seed=5, curriculum=cur)
    drawn = [src.draw(it, 8) for it in range(150)]
    keys = Counter(k for b in drawn for k in b.keys)
    assert set(keys) <= set(TAGS)
    n = sum(keys.values())
    assert keys["position"] / n < 0.05  # uniform would be 1/6
    for tag in TAGS:
        if tag != "position":
            assert abs(keys[tag] / n - 1 / 5.1) < 0.05
    # keys are the drawn prompts' own tags: relation words appear in the position prompts only
    for b in drawn:
        for p, k in zip(b.prompts, b.keys):
            has_relation = any(f" {r} " in f" {p} " for r in RELATIONS)
            assert has_relation == (k == "position"), (p, k)
    # a pure function of (seed, iteration, curriculum state)
    again = PromptSource("shapes", seed=5, curriculum=SignalCurriculum(floor=0.1, signal={"position": 0.0}))
    assert again.draw(17, 8) == drawn[17]


def test_without_a_curriculum_draw_and_batch_agree_and_are_uniform_over_tags():
    src = PromptSource("shapes", seed=1)
    assert src.draw(3, 8).prompts == src.batch(3, 8)
    keys = Counter(k for it in range(150) for k in src.draw(it, 8).keys)
    assert all(abs(keys[t] / 1200 - 1 / 6) < 0.05 for t in TAGS)


def test_prompt_files_key_by_tag_column_or_by_prompt(tmp_path):
    tagged = tmp_path / "p.jsonl"
    tagged.write_text("\n".join(json.dumps({"prompt": f"p{i}", "tag": "hard" if i < 2 else "easy"}) for i in range(6)))
    src = PromptSource(str(tagged), seed=0, curriculum=SignalCurriculum(floor=0.05, signal={"easy": 0.0}))
    assert src.key_by == "tag"
    hard = sum(k == "hard" for it in range(100) for k in src.draw(it, 1).keys)
    assert hard > 80  # 2 prompts at weight 1 vs 4 at 0.05: 91 % of the draws

    plain = tmp_path / "p.txt"
    plain.write_text("a red cube\na blue ball\na green cone\n")
    src = PromptSource(str(plain), seed=0, curriculum=SignalCurriculum(floor=0.05, signal={"a blue ball": 0.0}))
    assert src.key_by == "prompt"
    b = src.draw(0, 3)
    assert b.keys == b.prompts
    blue = sum(p == "a blue ball" for it in range(100) for p in src.draw(it, 1).prompts)
    assert blue < 10

    with pytest.raises(ValueError, match="tags"):
        PromptSource("shapes", curriculum=SignalCurriculum(), key_by="prompt")


def test_config_names_the_valid_curricula():
    with pytest.raises(ConfigError) as e:
        load_config("shapes", None, ["data.curriculum=hardest"])
    assert "data.curriculum" in str(e.value) and "signal" in str(e.value)


def test_trainer_feeds_the_curriculum_and_logs_its_weights(tiny_config):
    cfg = tiny_config(**{"reward.weights": f"{{{CONSTANT}: 1.0}}", "data.curriculum": "signal"})
    trainer = Trainer(cfg)
    m = trainer.iteration_step().metrics
    seen = trainer.curriculum.signal
    assert seen and all(v == pytest.approx(1 - cfg.data.curriculum_rate) for v in seen.values())  # no spread
    logged = {k.removeprefix("curriculum."): v for k, v in m.items() if k.startswith("curriculum.")}
    assert set(logged) == set(seen) and sum(logged.values()) == pytest.approx(1.0)


def test_a_resumed_curriculum_run_draws_what_the_uninterrupted_one_draws(tiny_config):
    # the random model's shapes rewards mostly lack spread: the signal rates spread over 1e-3 .. 1
    cfg = tiny_config(**{"reward.weights": "{shapes: 1.0}", "data.curriculum": "signal",
                         "data.curriculum_rate": 0.9, "data.curriculum_floor": 1e-3,
                         "data.prompts_per_iteration": 4})
    full = Trainer(cfg)
    for _ in range(3):
        full.iteration_step()
    first = Trainer(cfg)
    first.iteration_step()
    state = json.loads(json.dumps(first.state_dict()["curriculum"]))
    resumed = Trainer(cfg)
    resumed.load_state_dict({**first.state_dict(), "curriculum": state})
    for _ in range(2):
        resumed.iteration_step()
    assert resumed.curriculum.signal == pytest.approx(full.curriculum.signal)
    assert resumed.prompts.draw(3, 4) == full.prompts.draw(3, 4)
    assert Trainer(cfg).prompts.draw(3, 4) != full.prompts.draw(3, 4)  # without the state: other prompts
