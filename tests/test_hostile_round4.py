"""Issue 43, a fourth round of the project's own probing: the drawing commands' flags and the
evaluators' options.

* ``flowgrpo eval RUN --bench geneval --images-per-prompt 100000000`` was killed by the kernel (the
  (prompt, image) list alone outgrew the machine) and ``--images-per-prompt 101`` drew images whose
  noise seeds repeat: ``sample``, ``eval --bench`` and ``unigenbench generate`` now share one check
  beside :func:`~flowgrpo.output.drawing.noise_seed` (its ranges: seed, images per prompt, prompts);
* ``eval --bench ... --out FILE`` was a NotADirectoryError traceback;
* the held-out ``flowgrpo eval RUN --seed 5`` / ``--steps 3`` / ``--batch-size 8`` exited 0 having
  ignored the flag;
* two ``eval.options.*`` overrides: the second replaced the first under ``flowgrpo eval``,
  ``--resume`` and ``unigenbench generate`` (overrides applied one by one), and under any command
  ``eval.options.seed=3`` on the sd35-geneval recipe wiped its ``eval.options.bench`` (the mapping was
  replaced, not merged as ``reward.options`` is);
* ``eval.options.seed=abc`` / ``batch_size=0`` of the bench evaluator were tracebacks.
"""

from __future__ import annotations

import pytest
import torch

from flowgrpo.cli import main
from flowgrpo.config import RunConfig, apply_dict, apply_overrides, load_config
from flowgrpo.output.drawing import MAX_IMAGES_PER_PROMPT, MAX_SEED, noise_seed

from test_cli_errors import one_line_error


def test_noise_seeds_are_distinct_over_the_checked_ranges():
    """The ranges the shared check enforces are the ones within which no two images share a seed."""
    corners = [(s, i, j) for s in (0, 1, MAX_SEED) for i in (0, 1, 99_999) for j in (0, 1, MAX_IMAGES_PER_PROMPT - 1)]
    seeds = [noise_seed(*c) for c in corners]
    assert len(set(seeds)) == len(corners)
    assert max(seeds) < 2**64
    torch.Generator().manual_seed(max(seeds))  # takes it (a seed >= 2^64 is a RuntimeError)
    assert noise_seed(0, 0, MAX_IMAGES_PER_PROMPT) == noise_seed(0, 1, 0)  # one image more per prompt collides


@pytest.mark.parametrize("flag, value, needle", [
    ("--images-per-prompt", "100000000", "--images-per-prompt must be in 1..100, got 100000000"),  # was OOM-killed
    ("--images-per-prompt", "101", "--images-per-prompt must be in 1..100"),  # seeds would repeat
    ("--seed", "-5", "--seed must be in 0..2^40, got -5"),
    ("--steps", "0", "--steps must be in 1..1000"),
    ("--batch-size", "0", "--batch-size must be at least 1"),
    ("--max-prompts", "0", "--max-prompts must be at least 1"),
])
def test_eval_bench_flags_are_checked_before_a_model_loads(flag, value, needle, tmp_path, capsys):
    rc = main(["eval", str(tmp_path / "no_model"), "--bench", "geneval", "--out", str(tmp_path / "o"), flag, value])
    one_line_error(rc, capsys.readouterr().err, needle)
    assert not (tmp_path / "o").exists()


def test_eval_bench_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    rc = main(["eval", str(tmp_path), "--bench", "geneval", "--out", str(tmp_path / "f")])
    one_line_error(rc, capsys.readouterr().err, "--out", "is a file")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("argv, flag", [
    (["--seed", "5"], "--seed"), (["--steps", "3"], "--steps"), (["--batch-size", "8"], "--batch-size"),
    (["--images-per-prompt", "2"], "--images-per-prompt"), (["--option", "a=b"], "--option"),
])
def test_held_out_eval_refuses_a_benchmark_flag_it_would_ignore(argv, flag, tmp_path, capsys):
    rc = main(["eval", str(tmp_path), *argv])
    one_line_error(rc, capsys.readouterr().err, f"{flag} belongs to a benchmark: add --bench NAME")


