"""Latency and throughput of the reward server under concurrent clients.

    flowgrpo bench reward-server [--out DIR] [--json PATH]
    python -m flowgrpo.benchmarks.bench_reward_server [--out DIR] [--json PATH] [--reward jpeg_compressibility]
        [--clients 8] [--requests 50] [--images 4] [--size 64] [--max-batch 32] [--window-ms 5]

Starts ``flowgrpo serve-reward`` on a free loopback port (a subprocess), then runs one client and
then ``--clients`` concurrent clients (threads with httpx), each sending ``--requests`` requests
of ``--images`` PNG images (``--size`` pixels square; encoded beforehand, so the latency is the
round trip: upload, decoding, batching, the reward, the answer). Reports p50/p90/p99 latency,
requests/s and images/s, and the reward batch sizes the server formed (from ``/stats``); the
in-process reward's images/s on the same images is the reference. Writes ``reward_server.csv``
and ``reward_server.png`` into ``--out`` (default: the current directory) and the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import threading
import time
from pathlib import Path

import numpy as np
import torch

from flowgrpo.rewards import build_reward
from flowgrpo.rewards.remote import encode_png_b64
from flowgrpo.serve import free_port, start_server_process

from . import output_dir, write_json

COLUMNS = ("clients", "requests", "images_per_request", "p50_ms", "p90_ms", "p99_ms", "mean_ms", "req_per_s",
           "images_per_s", "batches", "mean_batch", "max_batch")


def _payloads(n: int, images: int, size: int) -> list[dict]:
    """``n`` distinct request bodies of ``images`` random-smooth RGB images [size x size]."""
    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        x = torch.rand(images, 3, size, size, generator=g) ** (1 + k % 4)
        out.append({"prompts": [f"request {k} image {j}" for j in range(images)], "images": encode_png_b64(x)})
    return out


def _load(url: str, clients: int, requests: int, payloads: list[dict]) -> tuple[list[float], float]:
    """``clients`` threads x ``requests`` POSTs. Returns every latency (s) and the wall-clock (s)."""
    import httpx

    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors: list[str] = []
    start = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        with httpx.Client(timeout=60) as http:
            http.get(f"{url}/health")  # connect before the clock starts
            start.wait()
            for r in range(requests):
                t0 = time.perf_counter()
                resp = http.post(f"{url}/score", json=payloads[(c * requests + r) % len(payloads)])
                latencies[c].append(time.perf_counter() - t0)
                if resp.status_code != 200:
                    errors.append(f"{resp.status_code} {resp.text[:200]}")

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return [x for lat in latencies for x in lat], wall


def _batch_sizes(url: str) -> dict[int, int]:
    import httpx

    return {int(k): v for k, v in httpx.get(f"{url}/stats").json()["batch_sizes"].items()}


def bench_reward_server(reward: str = "jpeg_compressibility", clients: int = 8, requests: int = 50, images: int = 4,
                        size: int = 64, max_batch: int = 32, window_ms: float = 5.0) -> dict:
    """Run the server and the load (1 client, then ``clients``). Returns one row per load level
    (latency percentiles in ms, req/s, images/s, batch sizes) and the in-process reference."""
    payloads = _payloads(max(64, clients), images, size)
    ref_images = torch.rand(64, 3, size, size, generator=torch.Generator().manual_seed(1))
    fn = build_reward(reward)
    t0 = time.perf_counter()
    fn(ref_images, ["p"] * len(ref_images))
    in_process = len(ref_images) / (time.perf_counter() - t0)
    port = free_port()
    proc = start_server_process(reward, port, extra=["--max-batch", str(max_batch), "--window-ms", str(window_ms)])
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for level in sorted({1, clients}):
            before = _batch_sizes(url)
            lat, wall = _load(url, level, requests, payloads)
            after = _batch_sizes(url)
            seen = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) > before.get(k, 0)}
            ms = np.asarray(lat) * 1000
            n_batches = sum(seen.values())
            rows.append({"clients": level, "requests": len(lat), "images_per_request": images,
                         "p50_ms": float(np.percentile(ms, 50)), "p90_ms": float(np.percentile(ms, 90)),
                         "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
                         "req_per_s": len(lat) / wall, "images_per_s": len(lat) * images / wall,
                         "batches": n_batches, "mean_batch": sum(k * v for k, v in seen.items()) / max(1, n_batches),
                         "max_batch": max(seen, default=0), "batch_sizes": dict(sorted(seen.items())),
                         "latencies_ms": ms.round(3).tolist()})
    finally:
        proc.kill()
        proc.wait()
    return {"reward": reward, "image_size": size, "max_batch": max_batch, "window_ms": window_ms,
            "threads": torch.get_num_threads(),
            "in_process_images_per_s": in_process, "rows": rows}


def write_outputs(res: dict, out_dir: Path) -> None:
    """``reward_server.csv`` (one row per load level) and ``reward_server.png`` (latency CDFs, batch sizes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with (out_dir / "reward_server.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in res["rows"]:
            w.writerow([f"{r[c]:.3f}" if isinstance(r[c], float) else r[c] for c in COLUMNS])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    for r in res["rows"]:
        ms = np.sort(r["latencies_ms"])
        ax1.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=f"{r['clients']} client(s): {r['req_per_s']:.0f} req/s")
        ax2.bar([k + (0.2 if r["clients"] > 1 else -0.2) for k in r["batch_sizes"]], list(r["batch_sizes"].values()),
                width=0.4, label=f"{r['clients']} client(s)")
    ax1.set_xscale("log")
    ax1.set_xlabel("request latency (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("images per reward call (batch size)")
    ax2.set_ylabel("reward calls")
    ax2.legend(fontsize=8)
    fig.suptitle(f"reward server: {res['reward']}, {res['rows'][0]['images_per_request']} images of "
                 f"{res['image_size']} px per request, max batch {res['max_batch']}, window {res['window_ms']:g} ms",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out_dir / "reward_server.png", dpi=120)
    plt.close(fig)


def run_bench_reward_server(json_path: str | None = None, out_dir: str | Path | None = None, quiet: bool = False,
                            **kwargs) -> dict:
    """Benchmark (``kwargs``: see :func:`bench_reward_server`), print a table, write CSV/PNG/JSON."""
    from rich.console import Console
    from rich.table import Table

    res = bench_reward_server(**kwargs)
    write_outputs(res, output_dir(out_dir))
    write_json(json_path, {**res, "rows": [{k: v for k, v in r.items() if k != "latencies_ms"} for r in res["rows"]]})
    if not quiet:
        ref = res["in_process_images_per_s"]
        table = Table(title=f"reward server ({res['reward']}; in-process: {ref:.0f} images/s)")
        for col in ("clients", "requests", "p50 ms", "p99 ms", "req/s", "images/s", "batch sizes (mean / max)"):
            table.add_column(col, justify="right")
        for r in res["rows"]:
            table.add_row(str(r["clients"]), str(r["requests"]), f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                          f"{r['req_per_s']:.0f}", f"{r['images_per_s']:.0f}",
                          f"{r['mean_batch']:.1f} / {r['max_batch']}")
        Console().print(table)
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--out", default=None, help="folder of reward_server.csv / .png (default: the current directory)")
    ap.add_argument("--reward", default="jpeg_compressibility")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=50, help="requests per client")
    ap.add_argument("--images", type=int, default=4, help="images per request")
    ap.add_argument("--size", type=int, default=64, help="image side in pixels")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--window-ms", type=float, default=5.0, help="the server's batching window")
    args = ap.parse_args(argv)
    run_bench_reward_server(args.json, args.out, reward=args.reward, clients=args.clients, requests=args.requests,
                            images=args.images, size=args.size, max_batch=args.max_batch, window_ms=args.window_ms)


if __name__ == "__main__":
    main()
