"""A run killed with SIGKILL and resumed with --resume ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import RUN_EXTRA, RUN_ITERATIONS, cli_env, flowgrpo_command, run_cli, tiny_overrides

TIMING_KEYS = {"train_seconds"}
KILL_AT = 3  # SIGKILL once checkpoint 3 exists


def comparable(row: dict) -> dict:
    """Every numeric field except timings (``*_s``, ``train_seconds``)."""
    return {k: v for k, v in row.items()
            if isinstance(v, (int, float)) and not k.endswith("_s") and k not in TIMING_KEYS}


def assert_same(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, float) or isinstance(b, float):
        if math.isnan(a) and math.isnan(b):
            return
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6), f"{where}: {a!r} != {b!r}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_then_resume_matches_uninterrupted_run(cli_run_dir, shapes_model_dir, tmp_path):
    out = tmp_path / "runs"
    run_dir = out / "killed"
    args = ["train", "--preset", "shapes", *tiny_overrides(shapes_model_dir, **RUN_EXTRA), f"log.out_dir={out}",
            "log.run_name=killed"]  # the same preset as conftest's cli_run_dir, which it is compared with
    target = run_dir / "checkpoints" / f"ckpt_{KILL_AT:06d}"
    with open(tmp_path / "killed.log", "w") as log:
        proc = subprocess.Popen(flowgrpo_command() + args, env=cli_env(), stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not target.exists():
                if proc.poll() is not None:
                    pytest.fail(f"the run ended (rc {proc.returncode}) before checkpoint {KILL_AT}:\n"
                                + (tmp_path / "killed.log").read_text())
                assert time.monotonic() < deadline, "no checkpoint within 300 s"
                time.sleep(0.02)
            assert proc.poll() is None, "the run finished before it could be killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "summary.json").exists()  # it really died mid-run
    killed_rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert len(killed_rows) < RUN_ITERATIONS

    res = run_cli(["train", "--resume", str(run_dir)])
    assert res.returncode == 0, f"resume failed ({res.returncode}):\n{res.stdout}\n{res.stderr}"
    assert "resumed from" in res.stdout

    resumed = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    full = [json.loads(ln) for ln in (cli_run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    assert [r["iteration"] for r in resumed] == list(range(RUN_ITERATIONS))  # no duplicated or lost rows
    assert len(full) == RUN_ITERATIONS
    # the comparison is meaningful: the weights moved every iteration
    assert all(r["grad_norm"] > 0 and r["transitions"] > 0 for r in full)
    for a, b in zip(resumed, full):
        assert_same(comparable(a), comparable(b), f"metrics[iteration {b['iteration']}]")

    s_res = json.loads((run_dir / "summary.json").read_text())
    s_full = json.loads((cli_run_dir / "summary.json").read_text())
    assert s_res["iterations"] == s_full["iterations"] == RUN_ITERATIONS
    assert_same(s_res["eval_after"], s_full["eval_after"], "eval_after")
    assert_same(s_res["eval_before"], s_full["eval_before"], "eval_before")
    assert_same(comparable(s_res["final_metrics"]), comparable(s_full["final_metrics"]), "final_metrics")
    assert s_res["nan_rewards_dropped"] == s_full["nan_rewards_dropped"]

    # the final weights themselves: adapter, EMA and optimizer moments
    from flowgrpo.trainer.checkpoint import latest_checkpoint, load_checkpoint

    ck_res, ck_full = latest_checkpoint(run_dir), latest_checkpoint(cli_run_dir)
    assert ck_res.name == ck_full.name == f"ckpt_{RUN_ITERATIONS:06d}"
    t_res, t_full = load_checkpoint(ck_res)["trainer"], load_checkpoint(ck_full)["trainer"]
    assert t_res["iteration"] == t_full["iteration"] == RUN_ITERATIONS
    for part in ("trainable", "ema"):
        assert t_res[part].keys() == t_full[part].keys()
        for k in t_full[part]:
            torch.testing.assert_close(t_res[part][k], t_full[part][k], rtol=1e-6, atol=1e-7, msg=f"{part}.{k}")
    for k, st in t_full["optimizer"]["state"].items():
        for name, value in st.items():
            torch.testing.assert_close(t_res["optimizer"]["state"][k][name], value, rtol=1e-6, atol=1e-9)
