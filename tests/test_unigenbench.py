"""`flowgrpo unigenbench` against a deterministic fake OpenAI-compatible judge on loopback.

* the shipped prompt files parse, their malformed row is reported (file, line, index, what);
* the judge question is the official layout, the answer parser is strict;
* a small fixture scored through 500 / malformed / wrong-length / slow answers gives the summary
  computed by hand below; the leaderboard CSV, chart and report.html are written;
* a `score` subprocess killed half-way (SIGKILL) and resumed gives the uninterrupted summary, and
  the judge answered every image exactly once;
* generation from a trained tiny SD3 LoRA run resumes (only missing and truncated PNGs are made
  again, identically) and differs from the base model; `compare`; the training evaluator.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import cli_env, flowgrpo_command  # noqa: E402

from flowgrpo.cli import main  # noqa: E402
from flowgrpo.errors import ConfigError  # noqa: E402
from flowgrpo.serve import free_port  # noqa: E402
from flowgrpo.unigenbench.fake_judge import FakeJudge, default_scores, format_answer, level_of, running  # noqa: E402
from flowgrpo.unigenbench.prompts import load_prompt_set, read_prompt_file  # noqa: E402
from flowgrpo.unigenbench.protocol import judge_messages, judge_text, jpeg_data_url, parse_answer  # noqa: E402
from flowgrpo.unigenbench.score import JudgeOptions, score_folder  # noqa: E402

HEADER = "index,prompt_en,sub_dims_en\n"


def dims(testpoints, descriptions) -> str:
    body = json.dumps({"Primary Categories": "Art", "Testpoints": testpoints, "Testpoint Description": descriptions})
    return '"' + body.replace('"', '""') + '"'


def flat_images(folder: Path, indices, per_prompt: int) -> None:
    """Image j of each prompt in flat grey level_of(j): the fake judge reads j back from it."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in indices:
        for j in range(per_prompt):
            Image.new("RGB", (32, 32), (level_of(j),) * 3).save(folder / f"{i}_{j}.png")


def without_run_stats(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if k != "this_run"}


# --------------------------------------------------------------------------- prompt files and protocol


def test_shipped_csvs_parse_and_report_the_malformed_row(capsys):
    counts = {name: len(load_prompt_set(name).prompts) for name in ("en", "zh", "en_long", "zh_long")}
    assert counts == {"en": 600, "zh": 600, "en_long": 599, "zh_long": 600}
    problems = {name: [str(p) for p in load_prompt_set(name).problems] for name in counts}
    assert problems["en"] == problems["zh"] == problems["zh_long"] == []
    assert problems["en_long"] == ["test_prompts_en_long.csv:511 (index 509): sub_dims_en is not valid JSON "
                                   "(Expecting ',' delimiter at character 223); row skipped"]
    zh = load_prompt_set("zh").prompts[0]
    assert zh.testpoints == ("风格", "世界知识", "属性-数量") and zh.descriptions[2] == "两只熊猫"
    assert main(["unigenbench", "check"]) == 0
    out = capsys.readouterr().out
    assert "test_prompts_en_long.csv: set en_long (en), 599 prompts" in out and "1 malformed rows" in out


def test_malformed_rows_are_reported_and_skipped(tmp_path):
    rows = [
        f"0,a red cube,{dims(['Attribute - Color'], ['red'])}",
        '1,bad json,"{""Testpoints"": [""Style"" ""World Knowledge""]}"',
        f"2,lengths differ,{dims(['Style', 'World Knowledge'], ['ink'])}",
        f"3,unknown checkpoint,{dims(['Vibes'], ['good'])}",
        f"x,index not a number,{dims(['Style'], ['ink'])}",
        f"0,duplicate index,{dims(['Style'], ['ink'])}",
        f"5, ,{dims(['Style'], ['ink'])}",
        "6,too few cells",
        f'7,"a prompt\nover two lines",{dims(["Style"], ["ink"])}',
    ]
    path = tmp_path / "newer.csv"
    path.write_text(HEADER + "\n".join(rows) + "\n", encoding="utf-8")
    ps = read_prompt_file(path)
    assert [p.index for p in ps.prompts] == [0, 7] and ps.language == "en"
    got = [(p.line, p.index, p.problem.split(" (")[0]) for p in ps.problems]
    assert got == [(3, "1", "sub_dims_en is not valid JSON"),
                   (4, "2", "sub_dims_en: 'Testpoint Description' must be a list of strings as long as 'Testpoints'"),
                   (5, "3", "checkpoint 'Vibes' has no definition in the en judge protocol"),
                   (6, "x", "index 'x' is not an integer"),
                   (7, "0", "index 0 appears more than once"),
                   (8, "5", "prompt_en is empty"),
                   (9, "6", "2 cells where the header has 3")]
    assert str(ps.problems[0]).startswith("newer.csv:3 (index 1): sub_dims_en is not valid JSON")
    assert main(["unigenbench", "check", "--set", "zh", "--csv", str(path)]) == 2  # English file for a Chinese set


