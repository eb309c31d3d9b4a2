"""The reward server and the ``remote`` reward: a real uvicorn server on 127.0.0.1.

Concurrent clients get exactly the in-process scores; bad requests (pickle, malformed images,
oversize bodies, missing/wrong token) get a 4xx and the server keeps serving; a non-loopback bind
without a token is refused; a server killed mid-training stops the trainer with one line naming
the URL, and ``--resume`` against a restarted server ends where an uninterrupted run ends, which is
where the same run with the in-process reward ends.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import cli_env, flowgrpo_command, tiny_overrides  # noqa: E402

from flowgrpo.cli import main  # noqa: E402
from flowgrpo.errors import RewardUnavailableError, UserError  # noqa: E402
from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.remote import RemoteReward, encode_png_b64, pack_groups  # noqa: E402
from flowgrpo.serve import (  # noqa: E402
    ServerThread, create_app, free_port, is_loopback, resolve_token, start_server_process)
from flowgrpo.serve.server import wait_healthy  # noqa: E402
from flowgrpo.shapes.world import render, sample_spec, spec_to_prompt, wrong_scene  # noqa: E402

TOKEN = "s3cret-test-token"


def body_of(images: torch.Tensor, prompts: list[str]) -> dict:
    return {"prompts": prompts, "images": encode_png_b64(images)}


def as_floats(t: torch.Tensor) -> list:
    return [None if np.isnan(v) else v for v in t.tolist()]


# --------------------------------------------------------------------------- concurrency


def test_concurrent_clients_get_the_in_process_scores():
    reward = build_reward("jpeg_compressibility")
    g = torch.Generator().manual_seed(0)
    # images of two sizes, some smooth (small JPEG) and some noisy (large): scores differ widely
    pool = [torch.rand(1, 3, 32, 32, generator=g) ** (1 + k % 5) for k in range(12)]
    pool += [torch.rand(1, 3, 40, 24, generator=g).round() for _ in range(4)]
    expected = [reward(img, ["p"]).scores[0].item() for img in pool]
    encoded = [encode_png_b64(img)[0] for img in pool]
    clients, per_client = 8, 50
    failures: list[str] = []

    with ServerThread(create_app(reward, max_batch=16)) as srv:
        def client(c: int) -> None:
            with httpx.Client(timeout=30) as http:
                for r in range(per_client):
                    idx = [(c * 7 + r * 3 + j) % len(pool) for j in range(1 + (c + r) % 4)]
                    resp = http.post(f"{srv.url}/score", json={"prompts": [f"c{c} r{r}"] * len(idx),
                                                               "images": [encoded[i] for i in idx]})
                    if resp.status_code != 200:
                        failures.append(f"client {c} request {r}: {resp.status_code} {resp.text}")
                    elif resp.json()["scores"] != [expected[i] for i in idx]:
                        failures.append(f"client {c} request {r}: {resp.json()['scores']} != "
                                        f"{[expected[i] for i in idx]}")
                    elif resp.json()["components"]["jpeg_kb"] != [-expected[i] for i in idx]:
                        failures.append(f"client {c} request {r}: components differ")

        threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        stats = httpx.get(f"{srv.url}/stats").json()
    assert not failures, failures[:5]
    assert stats["requests"] == clients * per_client
    sizes = {int(k) for k in stats["batch_sizes"]}
    print("batch sizes seen:", stats["batch_sizes"])
    assert max(sizes) > 4 and max(sizes) <= 16, stats  # requests were batched, within --max-batch


def test_pack_groups_never_splits_a_group():
    assert pack_groups([0, 0, 1, 1, 1, 2], 4) == [[0, 1], [2, 3, 4, 5]]
    assert pack_groups([0, 1, 0, 1], 2) == [[0, 2], [1, 3]]
    assert pack_groups(["a"] * 5 + ["b"], 3) == [[0, 1, 2, 3, 4], [5]]  # an oversize group stays whole


# --------------------------------------------------------------------------- bad requests


@pytest.fixture(scope="module")
def shapes_scenes():
    """16 shapes-world images with their prompts; half of them drawn wrong (scores vary)."""
    rng = np.random.default_rng(0)
    images, prompts = [], []
    for k in range(16):
        spec = sample_spec(rng)
        drawn = wrong_scene(spec, rng) if k % 2 else spec
        images.append(torch.from_numpy(render(drawn, rng)).permute(2, 0, 1).float() / 255)
        prompts.append(spec_to_prompt(spec))
    return torch.stack(images), prompts


def _png_b64(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_bad_requests_get_4xx_and_the_server_keeps_serving(shapes_scenes, tmp_path):
    reward = build_reward("shapes")
    images, prompts = shapes_scenes
    ref = reward(images, prompts)
    assert len(set(ref.scores.tolist())) > 2  # a meaningful comparison
    good = body_of(images, prompts)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    canary = tmp_path / "unpickled"

    class Evil:  # unpickling this would create the canary file
        def __reduce__(self):
            return open, (str(canary), "w")

    bomb = _png_b64(np.zeros((2000, 2000, 3), dtype=np.uint8))  # 4 M pixels in ~12 kB
    png = base64.b64decode(encode_png_b64(images[:1])[0])
    one = {"prompts": prompts[:1]}
    octet, jtype = "application/octet-stream", "application/json"
    cases = [
        ("pickle body", dict(content=pickle.dumps(Evil()), headers={**auth, "content-type": octet}), (415,)),
        ("pickle as JSON", dict(content=pickle.dumps(Evil()), headers={**auth, "content-type": jtype}), (400,)),
        ("not base64", dict(json={**one, "images": ["%%% not base64 %%%"]}, headers=auth), (400,)),
        ("not an image", dict(json={**one, "images": [base64.b64encode(b"GIF89a nope").decode()]}, headers=auth),
         (400,)),
        ("truncated PNG", dict(json={**one, "images": [base64.b64encode(png[:60]).decode()]}, headers=auth), (400,)),
        ("decompression bomb", dict(json={**one, "images": [bomb]}, headers=auth), (413,)),
        ("length mismatch", dict(json={"prompts": prompts, "images": good["images"][:3]}, headers=auth), (422,)),
        ("wrong schema", dict(json={"prompts": "a", "images": []}, headers=auth), (422,)),
        ("oversize body", dict(content=b"{" + b" " * 300_000 + b"}", headers={**auth, "content-type": jtype}), (413,)),
        ("oversize chunked body", dict(content=iter([b"{" + b" " * 100_000] * 3 + [b"}"]),
                                       headers={**auth, "content-type": jtype}), (413,)),
        ("missing token", dict(json=good), (401,)),
        ("wrong token", dict(json=good, headers={"Authorization": f"Bearer {TOKEN}x"}), (401,)),
        ("wrong scheme", dict(json=good, headers={"Authorization": f"Basic {TOKEN}"}), (401,)),
    ]
    app = create_app(reward, token=TOKEN, max_body_mb=0.25, max_image_pixels=1_000_000)
    with ServerThread(app) as srv, httpx.Client(timeout=30) as http:
        for name, kwargs, statuses in cases:
            resp = http.post(f"{srv.url}/score", **kwargs)
            assert resp.status_code in statuses, f"{name}: {resp.status_code} {resp.text}"
            err = resp.json()["error"]
            assert err and "\n" not in err, f"{name}: {err!r}"
            # the next good request is answered, with the in-process scores
            ok = http.post(f"{srv.url}/score", json=good, headers=auth)
            assert ok.status_code == 200, f"after {name}: {ok.status_code} {ok.text}"
            assert ok.json()["scores"] == as_floats(ref.scores), f"after {name}"
            assert ok.json()["components"]["correct"] == as_floats(ref.components["correct"])
        assert http.get(f"{srv.url}/health").status_code == 401
        assert http.get(f"{srv.url}/health", headers=auth).json() == {"status": "ok", "reward": "shapes"}
    assert not canary.exists(), "the server unpickled a request body"


def test_remote_reward_matches_in_process_and_reports_4xx_at_once(shapes_scenes, monkeypatch):
    reward = build_reward("shapes")
    images, prompts = shapes_scenes
    groups = torch.arange(16) // 4
    ref = reward(images, prompts, groups)
    monkeypatch.setenv("FLOWGRPO_TEST_TOKEN", TOKEN)
    monkeypatch.setenv("FLOWGRPO_WRONG_TOKEN", TOKEN + "x")
    with ServerThread(create_app(reward, token=TOKEN, max_batch=6)) as srv:
        remote = build_reward("remote", url=srv.url, token_env="FLOWGRPO_TEST_TOKEN", batch_size=8)
        out = remote(images, prompts, groups)
        assert as_floats(out.scores) == as_floats(ref.scores)
        assert as_floats(out.components["correct"]) == as_floats(ref.components["correct"])
        wrong = RemoteReward(srv.url, token_env="FLOWGRPO_WRONG_TOKEN", retries=5, backoff=10.0)
        t0 = time.monotonic()
        with pytest.raises(UserError) as exc:
            wrong(images[:2], prompts[:2])
        assert time.monotonic() - t0 < 5  # no retries on a 4xx
        assert not isinstance(exc.value, RewardUnavailableError)
        msg = str(exc.value)
        assert "\n" not in msg and f"{srv.url}/score" in msg and "401" in msg and "token" in msg


def test_pairwise_groups_survive_batching_and_splitting():
    """Win rates within groups: the client packs whole groups per request, the server cuts requests
    into parts of whole groups and batches parts of different requests without mixing their groups."""
    rng = np.random.default_rng(1)
    images, prompts = [], []
    for _ in range(6):
        spec = sample_spec(rng)
        for k in range(4):
            drawn = wrong_scene(spec, rng) if k % 2 else spec
            images.append(torch.from_numpy(render(drawn, rng)).permute(2, 0, 1).float() / 255)
            prompts.append(spec_to_prompt(spec))
    images, groups = torch.stack(images), torch.arange(24) // 4
    reward = build_reward("shapes_pairwise")
    ref = reward(images, prompts, groups)
    assert len(set(ref.scores.tolist())) > 1
    with ServerThread(create_app(reward, max_batch=6)) as srv:
        for batch_size, concurrency in ((4, 1), (8, 1), (24, 1), (4, 3), (8, 6)):
            # concurrent requests of one call come back in request order
            out = build_reward("remote", url=srv.url, batch_size=batch_size, concurrency=concurrency)(
                images, prompts, groups)
            assert as_floats(out.scores) == as_floats(ref.scores), (batch_size, concurrency)
            assert as_floats(out.components["ties"]) == as_floats(ref.components["ties"]), (batch_size, concurrency)
    with pytest.raises(Exception, match="concurrency >= 1"):
        build_reward("remote", url="http://127.0.0.1:1", concurrency=0)


def test_a_failing_reward_is_a_500_retried_then_one_line():
    class Fragile:
        name = "fragile"

        def __call__(self, images, prompts, groups=None):
            if "boom" in prompts:
                raise RuntimeError("cannot score 'boom'")
            return build_reward("jpeg_compressibility")(images, prompts)

    with ServerThread(create_app(Fragile())) as srv:
        remote = RemoteReward(srv.url, retries=1, backoff=0.01)
        x = torch.rand(3, 3, 16, 16)
        with pytest.raises(RewardUnavailableError, match="HTTP 500.*boom"):
            remote(x, ["a", "boom", "c"])
        # concurrent requests batched with a failing one are still answered
        results: dict[int, int] = {}

        def send(k: int) -> None:
            body = body_of(x, ["boom" if k == 0 else "a"] * 3)
            results[k] = httpx.post(f"{srv.url}/score", json=body, timeout=30).status_code

        threads = [threading.Thread(target=send, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {0: 500, **{k: 200 for k in range(1, 6)}}


def test_unreachable_server_is_one_line_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"
    remote = RemoteReward(url, retries=2, backoff=0.05, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(RewardUnavailableError) as exc:
        remote(torch.rand(2, 3, 8, 8), ["a", "b"])
    assert time.monotonic() - t0 < 10
    msg = str(exc.value)
    assert "\n" not in msg and f"{url}/score" in msg and "3 attempt" in msg


# --------------------------------------------------------------------------- bind checks


def test_non_loopback_bind_without_a_token_is_refused(monkeypatch, capsys):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("example.org")
    with pytest.raises(UserError, match="0.0.0.0.*token"):
        resolve_token("0.0.0.0", None)
    monkeypatch.delenv("FLOWGRPO_UNSET_TOKEN", raising=False)
    with pytest.raises(UserError, match="FLOWGRPO_UNSET_TOKEN"):
        resolve_token("0.0.0.0", "FLOWGRPO_UNSET_TOKEN")
    monkeypatch.setenv("FLOWGRPO_TEST_TOKEN", TOKEN)
    assert resolve_token("0.0.0.0", "FLOWGRPO_TEST_TOKEN") == TOKEN
    assert resolve_token("127.0.0.1", None) is None
    # through the CLI: refused before anything is built or bound
    rc = main(["serve-reward", "--reward", "jpeg_compressibility", "--host", "0.0.0.0", "--port", "1"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1, lines
    assert lines[0].startswith("flowgrpo: error: refusing to serve on 0.0.0.0") and "--token-env" in lines[0]
    rc = main(["serve-reward", "--reward", "jpeg_compressibility", "--option", "nope=1", "--port", "1"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "nope" in lines[0], lines


# --------------------------------------------------------------------------- server death mid-training

# a reward server that SIGKILLs itself on the AT-th reward call (iteration AT-1 of a run): a real,
# abrupt death at a known point of the run
DYING_SERVER = '''
import os, signal, sys
from flowgrpo.cli import main
from flowgrpo.rewards import REWARDS, build_reward

@REWARDS.register("dies_at_call")
class DiesAtCall:
    name = "dies_at_call"

    def __init__(self, at: int, reward: str = "jpeg_compressibility"):
        self.at, self.calls, self.inner = int(at), 0, build_reward(reward)

    def __call__(self, images, prompts, groups=None):
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(images, prompts, groups)

sys.exit(main(sys.argv[1:]))
'''
ITERATIONS, DIE_AT = 5, 3
TIMINGS = {"train_seconds"}


def metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl without timings, the in-process reward's keys renamed to the remote one's."""
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [{k.replace("jpeg_compressibility", "remote"): v for k, v in r.items()
             if not k.endswith("_s") and k not in TIMINGS} for r in rows]


