"""The reward server under the requests that exhausted it (issue 31): peak memory, slow connections,
and a body of millions of tiny JSON values, each with the latency of an authorised ``/health``.

    python -m flowgrpo.benchmarks.bench_server_limits [--root REPO] [--json PATH] [--only memory,slowloris,json]

``--root``: the repository whose server code runs (default: the installed one), so that an older
commit checked out with ``git worktree add`` can be measured with the same client. Scenarios, each
on a fresh ``flowgrpo serve-reward`` subprocess on loopback with a bearer token:

- ``memory``: one request, then (fresh server) six concurrent requests, of five 4096 x 4096 PNGs
  (a smooth gradient, about 0.4 MB each) to the ``shapes`` reward; the server's peak resident set
  (VmHWM) before and after. A 503 is retried after its ``Retry-After`` (up to 5 times, as the
  ``remote`` reward retries), and the 503 answers are counted. The prompts do not parse as shapes prompts, so the reward's work is its
  float -> uint8 conversion of the batch, not the scene check.
- ``slowloris``: the server runs with ``ulimit -n 1024``; 1,100 connections each send a request
  line and one header, never the blank line that ends the header block. Then one authorised
  ``/health`` (its latency and status), how many of the held connections the server has closed over
  time, and whether the server logged "Too many open files".
- ``json``: a 60 MB body ``{"prompts": [[], [], ...` of 20 M empty lists (within the 64 MiB body
  limit); the answer, its time, the server's peak-RSS growth, and the slowest of the ``/health``
  requests sent every 0.1 s meanwhile.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from flowgrpo.serve import free_port

from . import write_json

TOKEN = "bench-secret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# Runs the CLI of the repository at argv[1] (its flowgrpo/ plus the rewards/, samplers/, benchmarks/
# folders that install as flowgrpo subpackages) instead of the editable install's
BOOT = ("import sys; root = sys.argv.pop(1); "
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
        "sys.path.insert(0, root); import flowgrpo; flowgrpo.__path__.append(root); "
        "from flowgrpo.cli import main; sys.exit(main())")


def peak_rss_mib(pid: int) -> float:
    """Peak resident set of ``pid`` so far (VmHWM), MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM")


class Server:
    """``flowgrpo serve-reward`` of ``root`` on a free loopback port, token required, stderr kept."""

    def __init__(self, root: str | None, reward: str = "shapes", nofile: int | None = None, extra: list[str] = ()):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        head = [sys.executable, "-c", BOOT, root] if root else [sys.executable, "-m", "flowgrpo.cli"]
        cmd = head + ["serve-reward", "--reward", reward, "--port", str(self.port), "--token-env", "BENCH_TOKEN",
                      "--log-level", "warning", *extra]
        env = dict(os.environ, BENCH_TOKEN=TOKEN, OMP_NUM_THREADS="1")

        def limit_files():
            if nofile:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=self.log, text=True,
                                     preexec_fn=limit_files)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/health", headers=AUTH, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"the server did not start: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def health_ms(url: str, timeout: float = 60.0) -> tuple[float, str]:
    """One authorised GET /health: (milliseconds, status or the error's type)."""
    import httpx

    t0 = time.perf_counter()
    try:
        status = str(httpx.get(f"{url}/health", headers=AUTH, timeout=timeout).status_code)
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return (time.perf_counter() - t0) * 1000, status