def test_judge_question_is_the_official_layout_and_parser_is_strict():
    p = load_prompt_set("en").prompts[0]
    text = judge_text("en", p.prompt, list(p.testpoints), list(p.descriptions))
    assert text.startswith("You are a precise and objective English-language image description system.")
    assert ("from the angles specified in ['Style', 'World Knowledge', 'Attribute - Quantity']. Detailed definitions "
            "of these checkpoints are provided here: Checkpoints Defination:「\nStyle: Art, painting, photography, "
            "design styles, and corresponding artist names\nWorld Knowledge: Covers") in text
    assert "Checkpoints Description:「\nStyle: classical ink painting\nWorld Knowledge: Egyptian pyramids\n" \
           "Attribute - Quantity: two pandas\n」. You must analyze" in text
    assert text.endswith("</score>\n            </description>\n            ")
    z = load_prompt_set("zh").prompts[0]
    zt = judge_text("zh", z.prompt, list(z.testpoints), list(z.descriptions))
    assert "你需要根据['风格', '世界知识', '属性-数量']中的这些角度" in zt and "考点说明：「\n风格: 艺术" in zt
    assert "考点描述说明：「\n风格: 古典水墨画风格\n世界知识: 埃及金字塔\n属性-数量: 两只熊猫\n」, 你需要" in zt
    braces = judge_text("en", "a {testpoints} sign", ["Text Generation"], ["{prompt}"])
    assert "「a {testpoints} sign」" in braces and "Text Generation: {prompt}\n」" in braces
    msg = judge_messages(jpeg_data_url(Image.new("RGB", (8, 8), (9, 9, 9))), "question")
    parts = msg[0]["content"]
    assert msg[0]["role"] == "user" and [q["type"] for q in parts] == ["image_url", "text"]
    assert parts[0]["image_url"]["url"].startswith("data:image/jpeg;base64,/9j/")  # JPEG (FF D8 FF)
    good = format_answer("p", ["Style", "World Knowledge"], [1, 0])
    assert parse_answer(good, 2).scores == (1, 0) and len(parse_answer(good, 2).analysis) == 2
    assert parse_answer("```xml\n<analysis>['a', \"b\"]</analysis>\n<score>['1', 0.0]</score>```", 2).scores == (1, 0)
    for bad in (good.replace("[1, 0]", "[1, 2]"), good.replace("</score>", ""), "no tags at all",
                "<analysis>['a']</analysis><score>[1]</score>", "<analysis>[x]</analysis><score>[1, 0]</score>"):
        assert parse_answer(bad, 2) is None, bad
    assert parse_answer(good, 3) is None  # wrong length


# --------------------------------------------------------------------------- scoring against the fake judge

