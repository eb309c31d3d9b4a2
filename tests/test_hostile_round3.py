"""Issue 43, hostile inputs found by this project's own probing after the second round passed:
answers a reward server or a judge should never send, and config values that crashed the trainer.

* a reward server answering ``Infinity``, ``NaN``, ``1e400`` or a score beyond float32 (``1e39``):
  refused as a malformed answer in one line. Before, ``Infinity`` and ``1e39`` became inf and the
  sample was silently dropped as if it had failed; ``null`` stays the protocol's failed sample;
* an answer nested 100,000 brackets deep: one line (was a RecursionError traceback);
* a 307 redirect: one line naming the status and the address, not followed (the request may carry
  a bearer token), and not retried;
* ``train.seed=-5`` and ``2**70`` (tracebacks from numpy and torch), ``train.threads=100000`` (SIGSEGV
  in torch), ``sampler.num_steps=1000000`` (2 GiB in two minutes, growing): refused at config time;
* ``data.trees_per_prompt=100000000`` (24 GiB, then SIGKILL), ``data.prompts_per_iteration`` and the
  evaluation's sizes likewise: refused before the run folder exists when the rollout's latents or the
  evaluation's images alone exceed the machine's memory;
* ``model.lora_rank=100000000`` (a 51 GB allocation, a traceback): refused when the LoRA's weights
  alone exceed the machine's memory; ``reward.waves=100000000`` (a hang): as many waves as groups.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("httpx")

from conftest import tiny_overrides  # noqa: E402
from test_cli_errors import one_line_error  # noqa: E402
from test_hostile_http import IMAGES, RawHTTP, chat, head  # noqa: E402

from flowgrpo.cli import main  # noqa: E402

from flowgrpo.config import load_config  # noqa: E402
from flowgrpo.config.validation import validate  # noqa: E402
from flowgrpo.errors import ConfigError, UserError  # noqa: E402
from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.http_client import Reply  # noqa: E402
from flowgrpo.rewards.openai_client import JudgeEndpointError  # noqa: E402
from flowgrpo.rewards.remote import RemoteReward  # noqa: E402
from flowgrpo.rewards.wire import parse_floats  # noqa: E402


def answer_with(body: bytes):
    """A RawHTTP answer: 200 with ``body`` as JSON."""
    return lambda method, path, n: [head(length=len(body)) + body]


# --------------------------------------------------------------------------- strict JSON and scores


@pytest.mark.parametrize("text", [b"[NaN]", b"[Infinity]", b'{"scores": [-Infinity, 1]}'])
def test_nan_and_infinity_are_not_json(text):
    with pytest.raises(ValueError, match="is not JSON"):
        Reply(200, {}, text).json()


def test_deep_nesting_is_a_value_error_not_a_recursion_error():
    with pytest.raises(ValueError, match="nests too deeply"):
        Reply(200, {}, b"[" * 100_000 + b"]" * 100_000).json()
    assert Reply(200, {}, b'{"scores": [0.5, null]}').json() == {"scores": [0.5, None]}


@pytest.mark.parametrize("value", [1e39, -1e39, float("inf"), 10**400])
def test_a_score_that_is_no_finite_float32_is_refused(value):
    with pytest.raises(ValueError, match="scores holds a number"):
        parse_floats([0.5, value], 2, "scores")


def test_null_stays_the_failed_sample_and_float32_extremes_pass():
    out = parse_floats([None, 3.0e38, -1], 3, "scores")
    assert torch.isnan(out[0]) and out[1].item() == pytest.approx(3.0e38) and out[2].item() == -1


@pytest.mark.parametrize("body, needle", [
    (b'{"scores": [Infinity, 0.5]}', "Infinity is not JSON"),
    (b'{"scores": [NaN, 0.5]}', "NaN is not JSON"),
    (b'{"scores": [1e400, 0.5]}', "scores holds a number that is not a finite float32"),
    (b'{"scores": [1e39, 0.5]}', "scores holds a number that is not a finite float32"),
    (b'{"scores": [0.5, 0.5], "components": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests too deeply"),
])
def test_a_reward_server_answering_no_finite_scores_is_named_in_one_line(body, needle):
    with RawHTTP(answer_with(body)) as srv:
        remote = RemoteReward(srv.url, retries=2, backoff=0.01)
        with pytest.raises(UserError) as err:
            remote(IMAGES, ["a", "b"])
        remote.close()
    assert needle in str(err.value) and srv.url in str(err.value) and "\n" not in str(err.value)
    assert srv.requests == 1  # a malformed answer is not retried


# --------------------------------------------------------------------------- redirects


def redirect(method, path, n):
    yield head("307 Temporary Redirect", "Location: http://127.0.0.1:9/elsewhere", length=0)


def test_a_reward_servers_redirect_is_named_and_not_followed(monkeypatch):
    monkeypatch.setenv("HOSTILE_TOKEN", "secret")
    with RawHTTP(redirect) as srv:
        remote = RemoteReward(srv.url, token_env="HOSTILE_TOKEN", retries=2, backoff=0.01)
        with pytest.raises(UserError, match=r"answered HTTP 307, a redirect to http://127\.0\.0\.1:9/elsewhere, "
                                            r"which is not followed.*reward\.options\.remote\.url"):
            remote(IMAGES, ["a", "b"])
        remote.close()
    assert srv.requests == 1


def test_a_judges_redirect_stops_the_judge_in_one_line():
    with RawHTTP(redirect) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", retries=2, backoff=0.01)
        with pytest.raises(JudgeEndpointError, match="answered HTTP 307, a redirect to .*not followed"):
            judge(IMAGES[:1], ["a"])
        judge.close()
    assert srv.requests == 1


def test_a_judge_still_reads_an_ordinary_answer():
    with RawHTTP(lambda method, path, n: [chat("Score: 7")]) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", retries=0)
        assert judge(IMAGES[:1], ["a"]).scores.tolist() == [pytest.approx(0.7)]
        judge.close()


# --------------------------------------------------------------------------- seeds and threads


@pytest.mark.parametrize("seed", [-5, 2**63, 2**70])
def test_a_seed_outside_torchs_range_is_refused_at_config_time(seed):
    with pytest.raises(ConfigError, match=r"'train.seed' must be >= 0 and <= 9223372036854775807"):
        load_config("shapes", None, [f"train.seed={seed}"])


def test_the_largest_seed_is_kept():
    assert load_config("shapes", None, [f"train.seed={2**63 - 1}"]).train.seed == 2**63 - 1


def test_more_threads_than_cpus_are_refused_for_training_only(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    assert load_config("shapes", None, ["train.threads=4"]).train.threads == 4
    with pytest.raises(ConfigError, match=r"'train.threads' = 100000 is more than this machine's 4 CPUs: use at most 4"):
        load_config("shapes", None, ["train.threads=100000"])
    with pytest.raises(ConfigError, match=r"'train.threads' must be >= 0"):
        load_config("shapes", None, ["train.threads=-1"])
    cfg = load_config("shapes", None, ["train.threads=4"])
    cfg.train.threads = 64  # a finished run's config from a larger machine: evaluating it here is fine
    validate(cfg, for_training=False)
    with pytest.raises(ConfigError, match="'train.threads' = 64"):
        validate(cfg)



# --------------------------------------------------------------------------- step counts


@pytest.mark.parametrize("key", ["sampler.num_steps", "eval.num_steps"])
def test_a_step_count_past_any_sampler_is_refused_before_the_rollout_grows(key):
    # sampler.num_steps=1000000 took the trainer past 2 GiB in two minutes, still growing: a rollout
    # keeps every step's latents
    with pytest.raises(ConfigError, match=rf"'{key}' must be >= 1 and <= 1000, got 1000000"):
        load_config("shapes", None, [f"{key}=1000000"])
    assert load_config("shapes", None, [f"{key}=1000"]) is not None


# --------------------------------------------------------------------------- sizes no machine holds


@pytest.mark.parametrize("key, value, needle", [
    ("data.trees_per_prompt", 100_000_000, "for the rollout's latents alone"),  # was 24 GiB and a SIGKILL
    ("data.prompts_per_iteration", 1_000_000_000, "for the rollout's latents alone"),
    ("eval.num_prompts", 1_000_000_000, "for the evaluation's images alone"),
    ("eval.seeds_per_prompt", 100_000_000, "for the evaluation's images alone"),
])
def test_a_run_no_machine_holds_is_refused_before_its_folder_exists(key, value, needle, shapes_model_dir, tmp_path,
                                                                    capsys):
    out = tmp_path / "runs"
    rc = main(["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[]", key: value}), f"log.out_dir={out}"])
    one_line_error(rc, capsys.readouterr().err, f"{key}={value}", needle, "more than this machine's")
    assert not out.exists()


def test_the_floor_is_checked_against_the_machines_memory(shapes_model_dir, tmp_path, monkeypatch, capsys):
    """The tiny run's rollout (2 prompts x 4 trees x 5 latents of 3 x 32 x 32 float32: 480 KiB) passes
    on a machine of 1 MiB and is refused on one of 256 KiB: the check reads the machine, not a constant."""
    import flowgrpo.memory_floor as floor

    args = ["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[]", "eval.num_prompts": 1,
                                                          "eval.evaluator": "none"}), f"log.out_dir={tmp_path}"]
    monkeypatch.setattr(floor, "machine_bytes", lambda device: 256 << 10)
    one_line_error(main(args), capsys.readouterr().err, "data.trees_per_prompt=4", "more than this machine's")
    monkeypatch.setattr(floor, "machine_bytes", lambda device: 1 << 20)
    assert main(args) == 0


def test_a_lora_rank_no_machine_holds_is_refused(shapes_model_dir, tmp_path, capsys):
    # was a 51 GB allocation and a RuntimeError traceback; the shapes transformer's widest min(in, out) is 128
    base = ["train", *tiny_overrides(shapes_model_dir, **{"log.trackers": "[]", "train.iterations": 1}),
            "model.train_mode=lora", f"log.out_dir={tmp_path}"]
    one_line_error(main([*base, "model.lora_rank=100000000"]), capsys.readouterr().err,
                   "'model.lora_rank' = 100000000: its LoRA weights alone take", "more than this machine's",
                   "full rank at min(in, out) = 128")
    assert main([*base, "model.lora_rank=256"]) == 0  # above full rank: wasteful, not refused (tiny models)


def test_flowgrpo_eval_refuses_an_evaluation_no_machine_holds(cli_run_dir, capsys):
    rc = main(["eval", str(cli_run_dir), "eval.num_prompts=1000000000"])  # was a hang, growing
    one_line_error(rc, capsys.readouterr().err, "eval.num_prompts=1000000000", "for the evaluation's images alone")


# --------------------------------------------------------------------------- serve-reward's limits


@pytest.mark.parametrize("flag, value, needle", [
    ("--max-body-mb", "nan", "--max-body-mb must be a finite number > 0, got nan"),  # was a traceback
    ("--body-timeout-s", "inf", "--body-timeout-s must be a finite number > 0, got inf"),
    ("--max-batch", "0", "--max-batch must be a finite number > 0, got 0"),
    ("--window-ms", "-5", "--window-ms must be a finite number >= 0, got -5"),
    ("--port", "70000", "--port must be in 0..65535, got 70000"),
])
def test_serve_reward_names_the_limit_it_refuses(flag, value, needle, capsys):
    rc = main(["serve-reward", "--reward", "jpeg_compressibility", flag, value])
    one_line_error(rc, capsys.readouterr().err, needle)


# --------------------------------------------------------------------------- the judge's numbers


@pytest.mark.parametrize("flag, value, needle", [
    ("--timeout", "nan", "--timeout must be a finite number of seconds > 0, got nan"),  # was a traceback
    ("--timeout", "-1", "--timeout must be a finite number of seconds > 0"),  # was "cannot reach the judge"
    ("--images-per-prompt", "0", "--images-per-prompt must be at least 1, got 0"),  # was "none of the 0 images"
    ("--max-tokens", "0", "--max-tokens must be at least 1, got 0"),  # was accepted
    ("--workers", "0", "--workers must be at least 1, got 0"),
])
def test_unigenbench_score_names_a_bad_number_before_asking_the_judge(flag, value, needle, tmp_path, capsys):
    rc = main(["unigenbench", "score", str(tmp_path), "--set", "en", "--judge-url", "http://127.0.0.1:9/v1",
               "--limit", "1", "--quiet", "--out", str(tmp_path / "res"), flag, value])
    one_line_error(rc, capsys.readouterr().err, needle)
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("option, value", [("timeout", float("nan")), ("max_tokens", 0), ("retries", -1),
                                           ("backoff", float("inf"))])
def test_a_judge_option_out_of_range_is_named(option, value):
    with pytest.raises(ConfigError, match=f"judge option {option} must be a finite number"):
        build_reward("judge", model="m", base_url="http://127.0.0.1:9/v1", **{option: value})


# --------------------------------------------------------------------------- float32's range in training


@pytest.mark.parametrize("override, needle", [
    ("train.lr=1e300", "the optimizer step overflows float32 (train.lr=1e+300)"),  # was a RuntimeError traceback
    ("train.lr=1e38", "the optimizer step overflows float32 (train.lr=1e+38)"),  # lr / (1 - beta1) > float32 max
    # was a run that trained on nothing: reward_mean NaN on every line, exit 0
    ("reward.weights={shapes: 1e308}", "the weighted sum of the rewards is not a finite float32 for 8 samples"),
])
def test_a_number_past_float32_in_training_is_one_line(override, needle, shapes_model_dir, tmp_path, capsys):
    # the shipped weights: the random model's groups all score alike, so it never takes an optimizer step
    shipped = [o for o in tiny_overrides(shapes_model_dir, **{"log.trackers": "[]", "train.iterations": 1,
                                                              "eval.evaluator": "none"}) if not o.startswith("model.path=")]
    rc = main(["train", *shipped, override, f"log.out_dir={tmp_path}"])
    one_line_error(rc, capsys.readouterr().err, needle)