def test_unigenbench_generate_checks_its_seed(tmp_path, capsys):
    rc = main(["unigenbench", "generate", "--model", str(tmp_path), "--set", "en", "--out", str(tmp_path / "o"),
               "--seed", "-1", "--quiet"])
    one_line_error(rc, capsys.readouterr().err, "--seed must be in 0..2^40, got -1")


def test_eval_options_merge_key_by_key_and_restart_with_another_evaluator():
    cfg = RunConfig()
    apply_overrides(cfg, ["eval.options.seed=3", "eval.evaluator=bench", "eval.options.bench=geneval"])
    assert cfg.eval.options == {"bench": "geneval", "seed": 3}  # one layer, whatever the order
    apply_dict(cfg, {"eval": {"options": {"metric_options": {"detector": "/d"}}}})
    assert cfg.eval.options == {"bench": "geneval", "seed": 3, "metric_options": {"detector": "/d"}}
    apply_dict(cfg, {"eval": {"evaluator": "unigenbench"}})
    assert cfg.eval.options == {}  # the bench evaluator's options would be unknown keys to it
    apply_dict(cfg, {"monitor": {"reward_options": {"clip": {"a": 1}}}})
    apply_dict(cfg, {"monitor": {"reward_options": {"clip": {"b": 2}}}})
    assert cfg.monitor.reward_options == {"clip": {"a": 1, "b": 2}}


def test_an_eval_option_override_keeps_the_recipes_benchmark():
    cfg = load_config(overrides=["model.name=sd3-tiny", "eval.options.seed=3"], recipe="sd35-geneval")
    assert cfg.eval.options["bench"] == "geneval" and cfg.eval.options["seed"] == 3
    assert cfg.eval.options["prompts"].endswith(".jsonl")


def test_flowgrpo_eval_applies_its_overrides_as_one_layer(cli_run_dir, capsys):
    # before: the second eval.options override replaced the first, so the error was "needs eval.options.bench"
    rc = main(["eval", str(cli_run_dir), "eval.evaluator=bench", "eval.seen=false", "eval.options.bench=geneval",
               "eval.options.seed=-1"])
    one_line_error(rc, capsys.readouterr().err, "eval.options.seed must be an integer in 0..2^40 - 1, got -1")


@pytest.mark.parametrize("option, needle", [
    ("eval.options.seed=abc", "eval.options.seed must be an integer"),  # was a ValueError traceback
    ("eval.options.batch_size=0", "eval.options.batch_size must be an integer >= 1"),
    ("eval.seeds_per_prompt=101", "eval.seeds_per_prompt must be at most 100"),
])
def test_the_bench_evaluators_drawing_options(cli_run_dir, option, needle, capsys):
    rc = main(["eval", str(cli_run_dir), "eval.evaluator=bench", "eval.seen=false", "eval.options.bench=geneval",
               option])
    one_line_error(rc, capsys.readouterr().err, needle)


@pytest.mark.parametrize("flag, value, needle", [
    ("--n", "100000000", "--n must be in 1..1024"),  # ran on for hours
    ("--prompts", "100000000", "--prompts must be in 1..4096"),
    ("--steps", "0", "--steps must be in 1..1000"),  # was a traceback
    ("--threshold", "nan", "--threshold is a cosine similarity: it must be in -1..1, got nan"),  # was accepted
    ("--threads", "-1", "--threads must be in 0.."),  # was a traceback
    ("--threads", "100000", "--threads must be in 0.."),  # was SIGSEGV
])
def test_shapes_probe_flags(flag, value, needle, tmp_path, capsys):
    rc = main(["shapes", "probe", "--out", str(tmp_path / "p"), flag, value])
    one_line_error(rc, capsys.readouterr().err, needle)
    assert not (tmp_path / "p").exists()


def test_shapes_probe_output_paths(tmp_path, capsys):
    (tmp_path / "f").write_text("keep")
    one_line_error(main(["shapes", "probe", "--out", str(tmp_path / "f")]), capsys.readouterr().err, "is a file")
    one_line_error(main(["shapes", "probe", "--json", str(tmp_path)]), capsys.readouterr().err, "is a folder")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("argv, needle", [
    (["--within", "nan"], "--within must be a finite accuracy difference >= 0, got nan"),  # was accepted
    (["--within", "-1"], "--within must be a finite accuracy difference >= 0"),
])
def test_compare_within(cli_run_dir, argv, needle, capsys):
    one_line_error(main(["compare", str(cli_run_dir), *argv]), capsys.readouterr().err, needle)