FIXTURE = [  # index, prompt, checkpoints, descriptions
    (0, "a red cube on a blue table", ["Attribute - Color", "Entity Layout - Three-Dimensional Space"],
     ["red cube, blue table", "cube on the table"]),
    (1, "two cats in the style of Van Gogh", ["Attribute - Quantity", "Style"], ["two cats", "Van Gogh"]),
    (2, "a shop sign that says OPEN, with no people", ["Text Generation", "Grammar - Negation", "Attribute - Color"],
     ["OPEN", "no people", "shop sign"]),
]
VERDICTS = {(0, 0): [1, 1], (0, 1): [1, 0], (1, 0): [0, 1], (1, 1): [1, 1], (2, 0): [1, 0, 1], (2, 1): [0, 1, 1]}
PLAN = {(0, 1): ["malformed", "ok"], (1, 0): ["short", "500", "ok"], (1, 1): ["slow", "ok"], (2, 0): ["500"]}
# By hand, over the five images with a verdict ((2, 0) answers HTTP 500 to all 4 attempts: failed, left out):
#   Attribute - Color: (0,0) 1, (0,1) 1, (2,1) 1 -> 3/3     Entity Layout - 3D: (0,0) 1, (0,1) 0 -> 1/2
#   Attribute - Quantity: (1,0) 0, (1,1) 1 -> 1/2           Style: (1,0) 1, (1,1) 1 -> 2/2
#   Text Generation: (2,1) 0 -> 0/1                          Grammar - Negation: (2,1) 1 -> 1/1
#   primary: Attribute 4/5, Entity Layout 1/2, Style 2/2, Text Generation 0/1, Grammar 1/1
#   overall = (0.8 + 0.5 + 1 + 0 + 1) / 5 = 0.66; checkpoints 2 + 2 + 2 + 2 + 3 = 11
EXPECTED = {
    "set": "en", "judge_model": "fake-judge", "images": 6, "failed": 1, "overall": 0.66,
    "primary": {"Style": 1.0, "Attribute": 0.8, "Grammar": 1.0, "Entity Layout": 0.5, "Text Generation": 0.0},
    "sub": {"Style": 1.0, "Attribute - Quantity": 0.5, "Attribute - Color": 1.0, "Grammar - Negation": 1.0,
            "Entity Layout - Three-Dimensional Space": 0.5, "Text Generation": 0.0},
    "checkpoints": 11, "missing_images": 0, "skipped_rows": 1,
    "counts": {"primary": {"Style": [2, 2], "Attribute": [4, 5], "Grammar": [1, 1], "Entity Layout": [1, 2],
                           "Text Generation": [0, 1]},
               "sub": {"Style": [2, 2], "Attribute - Quantity": [1, 2], "Attribute - Color": [3, 3],
                       "Grammar - Negation": [1, 1], "Entity Layout - Three-Dimensional Space": [1, 2],
                       "Text Generation": [0, 1]}},
}


@pytest.fixture(scope="module")
def fixture_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("ugb_fixture")
    rows = [f'{i},"{text}",{dims(tps, descs)}' for i, text, tps, descs in FIXTURE] + ['3,broken,"{not json"']
    (root / "fixture.csv").write_text(HEADER + "\n".join(rows) + "\n", encoding="utf-8")
    flat_images(root / "images", [0, 1, 2], 2)
    return load_prompt_set("en", root / "fixture.csv"), root


