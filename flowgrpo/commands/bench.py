"""``flowgrpo bench WHAT``: the benchmark subcommand (its arguments and which benchmark runs).

Every benchmark lives in ``flowgrpo.benchmarks`` (the repository's ``benchmarks/`` folder) and is
imported only when it runs. Each is called as ``run(json_path, out_dir=..., **options)``, where the
options are the subcommand's flags that this benchmark takes and the user set (0 / None: the
benchmark's own default).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchEntry:
    """One benchmark: its module in ``flowgrpo.benchmarks``, its run function, the output-folder
    keyword of that function and the optional flags (``repeats``, ``minutes``) it accepts."""

    module: str
    function: str
    out_keyword: str = "out_dir"
    options: tuple[str, ...] = ()


BENCHMARKS: dict[str, BenchEntry] = {
    "ops": BenchEntry("bench_ops", "run_bench_ops", options=("repeats",)),
    "samplers": BenchEntry("bench_samplers", "run_bench_samplers"),
    "e2e": BenchEntry("bench_e2e", "run_bench_e2e", options=("minutes",)),
    "profile": BenchEntry("bench_profile", "run_bench_profile"),
    "reward-server": BenchEntry("bench_reward_server", "run_bench_reward_server"),
    "plugin": BenchEntry("bench_plugin", "run_bench_plugin", out_keyword="out"),
    "scaling": BenchEntry("bench_scaling", "run_bench_scaling"),
    "overlap": BenchEntry("bench_overlap", "run_bench_overlap"),
    "schedulers": BenchEntry("bench_schedulers", "run_bench_schedulers"),
    "reference": BenchEntry("bench_reference", "run_bench_reference", options=("repeats",)),
    "gpu": BenchEntry("bench_gpu", "run_bench_gpu", options=("repeats", "device", "tiny", "flow_grpo", "stages",
                                                                   "time_budget")),
    "memory": BenchEntry("bench_memory", "run_bench_memory", options=(
        "recipe", "all_recipes", "gpus", "markdown", "resolution", "frames", "micro_batch")),
}


def add_bench_parser(sub) -> None:
    """Add ``bench`` to the CLI's subparsers ``sub``."""
    b = sub.add_parser("bench", help="benchmarks (print a table, write CSV/PNG)")
    b.add_argument("what", choices=list(BENCHMARKS))
    b.add_argument("--out", default=None, metavar="DIR",
                   help="folder for the CSV and PNG (created; default: the current directory)")
    b.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    b.add_argument("--repeats", type=int, default=0,
                   help="timed repetitions (ops, reference, gpu; 0 = the benchmark's default)")
    b.add_argument("--flow-grpo", default=None, metavar="PATH",
                   help="reference, gpu: a checkout of github.com/yifan123/flow_grpo whose SD3 (gpu: and FLUX) "
                        "functions are timed")
    b.add_argument("--minutes", type=float, default=0.0,
                   help="training budget per preset in minutes (e2e; 0 = the benchmark's default)")
    b.add_argument("--device", default=None, choices=("cuda", "cpu"), help="gpu: where to run (default: CUDA if any)")
    b.add_argument("--tiny", action="store_true", help="gpu: a tiny SD3 and small op sizes (the test suite's CPU form)")
    b.add_argument("--stages", default=None, metavar="LIST",
                   help="gpu: comma-separated stages to run, of rollout_update, levers, flux, wan, memory, objectives, "
                        "ops (default: all)")
    b.add_argument("--time-budget", type=float, default=0.0, metavar="S",
                   help="gpu: seconds for the whole call; stages that no longer fit are skipped (default 470)")
    # memory: real-size recipes without weights (flowgrpo.realsize); none of these = the measured runs
    b.add_argument("--recipe", default=None, help="memory: size this recipe's real model on the meta device")
    b.add_argument("--all", dest="all_recipes", action="store_true", help="memory: every recipe")
    b.add_argument("--gpus", type=int, default=0, help="memory: GPUs of the data-parallel / FSDP layouts (default 8)")
    b.add_argument("--markdown", default=None, metavar="FILE",
                   help="memory: put the table between FILE's memory-table markers")
    for flag in ("resolution", "frames", "micro-batch"):
        b.add_argument(f"--{flag}", type=int, default=0, help=f"memory: {flag} instead of the recipe's")
    b.set_defaults(fn=run_bench_command)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what``; its CSV/PNG go into ``--out`` (None: the current directory)."""
    entry = BENCHMARKS[args.what]
    leading = []
    if args.what == "reference":
        if not args.flow_grpo:
            print("flowgrpo: bench reference needs --flow-grpo PATH (a checkout of github.com/yifan123/flow_grpo)",
                  file=sys.stderr)
            return 2
        leading = [args.flow_grpo]
    run = getattr(importlib.import_module(f"flowgrpo.benchmarks.{entry.module}"), entry.function)
    options = {name: getattr(args, name) for name in entry.options if getattr(args, name, None)}
    if "stages" in options:
        from flowgrpo.benchmarks.bench_gpu import parse_stages

        try:
            options["stages"] = parse_stages(options["stages"])
        except ValueError as exc:
            print(f"flowgrpo: bench gpu --stages: {exc}", file=sys.stderr)
            return 2
    run(*leading, args.json, **{entry.out_keyword: args.out}, **options)
    return 0
