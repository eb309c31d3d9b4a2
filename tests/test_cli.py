"""The ``flowgrpo`` command line: bad input is one clear line and exit code 2; an end-to-end run whose
summary is recomputed from the per-sample verdicts; `config explain`; where `bench` writes."""

from __future__ import annotations

import re
import csv
import dataclasses
import importlib
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml
from conftest import RUN_ITERATIONS, run_cli, tiny_overrides

from flowgrpo.cli import main
from flowgrpo.config import RunConfig, preset_names, read_preset
from flowgrpo.config import help as config_help
from flowgrpo.shapes.prompts import parse_prompt
from flowgrpo.trainer.core_share import cores_used


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


def test_presets_lists_every_preset_with_its_description():
    proc = run_cli(["presets"])
    assert proc.returncode == 0, proc.stderr
    # a heading (not indented) opens each group: the papers' methods, then the presets tuned on a world
    headings = [ln for ln in proc.stdout.splitlines() if ln.strip() and not ln[0].isspace()]
    assert headings == ["the papers' methods (flowgrpo/presets):", "tuned for the shapes world "
                        "(flowgrpo/presets/worlds/shapes; settings measured with --recipe shapes):"]
    listed = [ln.split(None, 1) for ln in proc.stdout.splitlines() if ln.strip() and ln[0].isspace()]
    assert [x[0] for x in listed] == preset_names() and "shapes" in preset_names()
    assert [x[0] for x in listed][-2:] == ["shapes", "shapes-nft"]  # under the second heading
    from flowgrpo.config.show import preset_description

    for name, desc in listed:
        # the listing fills each {section.key} placeholder with the preset's resolved value
        assert desc.strip() == preset_description(name).strip(), name
        assert not re.search(r"{[a-z_]+\.[a-z_.]+}", desc) and read_preset(name)["description"].split()[0] == desc.split()[0], name


def _per_tag(correct: list, num_prompts: int) -> dict[str, float]:
    """Per-tag accuracy recomputed from per-sample verdicts on the held-out prompts (1 seed each)."""
    try:
        from flowgrpo.shapes.evaluate import heldout_prompts
    except ImportError:  # the layout before the evaluation moved into flowgrpo.shapes
        from flowgrpo.evaluate import heldout_prompts
    tags = [parse_prompt(p).tag for p in heldout_prompts(num_prompts, 1)[0]]
    return {t: statistics.mean(float(c) for c, tt in zip(correct, tags) if tt == t) for t in sorted(set(tags))}


def test_end_to_end_run_directory(cli_run_dir):
    d = cli_run_dir
    for name in ("config.yaml", "metrics.jsonl", "reward_curve.png", "before_after.png", "summary.json",
                 "eval_before.json", "accuracy_curve.png"):
        assert (d / name).is_file() and (d / name).stat().st_size > 0, name
    assert list((d / "tensorboard").rglob("events.out.tfevents.*"))  # accelerate: tensorboard/<log.project>/
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
    assert all(0 < r["cpu_s"] for r in rows) and 0 < cores_used(rows) < 4  # CPU-seconds per wall-second
    assert s["eval_before"]["num_samples"] == s["eval_after"]["num_samples"] == 4
    # the base evaluation recomputed from its per-sample verdicts (kept in eval_before.json)
    before = json.loads((d / "eval_before.json").read_text())["correct"]
    assert len(before) == 4
    assert s["eval_before"]["accuracy"] == pytest.approx(statistics.mean(float(c) for c in before))
    assert s["eval_before"]["per_tag"] == pytest.approx(_per_tag(before, 4))
    assert s["accuracy_gain"] == pytest.approx(s["eval_after"]["accuracy"] - s["eval_before"]["accuracy"])
    # the curve starts at the base model and ends at the final evaluation, in training time order
    curve = s["eval_curve"]
    # one seed a prompt: the seed standard error falls back to the spread of all four verdicts
    assert s["eval_before"]["accuracy_se"] == pytest.approx(statistics.stdev(float(c) for c in before) / 2)
    assert curve[0] == {"iteration": 0, "train_seconds": 0.0, "accuracy": s["eval_before"]["accuracy"],
                        "accuracy_se": s["eval_before"]["accuracy_se"],
                        "accuracy_unseen": s["eval_before"]["accuracy_unseen"], "fidelity": s["eval_before"]["fidelity"],
                        "per_tag": s["eval_before"]["per_tag"]}
    assert curve[-1]["accuracy"] == s["eval_after"]["accuracy"] and curve[-1]["iteration"] == RUN_ITERATIONS
    assert curve[-1]["per_tag"] == s["eval_after"]["per_tag"]
    assert all(b["train_seconds"] >= a["train_seconds"] for a, b in zip(curve, curve[1:]))
    assert s["eval_before_seen"]["num_samples"] == s["eval_after_seen"]["num_samples"] == 4


