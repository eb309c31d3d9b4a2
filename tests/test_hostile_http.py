"""Issue 43, a second hostile round, over HTTP: servers that misbehave on purpose, all on 127.0.0.1.

* a gzip body that inflates far past the cap (a decompression bomb), from a reward server, a judge
  and ``unigenbench score``'s judge: refused at ``max_response_mb`` after decompression, in one line;
* a server that sends its headers (or its header block) a byte every 0.2 s: abandoned at ``timeout``;
* ``Retry-After: ²`` (not ASCII digits): treated as absent, never a traceback;
* a judge answering on its own scale ("Score: 4/5"): read on that scale;
* ``serve-reward --option quality=abc`` / ``quality=1e9``: one line naming the option and its type or range;
* a ``/score`` request with both ``Content-Length`` and ``Transfer-Encoding``: 400 and the connection
  closed, so a request hidden in its body is never scored.
"""

from __future__ import annotations

import functools
import json
import socket
import socketserver
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterable

import pytest
import torch

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_cli_errors import one_line_error  # noqa: E402

from flowgrpo.cli import main  # noqa: E402
from flowgrpo.errors import ConfigError, RewardUnavailableError, UserError  # noqa: E402
from flowgrpo.rewards import build_reward  # noqa: E402
from flowgrpo.rewards.http_client import retry_after_s  # noqa: E402
from flowgrpo.rewards.judge import parse_score_0_10  # noqa: E402
from flowgrpo.rewards.openai_client import JudgeEndpointError  # noqa: E402
from flowgrpo.rewards.remote import RemoteReward  # noqa: E402
from flowgrpo.rewards.wire import encode_png_b64  # noqa: E402
from flowgrpo.serve import ServerThread, create_app  # noqa: E402
from flowgrpo.unigenbench.score import JudgeOptions, check_reachable  # noqa: E402

BOMB_MIB = 64  # inflated size of the bomb: four times the default cap (16 MiB)
DRIP_S = 0.2  # seconds between the bytes of a dripping answer


# --------------------------------------------------------------------------- a server that misbehaves


Answer = Callable[[str, str, int], Iterable[bytes | float]]


class RawHTTP:
    """A loopback HTTP/1.1 server on plain sockets, for answers no real server sends.

    ``answer(method, path, n)`` gives the n-th request's answer (0-based) as pieces: bytes are sent,
    a number sleeps that many seconds. Every connection is closed after one answer; a dripping
    answer stops when the client goes away or the server is closed. ``requests`` counts them."""

    def __init__(self, answer: Answer):
        self.answer, self.requests, self.closing = answer, 0, threading.Event()
        owner = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                owner._serve(self.request)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RawHTTP:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, sock: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        method, path = lines[0].split()[:2]
        length = next((int(ln.split(":", 1)[1]) for ln in lines[1:] if ln.lower().startswith("content-length:")), 0)
        while len(body) < length:
            body += sock.recv(65536)
        n, self.requests = self.requests, self.requests + 1
        try:
            for piece in self.answer(method, path, n):
                if self.closing.is_set():
                    return
                if isinstance(piece, bytes):
                    sock.sendall(piece)
                else:
                    time.sleep(piece)
        except OSError:  # the client gave up
            return


