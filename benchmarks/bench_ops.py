"""`flowgrpo bench ops`: the fused GRPO loss op against the PyTorch reference (eager and compiled).

Forward + backward of the loss at N = 64 transitions with D = 16x64x64 and D = 16x128x128 latent
elements, Flow-GRPO configuration (clipped surrogate + KL to a reference mean, no Guard), float32,
on the CPU. Each implementation is timed as the median of ``repeats`` iterations after warm-up
(torch.compile's compilation happens in the warm-up); the implementations take turns inside every
repetition so that load from other processes affects them alike.

Achieved GB/s = the bytes a one-pass implementation must move (forward reads x', mu, mu_ref;
backward reads them again and writes dL/dmu: 7 x N x D x 4 bytes) / time, the same count for every
implementation, against a copy bandwidth (bytes read + written by ``Tensor.copy_`` of the largest
operand) measured in the same run.

Run: ``flowgrpo bench ops [--out DIR] [--json PATH] [--repeats R]`` (or
``python -m flowgrpo.benchmarks.bench_ops``). Writes ``ops.csv`` and a PNG bar chart ``ops.png``
into ``--out`` (default: the current directory) and the JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import time
import warnings
from pathlib import Path

import torch

from . import output_dir, write_json

N_ROWS = 64
DIMS = (16 * 64 * 64, 16 * 128 * 128)
IMPLS = ("fused", "eager", "compiled")


def _inputs(n: int, d: int, seed: int = 0, device: str | torch.device = "cpu"):
    """The loss's inputs for N = ``n`` rows of ``d`` latent elements (float32, drawn on the CPU, moved to ``device``)."""
    args, kwargs = _cpu_inputs(n, d, seed)
    move = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tuple(move(t) for t in args), {k: move(v) for k, v in kwargs.items()}