def test_eval_command_writes_json(cli_run_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    proc = run_cli(["eval", str(cli_run_dir), "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["checkpoint"].endswith(f"ckpt_{RUN_ITERATIONS:06d}")
    after = res["correct"]  # per-sample verdicts, the same prompts and seeds as eval_before.json
    assert len(after) == res["num_samples"] == 4
    assert res["accuracy"] == pytest.approx(statistics.mean(float(c) for c in after))
    assert res["per_tag"] == pytest.approx(_per_tag(after, 4))
    # the evaluation is deterministic: the same numbers as the run's final (EMA) evaluation
    summary = json.loads((cli_run_dir / "summary.json").read_text())
    assert res["accuracy"] == summary["eval_after"]["accuracy"]
    assert res["per_tag"] == summary["eval_after"]["per_tag"]
    # the summary's paired gain and its standard error, recomputed sample by sample
    before = json.loads((cli_run_dir / "eval_before.json").read_text())["correct"]
    diff = [float(a) - float(b) for a, b in zip(after, before)]
    assert summary["accuracy_gain"] == pytest.approx(statistics.mean(diff))
    assert summary["gain_se"] == pytest.approx(statistics.stdev(diff) / math.sqrt(len(diff)))
    assert "overall" in proc.stdout
    # a checkpoint folder works as a target too
    ckpt = sorted((cli_run_dir / "checkpoints").glob("ckpt_*"))[-1]
    out2 = tmp_path / "eval_ckpt.json"
    assert main(["eval", str(ckpt), "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["accuracy"] == res["accuracy"]


# --------------------------------------------------------------------------- config explain


@dataclass
class _Inner:
    mode: Literal["a", "b"] = field(default="a", metadata={"help": "the mode"})
    level: Literal[1, 2] = field(default=1, metadata={"help": "the level"})
    size: int | None = field(default=None, metadata={"help": "a size, or none"})
    kind: Literal["x", "y"] | None = field(default=None, metadata={"help": "a kind, or none"})
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"help": "two betas"})
    weights: dict = field(default_factory=lambda: {"shapes": 1.0}, metadata={"help": "name -> weight"})
    flag: bool = True


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    name: str = field(default="", metadata={"help": "a name"})


def test_config_rows_of_a_hand_built_config():
    """Types, choices from Literal (also inside ``| None``), defaults as they are written in YAML."""
    def row(key, type_, default, choices=(), help=""):
        return {"key": key, "type": type_, "default": default, "choices": list(choices), "help": help}

    assert config_help.config_rows(_Outer) == [
        row("inner.mode", "str", "a", ["a", "b"], "the mode"),
        row("inner.level", "int", "1", ["1", "2"], "the level"),
        row("inner.size", "int | None", "null", [], "a size, or none"),
        row("inner.kind", "str | None", "null", ["x", "y", "null"], "a kind, or none"),
        row("inner.betas", "list[float]", "[0.9, 0.999]", [], "two betas"),
        row("inner.weights", "dict", "{shapes: 1.0}", [], "name -> weight"),
        row("inner.flag", "bool", "true"),
        row("name", "str", "''", [], "a name"),
    ]


def _explain(capsys, argv) -> tuple[int, str]:
    # wide enough that no help text wraps, whatever terminal (or test worker) the suite runs in
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLUMNS", "250")
        rc = main(argv)
    return rc, capsys.readouterr().out


def test_config_explain_section_lists_every_field(capsys):
    rc, out = _explain(capsys, ["config", "explain", "loss"])
    assert rc == 0
    loss_cls = {f.name: f for f in dataclasses.fields(RunConfig)}["loss"].default_factory
    lines = out.splitlines()
    for f in dataclasses.fields(loss_cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):  # an objective's options: one row per option, loss.<objective>.<key>
            for g in dataclasses.fields(sub):
                hits = [ln for ln in lines if ln.startswith(f"│ loss.{f.name}.{g.name} ")]
                assert len(hits) == 1, f"loss.{f.name}.{g.name} not listed once in:\n{out}"
            continue
        hits = [ln for ln in lines if ln.startswith(f"│ loss.{f.name} ")]
        assert len(hits) == 1, f"loss.{f.name} not listed once in:\n{out}"
        assert f.metadata["help"][:40] in out
    assert "train.lr" not in out  # only the asked section
    # `train --help-config SECTION` is the same listing
    rc2, out2 = _explain(capsys, ["train", "--help-config", "loss"])
    assert rc2 == 0 and out2 == out


def test_config_explain_one_key_and_everything(capsys):
    rc, out = _explain(capsys, ["config", "explain", "train.lr"])
    assert rc == 0
    assert [ln.split()[1] for ln in out.splitlines() if ln.startswith("│ ")] == ["train.lr"]
    rc, out = _explain(capsys, ["config", "explain"])
    assert rc == 0
    keys = {ln.split()[1] for ln in out.splitlines() if ln.startswith("│ ") and ln.split()[1] != "│"}
    expected = {r["key"] for r in config_help.config_rows(RunConfig)}
    assert expected <= keys and {"train.lr", "sampler.strategy", "strategy", "description"} <= keys


def test_config_explain_bad_section_and_key(capsys):
    sections = [f.name for f in dataclasses.fields(RunConfig)]
    rc = main(["config", "explain", "trainer"])
    one_line_error(rc, capsys.readouterr().err, "'trainer'", "valid sections: " + ", ".join(sections))
    rc = main(["train", "--help-config", "nope"])
    one_line_error(rc, capsys.readouterr().err, "'nope'", "loss, train")
    loss_keys = [r["key"] for r in config_help.config_rows(RunConfig) if r["key"].startswith("loss.")]
    rc = main(["config", "explain", "loss.bta"])
    one_line_error(rc, capsys.readouterr().err, "'loss.bta'", ", ".join(loss_keys))
    rc = main(["config", "explain", "loss.beta"])  # a renamed key: the error names where it went
    one_line_error(rc, capsys.readouterr().err, "'loss.beta' is now 'loss.grpo.kl_beta'", "config explain loss.grpo.kl_beta")


def test_strategy_options_are_each_strategys_option_dataclass():
    from flowgrpo.samplers.strategies import STRATEGIES

    rows = config_help.strategy_option_rows()
    assert set(rows) == set(STRATEGIES.names())
    assert rows["flow_grpo"] == []  # no options
    mix = {r["key"]: r for r in rows["mix_grpo"]}
    assert mix["strategy.window"]["default"] == "4" and mix["strategy.window"]["type"] == "int"
    assert mix["strategy.mode"]["choices"] == ["progressive", "random", "frozen"]
    assert mix["strategy.shift_every"]["help"] == "iterations between window moves tau"
    assert [r["key"] for r in rows["mix_grpo_flash_star"]] == ["strategy.window", "strategy.compress"]
    assert {r["key"] for r in rows["tempflow_grpo"]} == {"strategy.branch", "strategy.branch_steps"}


BENCHES = [("ops", "bench_ops", "run_bench_ops"), ("samplers", "bench_samplers", "run_bench_samplers"),
           ("e2e", "bench_e2e", "run_bench_e2e"), ("profile", "bench_profile", "run_bench_profile")]


@pytest.mark.parametrize("what,module,fn", BENCHES)
def test_bench_passes_out_and_json(monkeypatch, tmp_path, what, module, fn):
    mod = importlib.import_module(f"flowgrpo.benchmarks.{module}")
    calls = []
    monkeypatch.setattr(mod, fn, lambda *a, **kw: calls.append((a, kw)) or {})
    out, js = str(tmp_path / "res"), str(tmp_path / "r.json")
    assert main(["bench", what, "--out", out, "--json", js]) == 0
    assert calls == [((js,), {"out_dir": out})]
    calls.clear()
    assert main(["bench", what]) == 0
    assert calls == [((None,), {"out_dir": None})]  # None: the benchmark's default, the current directory


def test_bench_modules_never_write_next_to_their_code():
    import flowgrpo.benchmarks as pkg

    modules = sorted(Path(pkg.__file__).parent.glob("*.py"))
    assert {m.name for m in modules} >= {"bench_ops.py", "bench_samplers.py", "bench_e2e.py", "bench_profile.py"}
    for m in modules:
        assert "__file__" not in m.read_text(), f"{m.name} builds a path from __file__"


def test_bench_profile_writes_into_the_current_directory(shapes_model_dir, tmp_path, monkeypatch):
    from flowgrpo.benchmarks.bench_profile import PHASES, run_bench_profile

    monkeypatch.chdir(tmp_path)
    overrides = tiny_overrides(shapes_model_dir, **{"log.trackers": "[]"}) + [f"log.out_dir={tmp_path / 'runs'}"]
    res = run_bench_profile("prof.json", iterations=1, overrides=overrides, quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "runs") == ["prof.json", "profile.csv", "profile.png"]
    assert json.loads((tmp_path / "prof.json").read_text()) == json.loads(json.dumps(res))
    # the phases add up to the iteration, and each share is its seconds over the iteration's
    total = res["seconds_per_iteration"]
    assert sum(res["seconds"].values()) == pytest.approx(total)
    for p in PHASES:
        assert res["share"][p] == pytest.approx(res["seconds"][p] / total)
    rows = list(csv.reader((tmp_path / "profile.csv").open()))
    assert rows == [["phase", "seconds_per_iteration", "share"]] + [
        [p, f"{res['seconds'][p]:.4f}", f"{res['share'][p]:.4f}"] for p in PHASES]


def test_bench_ops_csv_speedups_and_timing_loop(tmp_path):
    from flowgrpo.benchmarks.bench_ops import _inputs, _time_interleaved, _write_csv
    from flowgrpo.ops import grpo_loss_ref

    rows = [{"D": 8, "impl": "fused", "seconds": 1.0, "gbps": 5.0}, {"D": 8, "impl": "eager", "seconds": 4.0, "gbps": 1.25},
            {"D": 8, "impl": "compiled", "seconds": 2.0, "gbps": 2.5}]
    _write_csv(tmp_path / "ops.csv", rows, copy_gbps=10.0)
    assert list(csv.reader((tmp_path / "ops.csv").open())) == [
        ["D", "impl", "seconds", "gbps", "pct_of_copy", "speedup_vs_eager", "speedup_vs_compiled"],
        ["8", "fused", "1.000000", "5.000", "50.0", "4.000", "2.000"],
        ["8", "eager", "4.000000", "1.250", "12.5", "1.000", "0.500"],
        ["8", "compiled", "2.000000", "2.500", "25.0", "2.000", "1.000"]]
    # the timing loop runs forward + backward of the loss as the ops package returns it
    args, kwargs = _inputs(4, 16)
    secs = _time_interleaved({"eager": grpo_loss_ref}, args, kwargs, repeats=1, warmup=1)
    assert set(secs) == {"eager"} and secs["eager"] > 0


def test_train_without_a_preset_runs_the_default_recipe(shapes_model_dir, tmp_path):
    """`flowgrpo train` with no --preset trains config.DEFAULT_PRESET (the README's first command)."""
    from flowgrpo.config import DEFAULT_PRESET

    out = tmp_path / "runs"
    extra = {"log.grid_every": 0, "reward.weights": "{shapes: 1.0, jpeg_compressibility: 0.01}"}  # signal in every group
    proc = run_cli(["train", *tiny_overrides(shapes_model_dir, **extra), f"log.out_dir={out}",
                    "log.run_name=default"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((out / "default" / "summary.json").read_text())
    assert s["preset"] == DEFAULT_PRESET and s["iterations"] == 2
    assert s["eval_after"]["fidelity"] is not None
    cfg = yaml.safe_load((out / "default" / "config.yaml").read_text())
    assert cfg["loss"]["objective"] == "nft" and cfg["loss"]["nft"]["policy_min_t"] == 0.4
    rows = [json.loads(ln) for ln in (out / "default" / "metrics.jsonl").read_text().splitlines()]
    assert any("anchor_rows" in r for r in rows) and not any("approx_kl" in r for r in rows)
