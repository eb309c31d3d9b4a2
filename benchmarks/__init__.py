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


def check_output_paths(out_dir: str | Path | None, json_path: str | Path | None) -> None:
    """Before the work: a UserError when ``out_dir`` (:func:`output_dir`) is an existing file or
    ``json_path`` (:func:`write_json`) an existing folder; both are created otherwise."""
    from flowgrpo.disk import check_output_folder
    from flowgrpo.errors import UserError

    if out_dir is not None:
        check_output_folder(out_dir, "--out")
    if json_path and Path(json_path).is_dir():
        raise UserError(f"--json {json_path} is a folder; give a file path")


def write_json(json_path: str | Path | None, data: dict | list) -> None:
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


def number_or_dash(x, fmt: str = "{:.3f}") -> str:
    """A table cell: ``x`` in ``fmt``, or "-" where it was not measured (None)."""
    return "-" if x is None else fmt.format(x)


def print_table(columns: list[str] | tuple[str, ...], cells: list[list[str]], *, title: str = "", caption: str = "",
                left: tuple[str, ...] = (), styles: list[str | None] | None = None, width: int = 160) -> None:
    """Print a benchmark's table: ``cells`` (rows of strings under ``columns``) as a rich table with
    ``title`` and ``caption``, the ``left`` columns (default: the first) left-aligned and the others
    right-aligned, row ``i`` in ``styles[i]`` (e.g. "red"); plain text where rich is missing."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover
        print(title)
        for row in [list(columns), *cells]:
            print(" | ".join(row))
        print(caption)
        return
    left = left or (columns[0],)
    table = Table(title=title or None, caption=caption or None)
    for c in columns:
        table.add_column(c, justify="left" if c in left else "right", no_wrap=True)
    for i, row in enumerate(cells):
        table.add_row(*row, style=styles[i] if styles else None)
    Console(width=width).print(table)