def _cpu_inputs(n: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    mo = torch.randn(n, d, generator=g)
    s = 0.1 + 0.5 * torch.rand(n, generator=g)
    x = mo + s[:, None] * torch.randn(n, d, generator=g)
    mu = mo + 0.01 * torch.randn(n, d, generator=g)
    mr = mo + 0.01 * torch.randn(n, d, generator=g)
    logp_old = -0.5 - torch.log(s) - 0.9189385332046727 + 1e-3 * torch.randn(n, generator=g)
    adv = torch.randn(n, generator=g)
    w = torch.ones(n)
    kwargs = dict(clip_range=1e-3, guard=False, mean_ref=mr, kl_sigma=torch.ones(n), beta=0.04)
    return (x, mu, mo, s, logp_old, adv, w), kwargs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_interleaved(impls: dict, args, kwargs, repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds of one forward+backward per implementation. The implementations take turns
    within every repetition, so a load change on a shared machine hits all of them alike. On a GPU
    the device is synchronised before and after each timed call."""
    x, mu0, *rest = args
    state = {name: mu0.clone().requires_grad_(True) for name in impls}

    def step(name):
        mu = state[name]
        mu.grad = None
        _sync(x.device)
        t0 = time.perf_counter()
        impls[name](x, mu, *rest, **kwargs).loss.backward()  # a GRPOLossOutput
        _sync(x.device)
        return time.perf_counter() - t0

    for name in impls:  # warm-up (torch.compile compiles here)
        for _ in range(warmup):
            step(name)
    times = {name: [] for name in impls}
    for _ in range(repeats):
        for name in impls:
            times[name].append(step(name))
    return {name: statistics.median(t) for name, t in times.items()}


def copy_bandwidth(numel: int, repeats: int = 10, device: str | torch.device = "cpu") -> float:
    """GB/s of ``dst.copy_(src)`` (bytes read + written) on ``numel`` float32 elements on ``device``."""
    device = torch.device(device)
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times) / 1e9


def measure(device: str | torch.device = "cpu", repeats: int = 10, dims=DIMS, n: int = N_ROWS,
            impls=IMPLS) -> dict:
    """Seconds and achieved GB/s of the ``impls`` (of :data:`IMPLS`) at each D on ``device``, and the
    copy bandwidth there. Returns {"copy_gbps": x, "rows": [{"D", "impl", "seconds", "gbps"}, ...]}.
    Raises RuntimeError when the fused op has no kernel for ``device``."""
    from flowgrpo.ops import active_backend, grpo_loss, grpo_loss_ref

    device = torch.device(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = active_backend(device)  # builds the extension on first use
    if backend != "compiled":
        raise RuntimeError(f"the fused op has no {device.type} kernel on this machine (see `flowgrpo doctor`)")

    def fused(*a, **k):
        return grpo_loss(*a, **k, backend="fused")

    table = {"fused": lambda: fused, "eager": lambda: grpo_loss_ref,
             "compiled": lambda: torch.compile(grpo_loss_ref, dynamic=False)}
    chosen = {name: table[name]() for name in impls}
    copy_gbps = copy_bandwidth(n * max(dims), repeats=max(repeats, 5), device=device)
    rows = []
    for d in dims:
        args, kwargs = _inputs(n, d, device=device)
        nbytes = 7 * n * d * 4  # fwd: x', mu, mu_ref; bwd: x', mu, mu_ref + write dL/dmu
        secs = _time_interleaved(chosen, args, kwargs, repeats)
        for name in impls:
            rows.append({"D": d, "impl": name, "seconds": secs[name], "gbps": nbytes / secs[name] / 1e9})
        del args, kwargs
    return {"copy_gbps": copy_gbps, "rows": rows}


def run_bench_ops(json_path: str | None = None, repeats: int = 10, dims=DIMS, n: int = N_ROWS,
                  out_dir: str | Path | None = None, quiet: bool = False) -> dict:
    """Time fused / eager / compiled at each D, print a table, write ``json_path`` and
    ``out_dir``/ops.{csv,png} (``out_dir`` default: the current directory).

    Returns {"copy_gbps": x, "rows": [{"D", "impl", "seconds", "gbps"}, ...], ...}.
    """
    measured = measure("cpu", repeats, dims, n)
    copy_gbps, rows = measured["copy_gbps"], measured["rows"]
    result = {
        "copy_gbps": copy_gbps,
        "rows": rows,
        "N": n,
        "config": "float32 CPU, clip + KL (Flow-GRPO), no Guard; forward + backward",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }

    out = output_dir(out_dir)
    write_json(json_path, result)
    _write_csv(out / "ops.csv", rows, copy_gbps)
    _plot(out / "ops.png", rows, copy_gbps)
    if not quiet:
        _print_table(result)
    return result


def _speedups(rows):
    by = {(r["D"], r["impl"]): r["seconds"] for r in rows}
    return {
        (d, impl): by[(d, "eager")] / by[(d, impl)]
        for (d, impl) in by
        if (d, "eager") in by
    }, {
        (d, impl): by[(d, "compiled")] / by[(d, impl)]
        for (d, impl) in by
        if (d, "compiled") in by
    }


def _write_csv(path: Path, rows, copy_gbps: float) -> None:
    vs_eager, vs_comp = _speedups(rows)
    with path.open("w", newline="") as f:
        wr = csv.writer(f)
        wr.writerow(["D", "impl", "seconds", "gbps", "pct_of_copy", "speedup_vs_eager", "speedup_vs_compiled"])
        for r in rows:
            k = (r["D"], r["impl"])
            wr.writerow([r["D"], r["impl"], f"{r['seconds']:.6f}", f"{r['gbps']:.3f}",
                         f"{100 * r['gbps'] / copy_gbps:.1f}", f"{vs_eager.get(k, float('nan')):.3f}",
                         f"{vs_comp.get(k, float('nan')):.3f}"])


def _plot(path: Path, rows, copy_gbps: float) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # pragma: no cover - matplotlib missing
        return
    dims = sorted({r["D"] for r in rows})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(impls)
    for j, impl in enumerate(impls):
        vals = [next(r["gbps"] for r in rows if r["D"] == d and r["impl"] == impl) for d in dims]
        ax.bar([i + j * width for i in range(len(dims))], vals, width, label=impl)
    ax.axhline(copy_gbps, color="k", linestyle="--", linewidth=1, label=f"copy {copy_gbps:.1f} GB/s")
    ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(dims))])
    ax.set_xticklabels([f"D={d}" for d in dims])
    ax.set_ylabel("achieved GB/s (one-pass bytes / time)")
    ax.set_title(f"GRPO loss forward+backward, N={N_ROWS}, float32 CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _print_table(result: dict) -> None:
    rows = result["rows"]
    vs_eager, vs_comp = _speedups(rows)
    try:
        from rich.console import Console
        from rich.table import Table
    except Exception:  # pragma: no cover
        for r in rows:
            print(r)
        return
    t = Table(title=f"GRPO loss fwd+bwd, N={result['N']}, {result['config']} "
                    f"(copy {result['copy_gbps']:.2f} GB/s, {result['threads']} threads)")
    for col in ("D", "impl", "ms", "GB/s", "% copy", "vs eager", "vs compiled"):
        t.add_column(col, justify="right")
    for r in rows:
        k = (r["D"], r["impl"])
        t.add_row(str(r["D"]), r["impl"], f"{1e3 * r['seconds']:.2f}", f"{r['gbps']:.2f}",
                  f"{100 * r['gbps'] / result['copy_gbps']:.0f}%", f"{vs_eager[k]:.2f}x",
                  f"{vs_comp[k]:.2f}x")
    Console().print(t)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--repeats", type=int, default=10, help="timed iterations per measurement")
    ap.add_argument("--out", "--out-dir", dest="out", default=None,
                    help="folder of ops.csv / ops.png (default: the current directory)")
    a = ap.parse_args(argv)
    run_bench_ops(a.json, repeats=a.repeats, out_dir=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