def test_compare_output_paths(cli_run_dir, tmp_path, capsys):
    (tmp_path / "f").write_text("keep")  # both were tracebacks (FileExistsError, IsADirectoryError)
    one_line_error(main(["compare", str(cli_run_dir), "--out", str(tmp_path / "f")]), capsys.readouterr().err,
                   "is a file")
    one_line_error(main(["compare", str(cli_run_dir), "--json", str(tmp_path)]), capsys.readouterr().err,
                   "is a folder")
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.parametrize("argv, needle", [
    (["write-pipeline", "--recipe", "sd35-medium", "--num-layers", "100000"],
     "--num-layers must be in 1..24 (the real depth of sd35-medium"),  # ran on for hours
    (["write-pipeline", "--recipe", "z-image", "--num-layers", "31"], "--num-layers must be in 1..30"),  # n_layers
    (["write-pipeline", "--recipe", "sd35-medium", "--num-layers", "-1"], "--num-layers must be in 1..24"),
    (["write-pipeline", "--recipe", "sd35-medium", "--seed", "-1"], "--seed must be in 0..2^63-1"),
    (["lora-layers", "--recipe", "sd35-medium", "--rank", "-1"], "--rank must be >= 0"),  # was a peft traceback
])
def test_realsize_flags(argv, needle, tmp_path, capsys):
    extra = ["--out", str(tmp_path / "p")] if argv[0] == "write-pipeline" else []
    one_line_error(main(["realsize", *argv, *extra]), capsys.readouterr().err, needle)
    assert not (tmp_path / "p").exists()


def test_realsize_lora_layers_json(tmp_path, capsys):
    one_line_error(main(["realsize", "lora-layers", "--recipe", "sd35-medium", "--json", str(tmp_path)]),
                   capsys.readouterr().err, "is a folder")  # was an IsADirectoryError traceback
    assert main(["realsize", "lora-layers", "--recipe", "sd35-medium", "--rank", "4",
                 "--json", str(tmp_path / "l.json")]) == 0
    import json

    counts = json.loads((tmp_path / "l.json").read_text())
    assert counts["rank"] == 4 and counts["wrapped"] > 0


@pytest.mark.parametrize("flag, value, needle", [
    ("--images-per-prompt", "100000000", "--images-per-prompt must be at most 100"),  # hung listing the files
    ("--workers", "100000", "--workers must be at most 1024"),
    ("--retries", "100000000", "--retries must be at most 100"),
    ("--max-response-mb", "inf", "--max-response-mb must be a finite number of MiB > 0, got inf"),  # OverflowError
    ("--max-response-mb", "nan", "--max-response-mb must be a finite number of MiB > 0"),  # was checked after the folder
])
def test_unigenbench_score_bounds(flag, value, needle, tmp_path, capsys):
    rc = main(["unigenbench", "score", str(tmp_path), "--set", "en", "--judge-url", "http://127.0.0.1:9/v1",
               "--limit", "1", "--quiet", "--out", str(tmp_path / "res"), flag, value])
    one_line_error(rc, capsys.readouterr().err, needle)
    assert not (tmp_path / "res").exists()


def test_unigenbench_generate_guidance_and_out(tmp_path, capsys):
    base = ["unigenbench", "generate", "--model", "sd3-tiny", "--set", "en", "--limit", "1", "--quiet"]
    one_line_error(main([*base, "--out", str(tmp_path / "g"), "--guidance", "nan"]), capsys.readouterr().err,
                   "--guidance must be a finite number >= 0, got nan")  # drew NaN images, exit 0
    assert not (tmp_path / "g").exists()
    (tmp_path / "f").write_text("keep")
    one_line_error(main([*base, "--out", str(tmp_path / "f")]), capsys.readouterr().err, "is a file")  # traceback
    assert (tmp_path / "f").read_text() == "keep"