def head(status: str = "200 OK", *extra: str, length: int | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", "Content-Type: application/json", "Connection: close", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


@functools.lru_cache(maxsize=None)
def gzip_bomb(mib: int = BOMB_MIB) -> bytes:
    """A gzip member of ``mib`` MiB of zeros (about a thousandth of that compressed)."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = bytes(1 << 20)
    return b"".join([*(z.compress(zeros) for _ in range(mib)), z.flush()])


def bomb(method, path, n):
    body = gzip_bomb()
    yield head("200 OK", "Content-Encoding: gzip", length=len(body)) + body


def body_drip(method, path, n):
    yield head(length=10_000)
    for _ in range(300):
        yield b" "
        yield DRIP_S


def header_drip(method, path, n):
    yield b"HTTP/1.1 200 OK\r\n"
    for _ in range(300):
        yield b"X"
        yield DRIP_S


def chat(text: str) -> bytes:
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
    return head(length=len(body)) + body


def peak_traced_mib(fn) -> tuple[float, BaseException | None]:
    """(peak of Python's traced allocations while ``fn()`` ran, MiB; what it raised)."""
    tracemalloc.start()
    try:
        fn()
        raised = None
    except BaseException as exc:  # noqa: BLE001 - returned for the caller to check
        raised = exc
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    return peak, raised


IMAGES = torch.rand(2, 3, 8, 8)


# --------------------------------------------------------------------------- decompression bombs


def test_a_reward_servers_gzip_bomb_is_refused_within_the_cap():
    with RawHTTP(bomb) as srv:
        remote = RemoteReward(srv.url, retries=2, backoff=0.01)
        peak, raised = peak_traced_mib(lambda: remote(IMAGES, ["a", "b"]))
        remote.close()
    assert isinstance(raised, UserError) and not isinstance(raised, RewardUnavailableError), raised
    msg = str(raised)
    assert "more than 16 MiB after decompression" in msg and "reward.options.remote.max_response_mb=16" in msg
    assert "\n" not in msg and srv.requests == 1  # refused at once, not retried
    assert peak < 40, f"{peak:.0f} MiB held for a {BOMB_MIB} MiB bomb"


def test_a_judges_gzip_bomb_is_refused_within_the_cap():
    with RawHTTP(bomb) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", retries=2, backoff=0.01)
        peak, raised = peak_traced_mib(lambda: judge(IMAGES[:1], ["a"]))
        judge.close()
    assert isinstance(raised, JudgeEndpointError), raised
    assert "more than 16 MiB after decompression" in str(raised) and "max_response_mb=16" in str(raised)
    assert peak < 40, f"{peak:.0f} MiB held for a {BOMB_MIB} MiB bomb"


def test_unigenbench_score_refuses_a_bomb_in_one_line(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "0_0.png")
    with RawHTTP(bomb) as srv:
        rc = main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en", "--judge-url", srv.url + "/v1",
                   "--limit", "1", "--images-per-prompt", "1", "--quiet", "--out", str(tmp_path / "res")])
    one_line_error(rc, capsys.readouterr().err, f"the judge at {srv.url}/v1 answered a body of more than 16 MiB",
                   "--max-response-mb 16")


def test_max_response_mb_is_an_option_with_a_checked_value():
    app = create_app(build_reward("jpeg_compressibility"))
    with ServerThread(app) as srv:
        assert torch.isfinite(RemoteReward(srv.url)(IMAGES, ["a", "b"]).scores).all()
        # a cap of 10 bytes, below any answer with two scores whatever their digits: the former 104-byte
        # cap is near the answer's own size, and one fresh-clone run's answer fit under it
        # (IMAGES are unseeded, so the scores' printed lengths vary)
        with pytest.raises(UserError, match=r"more than 9\.5\d*e-06 MiB after decompression; refused .*max_response_mb=1e-05"):
            RemoteReward(srv.url, max_response_mb=0.00001)(IMAGES, ["a", "b"])
    for bad in (0, -1, float("nan"), float("inf")):  # inf was an OverflowError traceback
        with pytest.raises(ConfigError, match="max_response_mb must be a finite number of MiB > 0"):
            RemoteReward("http://127.0.0.1:9", max_response_mb=bad)


# --------------------------------------------------------------------------- answers that drip


@pytest.mark.parametrize("drip", [body_drip, header_drip], ids=["body", "header"])
def test_a_dripping_reward_server_is_abandoned_at_the_timeout(drip):
    with RawHTTP(drip) as srv:
        remote = RemoteReward(srv.url, timeout=1.5, retries=1, backoff=0.01)
        t0 = time.monotonic()
        with pytest.raises(RewardUnavailableError, match=r"after 2 attempt\(s\): TimeoutError: no whole answer within 1.5 s"):
            remote(IMAGES, ["a", "b"])
        elapsed = time.monotonic() - t0
        remote.close()
    assert 3.0 <= elapsed < 6.0, f"{elapsed:.1f} s for two attempts of 1.5 s"


def test_a_dripping_judge_drops_the_sample_at_the_timeout():
    with RawHTTP(body_drip) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", timeout=1.5, retries=0)
        t0 = time.monotonic()
        out = judge(IMAGES[:1], ["a"])
        elapsed = time.monotonic() - t0
        judge.close()
    assert torch.isnan(out.scores).all() and out.components["judge_failed"].tolist() == [1.0]
    assert elapsed < 4.0, f"{elapsed:.1f} s"


def test_unigenbench_reachability_check_is_bounded_by_the_timeout():
    with RawHTTP(header_drip) as srv:
        t0 = time.monotonic()
        with pytest.raises(UserError, match="cannot reach the judge .*TimeoutError"):
            check_reachable(JudgeOptions(url=srv.url + "/v1", timeout=1.5))
    assert time.monotonic() - t0 < 4.0


# --------------------------------------------------------------------------- Retry-After


def test_retry_after_reads_ascii_seconds_and_http_dates_only():
    assert retry_after_s("120") == 120 and retry_after_s(" 1.5 ") == 1.5
    for junk in ("²", "٣", "1²", "-1", "soon", "", None, "1e3", "Sun, 99 Foo 2015 07:28:00 GMT"):
        assert retry_after_s(junk) is None, junk
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: at once
    later = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 < retry_after_s(later) <= 30


