"""Throughput of ``flowgrpo unigenbench score`` against a judge with a fixed service time.

    python -m flowgrpo.benchmarks.unigenbench_judge [--out DIR] [--json PATH] [--sizes 256 1024]
        [--prompts 600] [--images-per-prompt 4] [--workers 16] [--service-ms 20 [100 ...]]

Starts the fake judge (:mod:`flowgrpo.unigenbench.fake_judge`) in its own process on a free
loopback port, answering every request after ``--service-ms`` (an async sleep, so it serves any
number at once), and scores ``--prompts`` x ``--images-per-prompt`` images of the English set with
the real command path (:func:`~flowgrpo.unigenbench.score.score_folder`: per-image JPEG encoding,
the shared ChatClient with ``--workers`` in flight, one judgements.jsonl line per answer), once
per image size and service time. Eight distinct images per size are hard-linked to every ``{index}_{j}.png``: each
request still reads, decodes and JPEG-encodes its file.

Reported per row: requests/s; the judge's own service time per request (measured inside its
handler, from ``/stats``); the bound ``workers / service time`` a client with no overhead would
reach and the share of it reached; the client's CPU time per request (this process: reading,
JPEG + base64 encoding, JSON, HTTP, parsing, the log line), i.e. the time the client itself spends
on a request apart from waiting on the server; and the mean HTTP exchange as the client saw it
minus the judge's service time (transport and queueing). Writes ``unigenbench_judge.csv`` into
``--out`` (default: the current directory) and the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from . import output_dir, write_json

COLUMNS = ("image_px", "service_ms", "requests", "workers", "wall_s", "req_per_s", "judge_service_ms", "bound_req_per_s",
           "share_of_bound", "client_cpu_ms_per_req", "exchange_minus_service_ms", "failed")


def _images(folder: Path, prompts, per_prompt: int, size: int) -> None:
    """Hard-link 8 distinct smooth RGB images of ``size`` px to every ``{index}_{j}.png``."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    yy, xx = np.mgrid[0:size, 0:size] / size
    bases = []
    for k in range(8):
        rgb = np.stack([np.sin(6 * xx + k), np.cos(5 * yy - k), np.sin(4 * (xx + yy) + 2 * k)], -1)
        path = folder / f"base_{k}.png"
        Image.fromarray(((rgb + 1) * 127.5).astype(np.uint8)).save(path)
        bases.append(path)
    for n, p in enumerate(prompts):
        for j in range(per_prompt):
            os.link(bases[(n * per_prompt + j) % 8], folder / f"{p.index}_{j}.png")


def _score_once(images: Path, results: Path, ps, prompts: int, per_prompt: int, workers: int,
                service_ms: float) -> dict:
    """Score ``images`` against a fresh fake judge process; one result row."""
    import httpx

    from flowgrpo.serve import free_port
    from flowgrpo.serve.server import wait_healthy
    from flowgrpo.unigenbench.score import JudgeOptions, score_folder

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    judge = wait_healthy([sys.executable, "-m", "flowgrpo.unigenbench.fake_judge", "--port", str(port),
                          "--service-ms", str(service_ms)], url)
    try:
        opts = JudgeOptions(url + "/v1", model="fake", workers=workers, timeout=60.0, retries=1)
        cpu0, t0 = time.process_time(), time.perf_counter()
        summary = score_folder(images, ps, results, opts, images_per_prompt=per_prompt, limit=prompts,
                               progress=False, report=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        lines = (results / "judgements.jsonl").read_text().splitlines()
        exchange = sum(json.loads(line)["seconds"] for line in lines) / len(lines)
        stats = httpx.get(url + "/stats").json()
    finally:
        judge.terminate()
        judge.wait(timeout=30)
    n, service = summary["this_run"]["requests"], stats["service_mean_s"]
    return {"image_px": 0, "service_ms": service_ms, "requests": n, "workers": workers, "wall_s": round(wall, 3),
            "req_per_s": round(n / wall, 1), "judge_service_ms": round(1000 * service, 2),
            "bound_req_per_s": round(workers / service, 1), "share_of_bound": round(n / wall * service / workers, 3),
            "client_cpu_ms_per_req": round(1000 * cpu / n, 2),
            "exchange_minus_service_ms": round(1000 * (exchange - service), 2), "failed": summary["failed"]}


def bench_unigenbench_judge(sizes=(256, 1024), service_ms=(20.0,), prompts: int = 600, images_per_prompt: int = 4,
                            workers: int = 16) -> list[dict]:
    """One row (dict of :data:`COLUMNS`) per (image size, judge service time)."""
    import importlib

    from flowgrpo.unigenbench.prompts import load_prompt_set

    importlib.import_module("flowgrpo.rewards.openai_client")  # imports torch: a start-up cost kept out of the timing

    ps = load_prompt_set("en")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in sizes:
            images = Path(tmp) / f"images_{size}"
            _images(images, ps.prompts[:prompts], images_per_prompt, size)
            for ms in service_ms:
                row = _score_once(images, Path(tmp) / f"results_{size}_{ms}", ps, prompts, images_per_prompt,
                                  workers, ms)
                rows.append({**row, "image_px": size})
    return rows


def run_bench_unigenbench_judge(json_path: str | None = None, out_dir: str | Path | None = None, quiet: bool = False,
                                **kwargs) -> list[dict]:
    """Run the benchmark, print the table, write ``unigenbench_judge.csv`` (and the JSON)."""
    rows = bench_unigenbench_judge(**kwargs)
    out = output_dir(out_dir)
    with open(out / "unigenbench_judge.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    write_json(json_path, {"rows": rows, "settings": kwargs})
    if not quiet:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="flowgrpo unigenbench score against a fixed-service-time judge")
        for col in COLUMNS:
            table.add_column(col, justify="right")
        for row in rows:
            table.add_row(*(str(row[c]) for c in COLUMNS))
        Console(width=170).print(table)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for unigenbench_judge.csv (default: the current directory)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024], help="image sizes in pixels (square)")
    ap.add_argument("--prompts", type=int, default=600)
    ap.add_argument("--images-per-prompt", type=int, default=4)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--service-ms", type=float, nargs="+", default=[20.0],
                    help="the fake judge's service time(s) per request (ms)")
    args = ap.parse_args(argv)
    run_bench_unigenbench_judge(args.json, args.out, sizes=args.sizes, prompts=args.prompts,
                                images_per_prompt=args.images_per_prompt, workers=args.workers,
                                service_ms=args.service_ms)


if __name__ == "__main__":
    main()