def test_summary_equals_hand_computed_fixture(fixture_set, tmp_path):
    ps, root = fixture_set
    index = {text: i for i, text, _, _ in FIXTURE}
    plan = {(FIXTURE[i][1], j): steps for (i, j), steps in PLAN.items()}
    judge = FakeJudge(scores=lambda prompt, j, tps: VERDICTS[(index[prompt], j)], plan=plan, slow_seconds=5.0)
    opts = JudgeOptions(url="", model="fake-judge", workers=4, timeout=2.0, retries=3, backoff=0.01)
    with running(judge) as url:
        opts.url = url.removesuffix("/v1")  # a bare host:port gets /v1
        summary = score_folder(root / "images", ps, tmp_path / "res", opts, images_per_prompt=2, progress=False)
    got = without_run_stats(summary)
    assert got["overall"] == pytest.approx(EXPECTED["overall"]) and {**got, "overall": 0} == {**EXPECTED, "overall": 0}
    assert list(got["primary"]) == list(EXPECTED["primary"]) and list(got["sub"]) == list(EXPECTED["sub"])  # board order
    assert summary["this_run"]["judged"] == 6 and summary["this_run"]["requests"] == 13
    # one request per fine image, one per failed attempt; the failed image used all 1 + 3 attempts
    received = {(index[p], j): n for (p, j), n in judge.received.items()}
    assert received == {(0, 0): 1, (0, 1): 2, (1, 0): 3, (1, 1): 2, (2, 0): 4, (2, 1): 1}
    records = [json.loads(line) for line in (tmp_path / "res" / "judgements.jsonl").read_text().splitlines()]
    failed = [r for r in records if not r["ok"]]
    assert len(records) == 6 and [(r["key"], r["error"], r["attempts"]) for r in failed] == [("2_0", "HTTP 500", 4)]
    assert json.loads((tmp_path / "res" / "summary.json").read_text()) == summary
    header, values = (tmp_path / "res" / "scores.csv").read_text(encoding="utf-8-sig").splitlines()
    cols = header.split(",")
    assert cols[:8] == ["set", "judge_model", "images", "failed", "Overall", "Style", "World Knowledge", "Attribute"]
    assert cols.index("Attribute - Quantity") < cols.index("Attribute - Color") < cols.index("Action")
    assert cols[-1] == "Text Generation" and len(cols) == 5 + 10 + 23
    row = dict(zip(cols, values.split(",")))
    assert (row["Overall"], row["Attribute"], row["Entity Layout"], row["Action"]) == ("66.00", "80.00", "50.00", "")
    html = (tmp_path / "res" / "report.html").read_text(encoding="utf-8")
    assert html.count('<article class="card"') == 3 and html.count("data:image/jpeg;base64,") == 6
    assert '<select id="dim">' in html and "HTTP 500" in html and "src=\"http" not in html and "href=" not in html
    assert (tmp_path / "res" / "scores.png").stat().st_size > 10_000
    # a second run asks nothing again; --retry-failed asks the failed image only
    with running(judge) as url:
        opts.url = url
        again = score_folder(root / "images", ps, tmp_path / "res", opts, images_per_prompt=2, progress=False, report=False)
        assert again["this_run"]["requests"] == 0 and without_run_stats(again) == without_run_stats(summary)
        judge.plan.clear()
        retried = score_folder(root / "images", ps, tmp_path / "res", opts, images_per_prompt=2, retry_failed=True,
                               progress=False, report=False)
    assert retried["this_run"]["judged"] == 1 and retried["failed"] == 0 and retried["primary"]["Attribute"] == 5 / 6


def test_killed_score_run_resumes_without_repeating_a_request(tmp_path):
    ps = load_prompt_set("en")
    prompts = ps.prompts[:10]
    flat_images(tmp_path / "images", [p.index for p in prompts], 4)
    judge = FakeJudge()
    judge.gate(15)  # 15 answers get out; then the judge holds every request until the gate opens
    log = tmp_path / "res" / "judgements.jsonl"
    with running(judge) as url:
        proc = subprocess.Popen(flowgrpo_command() + ["unigenbench", "score", str(tmp_path / "images"), "--set", "en",
                                                      "--judge-url", url, "--limit", "10", "--workers", "4", "--out",
                                                      str(tmp_path / "res"), "--quiet", "--judge-model", "fake"],
                                env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.time() + 120
            while time.time() < deadline and proc.poll() is None:
                if log.is_file() and len(log.read_text().splitlines()) == 15 and judge.waiting == 4:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, proc.communicate()[0]
            assert len(log.read_text().splitlines()) == 15
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        deadline = time.time() + 30
        while judge.waiting and time.time() < deadline:  # the held requests notice their client is gone
            time.sleep(0.05)
        assert judge.waiting == 0 and not (tmp_path / "res" / "summary.json").exists()
        assert sum(judge.received.values()) == 15 + 4 and sum(judge.answered.values()) == 15
        judge.open_gate()
        resumed = score_folder(tmp_path / "images", ps, tmp_path / "res", JudgeOptions(url, model="fake", workers=4),
                               limit=10, progress=False, report=False)
    assert resumed["this_run"]["judged"] == 25
    assert len(judge.answered) == 40 and set(judge.answered.values()) == {1}  # every image answered exactly once
    reference = FakeJudge()
    with running(reference) as url:
        whole = score_folder(tmp_path / "images", ps, tmp_path / "whole", JudgeOptions(url, model="fake", workers=4),
                             limit=10, progress=False, report=False)
    assert without_run_stats(resumed) == without_run_stats(whole) and whole["images"] == 40 and whole["failed"] == 0
    want = [s for p in prompts for j in range(4) for s in default_scores(p.prompt, j, list(p.testpoints))]
    assert whole["checkpoints"] == len(want) and sum(c for c, _ in whole["counts"]["sub"].values()) == sum(want)


def test_score_errors_are_one_line(tmp_path, capsys):
    flat_images(tmp_path / "images", [0], 1)
    assert main(["unigenbench", "score", str(tmp_path / "nowhere"), "--set", "en", "--judge-url", "http://127.0.0.1:9"]) == 2
    assert main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en", "--judge-url", "ftp://x"]) == 2
    assert main(["unigenbench", "score", str(tmp_path), "--set", "zh", "--judge-url", "http://127.0.0.1:9"]) == 2
    closed = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    assert main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en", "--judge-url", closed, "--quiet",
                 "--out", str(tmp_path / "res")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("flowgrpo: error: ") for line in err)
    assert "does not exist" in err[0] and "not an http(s) URL" in err[1] and "holds none of the 2400 images" in err[2]
    assert f"cannot reach the judge at {closed}" in err[3]