def busy_then(text: str, retry_after: bytes = "²".encode()) -> Answer:
    """A judge: 503 with ``Retry-After: retry_after`` (raw bytes) to every first POST, then ``text``."""
    def answer(method, path, n):
        if method == "GET":
            yield head(length=2) + b"{}"
        elif answer.posts == 0:
            answer.posts += 1
            yield b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: " + retry_after + b"\r\nContent-Length: 0\r\n\r\n"
        else:
            yield chat(text)
    answer.posts = 0
    return answer


def test_a_non_ascii_retry_after_from_a_judge_counts_as_absent():
    with RawHTTP(busy_then("Score: 8")) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", retries=1, backoff=0.01)
        out = judge(IMAGES[:1], ["a"])
        judge.close()
    assert out.scores.tolist() == [pytest.approx(0.8)] and judge.core.stats["retries"] == 1


def test_a_non_ascii_retry_after_in_unigenbench_score_is_no_traceback(tmp_path, capsys):
    from PIL import Image

    (tmp_path / "images").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "images" / "0_0.png")
    with RawHTTP(busy_then("no verdict here")) as srv:
        rc = main(["unigenbench", "score", str(tmp_path / "images"), "--set", "en", "--judge-url", srv.url + "/v1",
                   "--limit", "1", "--images-per-prompt", "1", "--retries", "1", "--quiet", "--out",
                   str(tmp_path / "res")])
    cap = capsys.readouterr()
    assert rc == 0 and "Traceback" not in cap.err
    record = json.loads((tmp_path / "res" / "judgements.jsonl").read_text().splitlines()[-1])
    assert record["attempts"] == 2 and not record["ok"]  # the 503, then an unreadable answer


# --------------------------------------------------------------------------- the judge's scale


@pytest.mark.parametrize("answer, score", [
    ("Score: 4/5", 0.8), ("Score: 4 out of 5", 0.8), ("Rating: 8/10", 0.8), ("Score: 7", 0.7), ("4/5", 0.8),
    ("**Score:** 3 / 4", 0.75), ("Score: 6/5", None), ("Score: 3/0", None), ("Score: 11", None),
])
def test_a_stated_scale_is_the_one_read(answer, score):
    assert parse_score_0_10(answer) == (None if score is None else pytest.approx(score))


def test_a_judge_answering_out_of_five_is_scored_on_that_scale():
    with RawHTTP(lambda method, path, n: [chat("The layout is right.\nScore: 4/5")]) as srv:
        judge = build_reward("judge", model="m", base_url=srv.url + "/v1", retries=0)
        out = judge(IMAGES[:1], ["a"])
        judge.close()
    assert out.scores.tolist() == [pytest.approx(0.8)]


# --------------------------------------------------------------------------- serve-reward options


@pytest.mark.parametrize("option, needle", [
    ("quality=abc", "'reward.options.jpeg_compressibility.quality' expects int, got str 'abc'"),
    ("quality=1e9", "'reward.options.jpeg_compressibility.quality' must be a finite number >= 1 and <= 100, got 1000000000.0"),
    ("quality=0", "'reward.options.jpeg_compressibility.quality' must be >= 1 and <= 100, got 0"),
])
def test_serve_reward_refuses_a_bad_option_value_in_one_line(option, needle, capsys):
    with socket.socket() as taken:  # a value let through fails at the bind instead of serving
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        rc = main(["serve-reward", "--reward", "jpeg_compressibility", "--option", option, "--port", str(port)])
    one_line_error(rc, capsys.readouterr().err, needle)


def test_reward_option_values_are_checked_for_training_too():
    with pytest.raises(ConfigError, match="'reward.options.jpeg_compressibility.quality' expects int"):
        build_reward("jpeg_compressibility", quality="abc")
    assert build_reward("jpeg_compressibility", quality=90).quality == 90


# --------------------------------------------------------------------------- request framing


def test_a_request_framed_twice_is_refused_and_its_connection_closed():
    """Content-Length and Transfer-Encoding: chunked, the chunked body empty and a whole second
    request after it within the Content-Length: 400, then the connection closes; nothing is scored."""
    inner = json.dumps({"prompts": ["a"], "images": encode_png_b64(IMAGES[:1])}).encode()
    hidden = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(inner)) + inner
    body = b"0\r\n\r\n" + hidden
    request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n" % len(body)) + body
    app = create_app(build_reward("jpeg_compressibility"))
    with ServerThread(app) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):  # b"" once the server closes the connection
                answer += chunk
        assert app.state.batcher.requests == 0
    assert answer.startswith(b"HTTP/1.1 400 ") and b"connection: close" in answer.lower()
    assert answer.count(b"HTTP/1.1 ") == 1