def summary(run_dir: Path) -> dict:
    s = json.loads((run_dir / "summary.json").read_text())
    return {"eval_after": s["eval_after"], "accuracy_gain": s["accuracy_gain"], "iterations": s["iterations"],
            "final_metrics": metrics(run_dir)[-1]}


def test_server_death_stops_training_and_resume_matches_in_process_run(shapes_model_dir, tmp_path):
    out = tmp_path / "runs"
    common = tiny_overrides(shapes_model_dir, **{"train.iterations": ITERATIONS, "log.checkpoint_every": 1,
                                                 "train.lr": "1e-3"}) + [f"log.out_dir={out}"]

    def remote_args(port: int) -> list[str]:
        return ["reward.weights={remote: 1.0}", f"reward.options.remote.url=http://127.0.0.1:{port}",
                "reward.options.remote.retries=2", "reward.options.remote.backoff=0.1",
                "reward.options.remote.timeout=10"]

    def train(*args: str) -> subprocess.Popen:
        return subprocess.Popen(flowgrpo_command() + ["train", *args], env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    port_ok = port_dying = free_port()
    while port_dying == port_ok:
        port_dying = free_port()
    dying_script = tmp_path / "dying_server.py"
    dying_script.write_text(DYING_SERVER)
    servers = []
    try:
        servers.append(start_server_process("jpeg_compressibility", port_ok))
        servers.append(wait_healthy([sys.executable, str(dying_script), "serve-reward", "--reward", "dies_at_call",
                                     "--option", f"at={DIE_AT}", "--port", str(port_dying), "--log-level", "warning"],
                                    f"http://127.0.0.1:{port_dying}"))
        runs = {"in_process": train(*common, "reward.weights={jpeg_compressibility: 1.0}", "log.run_name=in_process"),
                "remote": train(*common, *remote_args(port_ok), "log.run_name=remote"),
                "killed": train(*common, *remote_args(port_dying), "log.run_name=killed")}
        done = {name: proc.communicate(timeout=300) for name, proc in runs.items()}
        for name in ("in_process", "remote"):
            assert runs[name].returncode == 0, f"{name}: {done[name][1]}"

        # the killed server: one line naming the URL, exit code 2, the checkpoints before the death intact
        killed = out / "killed"
        err_lines = [ln for ln in done["killed"][1].splitlines() if ln.strip()]
        assert runs["killed"].returncode == 2 and len(err_lines) == 1, done["killed"][1]
        assert err_lines[0].startswith("flowgrpo: error: reward server ")
        assert f"http://127.0.0.1:{port_dying}/score" in err_lines[0] and "unavailable after 3 attempt" in err_lines[0]
        print(err_lines[0])
        assert servers[1].wait(timeout=30) != 0  # it really died
        ckpts = sorted(p.name for p in (killed / "checkpoints").iterdir())
        assert ckpts == [f"ckpt_{DIE_AT - 2:06d}", f"ckpt_{DIE_AT - 1:06d}"], ckpts
        assert not (killed / "summary.json").exists()
        assert len(metrics(killed)) == DIE_AT - 1

        # the server is back (same port): --resume ends where the uninterrupted runs end
        servers.append(start_server_process("jpeg_compressibility", port_dying))
        res = train("--resume", str(killed))
        stdout, stderr = res.communicate(timeout=300)
        assert res.returncode == 0, stderr
        assert f"resumed from {killed / 'checkpoints' / f'ckpt_{DIE_AT - 1:06d}'}" in stdout
    finally:
        for s in servers:
            s.kill()
            s.wait()
    remote, in_process = metrics(out / "remote"), metrics(out / "in_process")
    assert [r["iteration"] for r in remote] == list(range(ITERATIONS))
    assert all(r["grad_norm"] > 0 for r in remote)  # the weights moved every iteration
    assert metrics(killed) == remote  # resumed == uninterrupted, exactly
    assert remote == in_process  # remote reward == in-process reward, exactly
    assert summary(killed) == summary(out / "remote") == summary(out / "in_process")