def test_limits_and_mismatched_sets_are_refused_in_one_line(tmp_path, capsys):
    """--limit below 1 (generate made all 2400 images for 0; score took -3), and images generated for one
    set scored as another (each would be judged against another prompt's checkpoints)."""
    flat_images(tmp_path / "images", [0], 1)
    (tmp_path / "images" / "generate.json").write_text(json.dumps({"set": "en", "steps": 2}))
    url = "http://127.0.0.1:9"
    assert main(["unigenbench", "generate", "--model", "sd3-tiny", "--set", "en", "--out", str(tmp_path / "gen"),
                 "--limit", "0", "--quiet"]) == 2
    assert main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en", "--judge-url", url,
                 "--limit", "-3"]) == 2
    assert main(["unigenbench", "score", str(tmp_path / "images"), "--set", "zh", "--judge-url", url]) == 2
    assert main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en_long", "--judge-url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("flowgrpo: error: ") for line in err), err
    assert "--limit must be at least 1" in err[0] and "got 0" in err[0] and not (tmp_path / "gen").exists()
    assert "--limit must be at least 1" in err[1] and "got -3" in err[1]
    assert "generated for set 'en'" in err[2] and "not for set 'zh'" in err[2] and "--set en" in err[2]
    assert "not for set 'en_long'" in err[3]
    assert not (tmp_path / "images" / "results_zh").exists()


