"""The reward server's limits and edge cases: memory per request and per reward call, requests that
nest, stall or disconnect, a port in use; and one wire-protocol module for the server and the client.

Memory is measured on a real ``flowgrpo serve-reward`` subprocess (its peak resident set, VmHWM):
before the decoded-size limit, six 4096 x 4096 PNGs in a 0.39 MB body took the server from 0.54 to
5.2 GiB; now they are refused from their headers and the peak does not move.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import io
import logging
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from conftest import cli_env, flowgrpo_command  # noqa: E402

from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.wire import encode_png_b64  # noqa: E402
from flowgrpo.serve import ServerThread, create_app, free_port, start_server_process  # noqa: E402
from flowgrpo.serve.batcher import Batcher  # noqa: E402
from flowgrpo.serve.codec import DECODED_BYTES_PER_PIXEL, DEFAULT_MAX_IMAGES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JSON = {"content-type": "application/json"}


def png_b64(arr: np.ndarray) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def one_line_error(resp, status: int, *needles: str) -> str:
    assert resp.status_code == status, f"{resp.status_code} {resp.text[:300]}"
    err = resp.json()["error"]
    assert err and "\n" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def peak_rss_mib(pid: int) -> float:
    """The peak resident set of process ``pid`` so far (Linux: VmHWM in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


def raw_post(url: str, declared: int, sent: bytes) -> socket.socket:
    """A POST /score on a raw socket declaring ``declared`` body bytes and sending ``sent``."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % declared + sent)
    return sock


# --------------------------------------------------------------------------- memory


def test_decoded_size_is_checked_from_the_headers_before_decoding():
    reward = build_reward("jpeg_compressibility")
    g = torch.Generator().manual_seed(0)
    images = torch.rand(4, 3, 500, 500, generator=g)  # 500 x 500 x 12 bytes = 2.9 MiB each as float32
    full = encode_png_b64(images)
    # cut 16 bytes into the first IDAT chunk: the header (IHDR) is there, the pixels are not
    raws = [base64.b64decode(s) for s in full]
    headers_only = [base64.b64encode(raw[:raw.index(b"IDAT") + 20]).decode() for raw in raws]
    with ServerThread(create_app(reward, max_decoded_mb=10)) as srv, httpx.Client(timeout=60) as http:
        resp = http.post(f"{srv.url}/score", json={"prompts": ["p"] * 4, "images": headers_only})
        # 4 x 2.9 MiB > 10 MiB: refused from the headers (decoding them would have been a 400)
        one_line_error(resp, 413, "4 images decode to 11 MiB", "10 MiB", "max_decoded_mb")
        ok = http.post(f"{srv.url}/score", json={"prompts": ["p"] * 3, "images": full[:3]})
        assert ok.status_code == 200, ok.text
        assert ok.json()["scores"] == reward(images[:3], ["p"] * 3).scores.tolist()
        one_line_error(http.post(f"{srv.url}/score", json={"prompts": ["p"], "images": headers_only[:1]}),
                       400, "image 0 is not a readable PNG")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc")
def test_huge_images_in_a_small_body_do_not_reach_memory():
    big = png_b64(np.zeros((4096, 4096, 3), dtype=np.uint8))  # 192 MiB as float32, 65 kB as PNG
    port = free_port()
    proc = start_server_process("jpeg_compressibility", port)
    try:
        before = peak_rss_mib(proc.pid)
        resp = httpx.post(f"http://127.0.0.1:{port}/score", json={"prompts": ["p"] * 6, "images": [big] * 6},
                          timeout=300)
        grown = peak_rss_mib(proc.pid) - before
    finally:
        proc.kill()
        proc.wait()
    print(f"six 4096 x 4096 PNGs: HTTP {resp.status_code}, server peak RSS {before:.0f} MiB -> +{grown:.0f} MiB")
    one_line_error(resp, 413, "6 images decode to 1152 MiB", "1024 MiB", "max_decoded_mb")
    assert grown < 128, f"the server's peak RSS grew by {grown:.0f} MiB"  # was +4.7 GiB


def test_images_per_request_are_capped_for_pairwise_rewards():
    """A pairwise reward judges n (n - 1) / 2 pairs per group: 5,000 tiny images in one group took the
    server to 13.7 GiB. The default cap refuses them at once; a lower cap is a server option."""
    tiny = png_b64(np.zeros((1, 1, 3), dtype=np.uint8))
    rng = np.random.default_rng(0)
    scenes = [png_b64(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(8)]
    reward = build_reward("shapes_pairwise")
    with ServerThread(create_app(reward)) as srv:
        t0 = time.monotonic()
        resp = httpx.post(f"{srv.url}/score", json={"prompts": ["a red circle"] * 5000, "images": [tiny] * 5000},
                          timeout=60)
        # refused from a count of its JSON values, before the 10,000 strings are parsed
        one_line_error(resp, 413, f"at most {DEFAULT_MAX_IMAGES} images (max_images)", "send fewer per request")
        assert time.monotonic() - t0 < 10
    with ServerThread(create_app(reward, max_images=8)) as srv:
        body = {"prompts": ["a red circle"] * 8, "images": scenes, "groups": [0] * 8}
        assert httpx.post(f"{srv.url}/score", json=body, timeout=60).status_code == 200
        body = {k: v + v[:1] for k, v in body.items()}
        one_line_error(httpx.post(f"{srv.url}/score", json=body, timeout=60), 413, "9 images", "limit of 8")


def test_a_reward_call_stays_within_the_decoded_budget():
    """Parts of concurrent requests are batched up to max_batch images AND max_bytes of decoded
    images; the reward receives float pixels in [0, 1] although images wait as uint8."""
    calls = []

    class Recording:
        def __call__(self, images, prompts, groups=None):
            calls.append((images.shape[0], images.dtype, float(images.max())))
            return build_reward("jpeg_compressibility")(images, prompts)

    one = 32 * 32 * DECODED_BYTES_PER_PIXEL
    g = torch.Generator().manual_seed(0)
    images = [(torch.rand(1, 3, 32, 32, generator=g) * 255).round().to(torch.uint8) for _ in range(10)]

    async def run():
        batcher = Batcher(Recording(), max_batch=32, window_s=0.0, max_bytes=3 * one)
        batcher.start()
        try:
            return await asyncio.gather(*(batcher.score([img], [f"p{k}"], None) for k, img in enumerate(images)))
        finally:
            await batcher.stop()

    results = asyncio.run(run())
    sizes = [n for n, _, _ in calls]
    assert sum(sizes) == 10 and max(sizes) == 3, sizes  # queued together, cut at 3 images' bytes
    assert all(dtype == torch.float32 and top <= 1.0 for _, dtype, top in calls), calls
    expected = build_reward("jpeg_compressibility")(torch.cat(images).float() / 255, ["p"] * 10).scores
    assert torch.equal(torch.cat([s for s, _ in results]), expected)


# --------------------------------------------------------------------------- edge cases


def test_deeply_nested_json_is_refused():
    """3,000 nested lists are more JSON values than a request of max_images=256 holds: a 413 before
    parsing; with a limit that allows them, the parser's recursion limit gives a 400."""
    with ServerThread(create_app(build_reward("jpeg_compressibility"))) as srv, httpx.Client(timeout=30) as http:
        one_line_error(http.post(f"{srv.url}/score", content=b"[" * 3000, headers=JSON), 413, "JSON values")
        one_line_error(http.post(f"{srv.url}/score", content=b'{"prompts": ' + b"[" * 3000, headers=JSON), 413)
    with ServerThread(create_app(build_reward("jpeg_compressibility"), max_images=2000)) as srv, \
            httpx.Client(timeout=30) as http:
        one_line_error(http.post(f"{srv.url}/score", content=b"[" * 3000, headers=JSON), 400, "nested too deeply")
        one_line_error(http.post(f"{srv.url}/score", content=b'{"prompts": ' + b"[" * 3000, headers=JSON), 400)
        ok = http.post(f"{srv.url}/score", json={"prompts": ["p"], "images": encode_png_b64(torch.rand(1, 3, 8, 8))})
        assert ok.status_code == 200, ok.text


def test_a_stalled_upload_is_cut_off():
    """A body shorter than its Content-Length was waited on forever; now it is a 408 after
    body_timeout_s, and the connection is closed."""
    with ServerThread(create_app(build_reward("jpeg_compressibility"), body_timeout_s=1.0)) as srv:
        sock = raw_post(srv.url, declared=1000, sent=b'{"prompts": [')
        sock.settimeout(10)  # the test's bound: before the fix, recv timed out here
        t0 = time.monotonic()
        answer = b""
        with sock:
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
        elapsed = time.monotonic() - t0
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"body_timeout_s" in answer and 0.9 < elapsed < 5, (answer, elapsed)
        ok = httpx.post(f"{srv.url}/score", json={"prompts": ["p"], "images": encode_png_b64(torch.rand(1, 3, 8, 8))})
        assert ok.status_code == 200


def test_a_client_disconnect_is_one_info_line():
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    scoring = threading.Event()

    class Slow:
        def __call__(self, images, prompts, groups=None):
            scoring.set()
            time.sleep(0.5)
            return build_reward("jpeg_compressibility")(images, prompts)

    logger = logging.getLogger("uvicorn.error")
    with ServerThread(create_app(Slow())) as srv:
        handler, level = Keep(), logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            # gone in the middle of the upload
            raw_post(srv.url, declared=1000, sent=b'{"prompts": [').close()
            deadline = time.monotonic() + 10
            while not records and time.monotonic() < deadline:
                time.sleep(0.05)
            # gone while its images are being scored
            body = httpx.Request("POST", "/", json={"prompts": ["p"], "images": encode_png_b64(torch.rand(1, 3, 8, 8))})
            with raw_post(srv.url, declared=len(body.read()), sent=body.read()):
                assert scoring.wait(10)
            time.sleep(1.0)  # the answer goes to a closed connection
            assert httpx.get(f"{srv.url}/health").status_code == 200
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    lines = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in records]
    assert len(lines) == 1, lines
    assert lines[0][0] == "INFO" and "disconnected before its request body was read" in lines[0][1], lines
    assert not lines[0][2], "a traceback was logged"