def test_unigenbench_compare_json_is_checked_before_reading(tmp_path, capsys):
    one_line_error(main(["unigenbench", "compare", str(tmp_path), str(tmp_path), "--json", str(tmp_path)]),
                   capsys.readouterr().err, "--json", "is a folder")


def test_eval_and_export_import_nothing_a_shared_runs_config_names(cli_run_dir, tmp_path, capsys):
    """A downloaded run's config.yaml may name import paths; only `train --resume` builds (imports) them."""
    import shutil

    import yaml

    run = tmp_path / "shared"
    shutil.copytree(cli_run_dir, run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["advantage"]["estimator"] = "flowgrpo_no_such_module_xyz:estimator"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["eval", str(run), "eval.num_prompts=2", "eval.seeds_per_prompt=1"]) == 0
    assert main(["export", str(run), "--to", str(tmp_path / "exported")]) == 0
    capsys.readouterr()
    one_line_error(main(["train", "--resume", str(run)]), capsys.readouterr().err,
                   "flowgrpo_no_such_module_xyz")  # resuming rebuilds the run, so it imports (and says so)


# --------------------------------------------------------------------------- the Python API, misused


def test_api_misuse_is_a_type_error_that_says_what_was_wanted():
    import flowgrpo

    with pytest.raises(TypeError, match=r"overrides is a list of 'key.sub=value' strings.*wrap it: \['train.lr=1'\]"):
        flowgrpo.load_config(overrides="train.lr=1")  # was read character by character: "override 't' ..."
    with pytest.raises(TypeError, match="a Trainer is built from a flowgrpo.RunConfig"):
        flowgrpo.Trainer(None)  # was an AttributeError deep inside
    with pytest.raises(TypeError, match=r"train\(resume=...\) is a folder path, got int"):
        flowgrpo.train(resume=123)  # was a pathlib TypeError
    with pytest.raises(TypeError, match="takes \\(\\); a reward is called as \\(images, prompts"):
        flowgrpo.CallableReward(lambda: 1.0)  # was accepted, and failed at the first scoring


def test_a_reward_that_names_the_keywords_it_is_given_is_accepted():
    import flowgrpo

    def with_groups(images, prompts, groups):  # groups passed by keyword, so a required one is fine
        return [0.0] * len(prompts)

    out = flowgrpo.CallableReward(with_groups)(torch.zeros(2, 3, 4, 4), ["a", "b"], groups=torch.tensor([0, 0]))
    assert out.scores.shape == (2,)


def test_one_callback_alone_is_taken_and_a_non_iterable_refused():
    from flowgrpo.callbacks import CallbackList

    seen = []
    callbacks = CallbackList(lambda trainer, metrics: seen.append(metrics["iteration"]))  # was "'function' not iterable"
    callbacks.iteration_end(None, {"iteration": 3})
    assert seen == [3]
    with pytest.raises(TypeError, match="callbacks is a list of flowgrpo.Callback s or functions"):
        CallbackList(1)


# --------------------------------------------------------------------------- the diffusers plug-in, misused


@pytest.fixture(scope="module")
def sd3_pipe():
    from flowgrpo.policies.tiny.sd3 import tiny_sd3_pipeline

    return tiny_sd3_pipeline()


@pytest.mark.parametrize("prompts, kwargs, error, needle", [
    ([], {}, ValueError, "no prompts given"),  # was an IndexError inside the pipeline
    (5, {}, TypeError, "prompts is a string or a list of strings, got int"),
    ("a", {"num_inference_steps": 0}, ValueError, "num_inference_steps=0 is invalid"),  # IndexError
    ("a", {"num_inference_steps": 2.5}, ValueError, "num_inference_steps=2.5 is invalid"),
    ("a", {"scheduler_options": {"noise_levle": 0.7}}, ValueError, "FlowGRPOScheduler has no option 'noise_levle'"),
    ("a", {"scheduler_options": 5}, TypeError, "scheduler_options is a dict"),
    ("a", {"generator": 5}, TypeError, "generator is a torch.Generator"),  # was an AttributeError
    ("a", {"guidance_scale": float("nan")}, ValueError, "guidance_scale=nan is not a finite number"),  # NaN latents
])
def test_rollout_refuses_bad_arguments_before_calling_the_pipeline(sd3_pipe, prompts, kwargs, error, needle):
    from flowgrpo.diffusers import rollout

    kwargs = {"num_inference_steps": 2, **kwargs}
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)")):
        rollout(sd3_pipe, prompts, height=32, width=32, **kwargs)