def gradient_png_b64(size: int, seed: int) -> str:
    """A smooth RGB gradient [size x size] as base64 PNG (compresses to well under 1 MB)."""
    from PIL import Image

    ramp = np.linspace(0, 255, size, dtype=np.float32)
    arr = np.stack([np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, 255 - ramp) / 2,
                    np.full((size, size), 40.0 * seed % 256)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG", compress_level=6)
    return base64.b64encode(buf.getvalue()).decode()


def bench_memory(root: str | None, concurrent: int, images: int = 5, size: int = 4096) -> dict:
    """``concurrent`` simultaneous requests of ``images`` PNGs [size x size]: statuses, seconds,
    the server's peak RSS before and after (MiB)."""
    import httpx

    pngs = [gradient_png_b64(size, k) for k in range(images)]
    body = {"prompts": ["p"] * images, "images": pngs}
    srv = Server(root)
    try:
        before = peak_rss_mib(srv.proc.pid)
        statuses: list[str] = []

        refused: list[int] = []

        def send():  # as the remote reward does: a 503 is retried after its Retry-After, up to 5 times
            for _ in range(6):
                try:
                    resp = httpx.post(f"{srv.url}/score", json=body, headers=AUTH, timeout=600)
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)
                    return
                if resp.status_code != 503:
                    break
                refused.append(1)
                time.sleep(float(resp.headers.get("retry-after", 1)))
            statuses.append(str(resp.status_code))

        t0 = time.perf_counter()
        threads = [threading.Thread(target=send) for _ in range(concurrent)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
        peak = peak_rss_mib(srv.proc.pid)
    finally:
        srv.close()
    return {"concurrent": concurrent, "images": images, "size": size, "statuses": sorted(statuses),
            "answers_503": len(refused),
            "seconds": round(seconds, 1), "rss_before_mib": round(before), "rss_peak_mib": round(peak),
            "body_mb": round(sum(map(len, pngs)) / 1e6, 2)}


def bench_slowloris(root: str | None, connections: int = 1100, nofile: int = 1024, watch_s: float = 60.0) -> dict:
    """``connections`` held with an unfinished header block against a server with ``ulimit -n nofile``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 256)), hard))
    srv = Server(root, nofile=nofile)
    socks: list[socket.socket] = []
    try:
        t0 = time.monotonic()
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n")  # never the blank line
            s.setblocking(False)
            socks.append(s)
        opened_s = time.monotonic() - t0
        time.sleep(1.0)
        ms, status = health_ms(srv.url, timeout=30)
        open_at: dict[str, int] = {}
        by_fd = {s.fileno(): s for s in socks}
        poller = select.poll()  # select() stops at file descriptor 1024
        for fd in by_fd:
            poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        alive = set(by_fd)
        start = time.monotonic()
        for mark in (2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 170):
            if mark > watch_s:
                break
            while time.monotonic() - start < mark and alive:
                for fd, _ in poller.poll(200):
                    try:
                        gone = by_fd[fd].recv(4096) == b""
                    except OSError:
                        gone = True
                    if gone:
                        alive.discard(fd)
                        poller.unregister(fd)
            open_at[f"{mark}s"] = len(alive)
        ms_after, status_after = health_ms(srv.url, timeout=30)
        log = srv.stderr()
    finally:
        for s in socks:
            s.close()
        srv.close()
    return {"connections": connections, "server_nofile": nofile, "open_seconds": round(opened_s, 1),
            "health_ms": round(ms, 1), "health_status": status, "still_open": open_at,
            "health_after_ms": round(ms_after, 1), "health_after_status": status_after,
            "too_many_open_files_logged": "Too many open files" in log,
            "server_log_lines": [ln for ln in log.splitlines() if ln.strip()][:5]}


def bench_json(root: str | None, megabytes: float = 60.0) -> dict:
    """A body of ``megabytes`` of empty lists under 'prompts', with /health every 0.1 s meanwhile."""
    import httpx

    n = int(megabytes * 1e6) // 3
    body = b'{"prompts": [' + b"[]," * (n - 1) + b'[]], "images": []}'
    srv = Server(root)
    try:
        before = peak_rss_mib(srv.proc.pid)
        done = threading.Event()
        latencies: list[float] = []

        def probe():
            while not done.is_set():
                latencies.append(health_ms(srv.url, timeout=120)[0])
                time.sleep(0.1)

        prober = threading.Thread(target=probe)
        prober.start()
        t0 = time.perf_counter()
        try:
            resp = httpx.post(f"{srv.url}/score", content=body, timeout=600,
                              headers={**AUTH, "content-type": "application/json"})
            answer = f"{resp.status_code} {resp.text[:160]}"
        except httpx.HTTPError as exc:
            answer = type(exc).__name__
        seconds = time.perf_counter() - t0
        time.sleep(0.3)
        done.set()
        prober.join()
        peak = peak_rss_mib(srv.proc.pid)
    finally:
        srv.close()
    return {"body_mb": round(len(body) / 1e6, 1), "values": n, "answer": answer, "seconds": round(seconds, 2),
            "rss_before_mib": round(before), "rss_peak_mib": round(peak),
            "health_max_ms": round(max(latencies), 1), "health_probes": len(latencies)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", default=None, help="repository whose server runs (default: the installed flowgrpo)")
    ap.add_argument("--only", default="memory,slowloris,json", help="comma-separated scenarios")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--watch-s", type=float, default=60.0, help="how long to watch the held connections")
    args = ap.parse_args(argv)
    which = args.only.split(",")
    res: dict = {"root": args.root or "installed"}
    if "memory" in which:
        res["memory_one"] = bench_memory(args.root, 1)
        print("one request:", res["memory_one"], flush=True)
        res["memory_six"] = bench_memory(args.root, 6)
        print("six at once:", res["memory_six"], flush=True)
    if "slowloris" in which:
        res["slowloris"] = bench_slowloris(args.root, watch_s=args.watch_s)
        print("slowloris:", res["slowloris"], flush=True)
    if "json" in which:
        res["json"] = bench_json(args.root)
        print("60 MB of empty lists:", res["json"], flush=True)
    write_json(args.json, res)
    return res


if __name__ == "__main__":
    main()
