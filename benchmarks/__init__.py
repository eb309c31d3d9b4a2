"""Benchmarks, installed as ``flowgrpo.benchmarks`` (the folder sits at the repository root).

Run them as ``flowgrpo bench ops|samplers|e2e|profile|reward-server [--out DIR] [--json PATH]`` or
``python -m flowgrpo.benchmarks.bench_ops``. Every benchmark writes its CSV and PNG into ``--out``
(default: the current working directory) and its JSON to ``--json``; nothing is written next to
the installed code. ``benchmarks/results/`` in the repository holds the reference results quoted
in the README; it is not installed and is not a default output location.
"""

from __future__ import annotations

from pathlib import Path


def output_dir(out_dir: str | Path | None = None) -> Path:
    """The folder a benchmark writes its CSV/PNG into: ``out_dir``, else the current directory (created)."""
    path = Path(out_dir) if out_dir is not None else Path.cwd()
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(json_path: str | Path | None, data: dict) -> None:
    """Write ``data`` as indented JSON to ``json_path`` (its folder created), if a path is given."""
    if json_path:
        import json

        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2))


def write_csv(path: str | Path, rows: list[dict], columns: list[str] | tuple[str, ...] | None = None) -> None:
    """Write ``rows`` (dicts) as CSV with a header of ``columns`` (default: the first row's keys)."""
    import csv

    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(columns or rows[0]))
        w.writeheader()
        w.writerows(rows)


def print_table(rows: list[dict], columns: list[str] | tuple[str, ...], first_width: int = 20) -> None:
    """Print ``rows`` as an aligned table: the first column left-aligned, numbers with 3 decimals."""
    def cell(v, width, left=False):
        text = f"{v:.3f}" if isinstance(v, float) else str(v)
        return text.ljust(width) if left else text.rjust(width)

    widths = [first_width] + [max(len(c), 8) for c in columns[1:]]
    print(" ".join(cell(c, w, i == 0) for i, (c, w) in enumerate(zip(columns, widths))))
    for r in rows:
        print(" ".join(cell(r[c], w, i == 0) for i, (c, w) in enumerate(zip(columns, widths))))