def test_a_port_in_use_is_one_line_and_exit_code_2():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(flowgrpo_command() + ["serve-reward", "--reward", "jpeg_compressibility", "--port",
                                                    str(port)], env=cli_env(), capture_output=True, text=True,
                              timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert lines[0].startswith(f"flowgrpo: error: cannot listen on 127.0.0.1:{port}: "), lines
    assert "in use" in lines[0], lines
    assert "serving" not in proc.stdout, proc.stdout


# --------------------------------------------------------------------------- one protocol module


def _flowgrpo_imports(path: Path, package: str) -> set[str]:
    """The flowgrpo modules ``path`` imports (relative imports resolved against ``package``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            mod = ".".join(p for p in (base, node.module) if p)
            out |= {mod} | {f"{mod}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("flowgrpo")}


def test_the_server_and_the_client_share_one_protocol_module():
    """The server does not import the client (flowgrpo.rewards.remote): both import the wire helpers
    from flowgrpo.rewards.wire (under rewards/, as flowgrpo.serve imports flowgrpo.rewards)."""
    serve = {p.name: _flowgrpo_imports(p, "flowgrpo.serve") for p in (ROOT / "flowgrpo" / "serve").glob("*.py")}
    assert not [name for name, mods in serve.items() if "flowgrpo.rewards.remote" in mods], serve
    assert any("flowgrpo.rewards.wire" in mods for mods in serve.values())
    assert "flowgrpo.rewards.wire" in _flowgrpo_imports(ROOT / "rewards" / "remote.py", "flowgrpo.rewards")