def test_rollout_and_ensure_name_a_non_pipeline():
    from flowgrpo.diffusers import ensure_flowgrpo_scheduler, rollout

    for call in (lambda: rollout(None, "a"), lambda: ensure_flowgrpo_scheduler(object())):
        with pytest.raises(TypeError, match="a diffusers pipeline with a scheduler is wanted"):
            call()


# --------------------------------------------------------------------------- YAML and JSON from outside


def _alias_bomb(indent: str = "") -> str:
    """Ten levels of ten references each: 10^10 values once expanded, a few hundred bytes written."""
    lines = [f'{indent}a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"{indent}a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n"


def test_a_config_file_alias_bomb_is_refused_in_one_line(tmp_path, capsys):
    """It was accepted, and the run hung writing its config.yaml (dataclasses.asdict expands aliases)."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("eval:\n  options:\n" + _alias_bomb("    "))
    rc = main(["train", "--config", str(bomb), f"log.out_dir={tmp_path / 'runs'}"])
    one_line_error(rc, capsys.readouterr().err, "holds more than 100,000 values once its aliases")
    assert not (tmp_path / "runs").exists()


def test_aliases_of_a_sane_size_still_work():
    from flowgrpo.text_inputs import expanded_size, load_yaml

    data = load_yaml("x: &x [1, 2, 3]\ny: *x\nz: [*x, *x]\n", "t")
    assert data["y"] == [1, 2, 3] and expanded_size(data) == 1 + 3 + 4 + 4 + (1 + 4 + 4)  # root, keys, x, y, z
    cfg = load_config(overrides=["eval.options={a: &x [1, 2], b: *x}"])
    assert cfg.eval.options == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("where", ["file", "override"])
def test_nesting_too_deep_for_the_parser_is_one_line(where, tmp_path, capsys):
    deep = "[" * 20_000 + "]" * 20_000  # was a RecursionError traceback from PyYAML's composer
    if where == "file":
        (tmp_path / "deep.yaml").write_text(f"eval:\n  options: {{a: {deep}}}\n")
        argv = ["config", "show", "--config", str(tmp_path / "deep.yaml")]
    else:
        argv = ["config", "show", f"eval.options={{a: {deep}}}"]
    one_line_error(main(argv), capsys.readouterr().err, "nests too deeply to be read")


def test_a_shared_runs_config_yaml_bomb_is_refused_by_eval(cli_run_dir, tmp_path, capsys):
    import shutil

    run = tmp_path / "shared"
    shutil.copytree(cli_run_dir, run)
    with (run / "config.yaml").open("a") as fh:
        fh.write("_bomb:\n" + _alias_bomb("  "))
    one_line_error(main(["eval", str(run)]), capsys.readouterr().err, "config.yaml cannot be read as YAML (holds more than 100,000 values")


def test_json_nested_too_deeply_is_the_readers_own_one_line_error(cli_run_dir, tmp_path, capsys):
    import shutil

    deep = "[" * 100_000 + "]" * 100_000  # each was a RecursionError traceback from json.loads
    prompts = tmp_path / "deep.jsonl"
    prompts.write_text('{"prompt": ' + deep + "}\n")
    one_line_error(main(["train", f"data.prompts={prompts}", f"log.out_dir={tmp_path / 'runs'}"]),
                   capsys.readouterr().err, "deep.jsonl:1: malformed JSON line (nested too deeply")
    run = tmp_path / "shared"
    shutil.copytree(cli_run_dir, run)
    (run / "summary.json").write_text(deep)
    one_line_error(main(["compare", str(run)]), capsys.readouterr().err, "cannot read its evaluations: nested too deeply")
