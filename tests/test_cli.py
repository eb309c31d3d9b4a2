"""The ``flowgrpo`` command line: bad input is one clear line and exit code 2; an end-to-end run."""

from __future__ import annotations

import json

import pytest
from conftest import RUN_ITERATIONS, run_cli, tiny_overrides

from flowgrpo.cli import main
from flowgrpo.shapes.world import TAGS


def one_line_error(rc: int, err: str, *needles: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2, f"exit code {rc}, stderr:\n{err}"
    assert "Traceback" not in err
    assert len(lines) == 1, f"expected exactly one line on stderr, got:\n{err}"
    assert lines[0].startswith("flowgrpo: error: ")
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"


@pytest.fixture
def bad_files(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n   \n")
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text('{"prompt": "a red circle"}\n{"prompt": "a blue square"\n')
    no_prompt = tmp_path / "noprompt.jsonl"
    no_prompt.write_text('{"text": "a red circle"}\n')
    return {"empty": empty, "malformed": malformed, "no_prompt": no_prompt}


def cases(model_dir, files, out):
    common = tiny_overrides(model_dir) + [f"log.out_dir={out}"]
    return [
        ("unknown key", ["train", "train.learning_rate=1e-4"], ["train.learning_rate", "lr"]),
        ("unknown section", ["train", "trainer.lr=1e-4"], ["trainer", "train"]),
        ("wrong type float", ["train", "train.lr=abc"], ["train.lr", "abc"]),
        ("wrong type int", ["train", "train.iterations=1.5"], ["train.iterations", "1.5"]),
        ("bad choice", ["train", "sampler.sde_kind=ddim"], ["sampler.sde_kind", "flow_grpo, dance, cps"]),
        ("unknown preset", ["train", "--preset", "nope"], ["nope", "shapes"]),
        ("missing config file", ["train", "--config", str(out / "missing.yaml")], ["missing.yaml"]),
        ("empty prompt file", ["train", *common, f"data.prompts={files['empty']}"], [str(files["empty"]), "no prompts"]),
        ("malformed jsonl", ["train", *common, f"data.prompts={files['malformed']}"], [f"{files['malformed']}:2", "JSON"]),
        ("jsonl without prompt", ["train", *common, f"data.prompts={files['no_prompt']}"], ["prompt"]),
        ("missing prompt file", ["train", *common, f"data.prompts={out / 'nope.txt'}"], ["nope.txt"]),
        ("missing weights", ["train", *tiny_overrides(out / "no_weights"), f"log.out_dir={out}"],
         [str(out / "no_weights"), "not found"]),
        ("unknown model", ["train", *common, "model.name=sd9"], ["sd9", "shapes", "sd3"]),
        ("unknown reward", ["train", *common, "reward.weights={hps9: 1.0}"], ["hps9", "shapes", "jpeg_compressibility"]),
        ("unknown strategy", ["train", *common, "sampler.strategy=nope"], ["nope", "flow_grpo"]),
        ("eval of a non-run", ["eval", str(out)], [str(out)]),
        ("resume of a non-run", ["train", "--resume", str(out / "nothing")], ["nothing"]),
    ]


def test_bad_input_is_one_line_and_exit_code_2(shapes_model_dir, bad_files, tmp_path, capsys):
    out = tmp_path / "runs"
    out.mkdir()
    for name, argv, needles in cases(shapes_model_dir, bad_files, out):
        rc = main(argv)
        err = capsys.readouterr().err
        try:
            one_line_error(rc, err, *needles)
        except AssertionError as e:
            raise AssertionError(f"case {name!r}: {e}") from None


def test_bad_input_in_a_real_process(shapes_model_dir, bad_files, tmp_path):
    """The same through the installed console script: nothing else reaches stderr (no warnings, no
    traceback), for an error found while parsing the config and one found after the model is built."""
    proc = run_cli(["train", "--preset", "nope", "train.lr=1e-4"])
    one_line_error(proc.returncode, proc.stderr, "nope", "shapes")
    proc = run_cli(["train", *tiny_overrides(shapes_model_dir), f"log.out_dir={tmp_path}",
                    f"data.prompts={bad_files['malformed']}"])
    one_line_error(proc.returncode, proc.stderr, "malformed JSON")


def test_presets_lists_shapes():
    proc = run_cli(["presets"])
    assert proc.returncode == 0, proc.stderr
    names = [ln.split()[0] for ln in proc.stdout.splitlines() if ln.strip()]
    assert "shapes" in names
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("shapes"))
    assert len(line.split(None, 1)) == 2  # with its description


def test_end_to_end_run_directory(cli_run_dir):
    d = cli_run_dir
    for name in ("config.yaml", "metrics.jsonl", "reward_curve.png", "before_after.png", "summary.json",
                 "eval_before.json", "accuracy_curve.png"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    assert list((d / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (d / "checkpoints").iterdir() if p.name.startswith("ckpt_"))
    assert ckpts and ckpts[-1] == f"ckpt_{RUN_ITERATIONS:06d}"
    assert (d / "checkpoints" / ckpts[-1] / "state.pt").is_file()
    assert list((d / "grids").glob("iter_*.png"))

    rows = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(RUN_ITERATIONS))
    for r in rows:
        for key in ("reward_mean", "reward.shapes", "reward.jpeg_compressibility", "loss", "approx_kl",
                    "clipfrac_high", "clipfrac_low", "zero_std_ratio", "nfe_rollout", "train_seconds"):
            assert key in r, key
    assert rows[0]["onpolicy_ratio_maxdev"] < 1e-6

    s = json.loads((d / "summary.json").read_text())
    assert s["iterations"] == RUN_ITERATIONS and s["train_seconds"] > 0
    for key in ("eval_before", "eval_after"):
        ev = s[key]
        assert 0.0 <= ev["accuracy"] <= 1.0
        assert set(ev["per_tag"]) <= set(TAGS) and ev["per_tag"]
        assert ev["num_samples"] == 4
    assert s["accuracy_gain"] == pytest.approx(s["eval_after"]["accuracy"] - s["eval_before"]["accuracy"])
    # the paired standard error of the gain, from the per-sample verdicts kept in eval_before.json
    before = json.loads((d / "eval_before.json").read_text())["correct"]
    assert len(before) == 4 and s["gain_se"] >= 0.0
    # the curve starts at the base model and ends at the final evaluation, in training time order
    curve = s["eval_curve"]
    assert curve[0] == {"iteration": 0, "train_seconds": 0.0, "accuracy": s["eval_before"]["accuracy"],
                        "accuracy_unseen": s["eval_before"]["accuracy_unseen"]}
    assert curve[-1]["accuracy"] == s["eval_after"]["accuracy"] and curve[-1]["iteration"] == RUN_ITERATIONS
    assert all(b["train_seconds"] >= a["train_seconds"] for a, b in zip(curve, curve[1:]))
    assert s["eval_before_seen"]["num_samples"] == s["eval_after_seen"]["num_samples"] == 4


def test_eval_command_writes_json(cli_run_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    proc = run_cli(["eval", str(cli_run_dir), "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert 0.0 <= res["accuracy"] <= 1.0 and res["per_tag"]
    assert res["checkpoint"].endswith(f"ckpt_{RUN_ITERATIONS:06d}")
    # the evaluation is deterministic: the same numbers as the run's final (EMA) evaluation
    summary = json.loads((cli_run_dir / "summary.json").read_text())
    assert res["accuracy"] == summary["eval_after"]["accuracy"]
    assert res["per_tag"] == summary["eval_after"]["per_tag"]
    assert "overall" in proc.stdout
    # a checkpoint folder works as a target too
    ckpt = sorted((cli_run_dir / "checkpoints").glob("ckpt_*"))[-1]
    out2 = tmp_path / "eval_ckpt.json"
    assert main(["eval", str(ckpt), "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["accuracy"] == res["accuracy"]