def test_generate_refuses_a_shapes_run_in_one_line(shapes_model_dir, tmp_path, capsys):
    from conftest import tiny_overrides

    from flowgrpo.config import load_config
    from flowgrpo.trainer.run import train

    train(load_config("shapes", None, tiny_overrides(shapes_model_dir, **{"train.iterations": 1, "log.trackers": "[]",
                                                                          "eval.evaluator": "none"})
                      + [f"log.out_dir={tmp_path}", "log.run_name=shapes"]))
    capsys.readouterr()
    for model in (str(tmp_path / "shapes"), "shapes"):
        assert main(["unigenbench", "generate", "--model", model, "--set", "en", "--out", str(tmp_path / "imgs"),
                     "--limit", "1", "--quiet"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"flowgrpo: error: {model} is a shapes-world model"), err
    assert not (tmp_path / "imgs").exists()


def test_compare_reports_per_dimension_deltas(tmp_path, capsys):
    a = {"set": "en", "judge_model": "j", "images": 4, "failed": 0, "overall": 0.5,
         "primary": {"Style": 0.5, "Attribute": 0.5}, "sub": {"Style": 0.5, "Attribute - Color": 0.5}}
    b = {**a, "overall": 0.75, "primary": {"Style": 1.0, "Attribute": 0.5}, "sub": {"Style": 1.0, "Attribute - Color": 0.5}}
    for name, s in (("A", a), ("B", b), ("Z", {**a, "set": "zh"})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    assert main(["unigenbench", "compare", str(tmp_path / "A"), str(tmp_path / "B"), "--json", str(tmp_path / "d.json")]) == 0
    rows = {r["dimension"]: r["delta"] for r in json.loads((tmp_path / "d.json").read_text())["rows"]}
    assert rows == {"Overall": 25.0, "Style": 50.0, "Attribute": 0.0, "Attribute - Color": 0.0}
    assert "+50.00" in capsys.readouterr().out
    assert main(["unigenbench", "compare", str(tmp_path / "A"), str(tmp_path / "Z")]) == 2
    assert main(["unigenbench", "compare", str(tmp_path / "A"), str(tmp_path / "nothing")]) == 2


# --------------------------------------------------------------------------- generation and the evaluator


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A one-iteration tiny SD3 LoRA run (high lr, fast EMA, so the adapter changes the images)."""
    from flowgrpo.config import load_config
    from flowgrpo.trainer.run import train

    root = tmp_path_factory.mktemp("ugb_run")
    (root / "prompts.txt").write_text("a photo of a cat\na mountain lake at dawn\n")
    train(load_config("shapes", None, [
        "model.name=sd3-tiny", "model.train_mode=lora", "model.resolution=64", "model.max_sequence_length=16",
        "model.lora_rank=4", "model.lora_alpha=8", "reward.weights={jpeg_compressibility: 1.0}",
        f"data.prompts={root / 'prompts.txt'}", "data.prompts_per_iteration=2", "data.trees_per_prompt=2",
        "sampler.num_steps=2", "sampler.strategy=flow_grpo", "train.iterations=1", "train.threads=1", "train.lr=3e-2",
        "train.ema_decay=0.5", "eval.evaluator=none", "log.progress=false", "log.grid_every=0",
        f"log.out_dir={root}", "log.run_name=run"]))
    return root / "run"


def _pixels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))}


def _record_batches(monkeypatch) -> list[list[tuple[int, int]]]:
    """The (index, j) batches generate runs from now on (its render_batches spied on)."""
    from flowgrpo.unigenbench import generate

    seen, render = [], generate.render_batches

    def spy(policy, groups, *args):
        seen.extend([[(p.index, j) for p, j in batch] for batch in groups])
        yield from render(policy, groups, *args)

    monkeypatch.setattr(generate, "render_batches", spy)
    return seen


def test_generate_resumes_and_applies_the_run_lora(lora_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run_images"
    args = ["unigenbench", "generate", "--set", "en", "--limit", "2", "--images-per-prompt", "2", "--steps", "2", "--quiet"]
    assert main(args + ["--model", str(lora_run), "--out", str(out)]) == 0
    first = _pixels(out)
    assert sorted(first) == ["0_0.png", "0_1.png", "1_0.png", "1_1.png"] and first["0_0.png"].shape == (64, 64, 3)
    settings = json.loads((out / "generate.json").read_text())
    assert settings["run"] == str(lora_run.resolve()) and settings["checkpoint"] == "ckpt_000001" and settings["steps"] == 2
    data = (out / "0_1.png").read_bytes()
    (out / "0_1.png").write_bytes(data[: len(data) // 2])  # cut short
    (out / "1_0.png").unlink()
    kept = {n: (out / n).stat().st_mtime_ns for n in ("0_0.png", "1_1.png")}
    capsys.readouterr()
    batches = _record_batches(monkeypatch)
    assert main(args + ["--model", str(lora_run), "--out", str(out)]) == 0
    assert "1 incomplete images will be made again" in capsys.readouterr().out
    assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # valid images are not written again
    # the missing images are made in the first run's batch (of --batch-size 4), run whole: a batch of
    # other images can change a pixel by one level (float sums in another order), so this is what
    # makes them equal bit for bit below
    assert batches == [[(0, 0), (0, 1), (1, 0), (1, 1)]]
    again = _pixels(out)
    assert all(np.array_equal(first[n], again[n]) for n in first)  # the same images
    (out / "1_1.png").unlink()
    batches.clear()
    assert main(args + ["--model", str(lora_run), "--out", str(out), "--batch-size", "2"]) == 0
    assert batches == [[(1, 0), (1, 1)]]  # only the batches that hold a missing image run
    base = tmp_path / "base_images"
    assert main(args + ["--model", "sd3-tiny", "--out", str(base), "model.max_sequence_length=16",
                        "model.resolution=64"]) == 0
    assert all(not np.array_equal(first[n], img) for n, img in _pixels(base).items())  # the LoRA changes every image
    assert main(args + ["--model", str(lora_run), "--out", str(base)]) == 2  # another model into the same folder
    assert "use another --out" in capsys.readouterr().err


def test_generate_passes_over_a_damaged_latest_checkpoint(lora_run, tmp_path, capsys):
    run = shutil.copytree(lora_run, tmp_path / "run")
    bad = run / "checkpoints" / "ckpt_000002" / "state.pt"
    bad.parent.mkdir()
    data = (run / "checkpoints" / "ckpt_000001" / "state.pt").read_bytes()
    bad.write_bytes(data[: len(data) // 2])  # a newer checkpoint cut short
    out = tmp_path / "images"
    assert main(["unigenbench", "generate", "--set", "en", "--limit", "1", "--images-per-prompt", "1", "--steps", "1",
                 "--quiet", "--model", str(run), "--out", str(out)]) == 0
    assert f"checkpoint {bad} is damaged" in capsys.readouterr().err
    assert json.loads((out / "generate.json").read_text())["checkpoint"] == "ckpt_000001"
    assert (out / "0_0.png").is_file()


def test_unigenbench_evaluator(tiny_policy):
    from flowgrpo.config import EvalConfig
    from flowgrpo.evaluation import build_evaluator

    def cfg(**options):
        return EvalConfig(evaluator="unigenbench", num_prompts=3, seeds_per_prompt=2, num_steps=2, seen=False,
                          options=options)

    with pytest.raises(ConfigError, match="judge_url"):
        build_evaluator(cfg(), tiny_policy)
    with pytest.raises(ConfigError, match="valid: judge_url"):
        build_evaluator(cfg(judge_url="http://127.0.0.1:9", colour="red"), tiny_policy)
    with pytest.raises(ConfigError, match="eval.seen=false"):
        build_evaluator(EvalConfig(evaluator="unigenbench", options={"judge_url": "http://127.0.0.1:9"}), tiny_policy)
    judge = FakeJudge(decode_images=False)
    with running(judge) as url:
        evaluator, _ = build_evaluator(cfg(judge_url=url, set="zh", workers=2), tiny_policy)
        res = evaluator.evaluate(tiny_policy, keep_images=True)
    assert [p.index for p in evaluator.prompts] == [0, 200, 400] and sum(judge.received.values()) == 6
    assert res.num_samples == 6 and len(res.correct) == 6 and res.images.shape == (6, 3, 4, 4)
    assert set(res.per_tag) <= {"风格", "世界知识", "属性", "动作", "关系", "复合考点", "语法", "实体布局", "逻辑推理", "文本生成"}
    assert res.accuracy == pytest.approx(sum(res.per_tag.values()) / len(res.per_tag))


def test_report_renders_in_headless_chromium(fixture_set, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium on this machine")
    ps, root = fixture_set
    with running(FakeJudge(scores=lambda p, j, tps: [1] * len(tps))) as url:
        score_folder(root / "images", ps, tmp_path, JudgeOptions(url, model="fake", workers=2), images_per_prompt=2,
                     progress=False)
    shot = tmp_path / "shot.png"
    proc = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shot}",
                           "--window-size=1200,900", (tmp_path / "report.html").as_uri()],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(tmp_path)})
    assert shot.is_file(), proc.stderr
    pixels = np.asarray(Image.open(shot).convert("L"))
    assert pixels.shape == (900, 1200) and pixels.std() > 10  # a drawn page, not a blank one


def test_package_data_ships_every_unigenbench_data_file():
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[1]
    cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert (root / "flowgrpo" / "unigenbench" / "__init__.py").exists()  # a package: setup.py finds it
    globs = cfg["package-data"]["flowgrpo.unigenbench"]
    data = sorted(p.name for p in (root / "flowgrpo" / "unigenbench" / "data").iterdir())
    assert {"LICENSE.txt", "ATTRIBUTION.md", "test_prompts_en_long.csv", "judge_zh.txt", "protocol.json"} <= set(data)
    assert [n for n in data if not any(fnmatch.fnmatch(f"data/{n}", g) for g in globs)] == []
