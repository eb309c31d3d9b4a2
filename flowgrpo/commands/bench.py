"""``flowgrpo bench WHAT``: the benchmark subcommand (its arguments and which benchmark runs).

Every benchmark lives in ``flowgrpo.benchmarks`` (the repository's ``benchmarks/`` folder) and is
imported only when it runs. Each is called as ``run(json_path, out_dir=..., **options)``, where the
options are the subcommand's flags that this benchmark takes and the user set (0 / None: the
benchmark's own default).
"""

from __future__ import annotations

import argparse
import importlib
import math
from dataclasses import dataclass

from ..errors import UserError


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


#: the option flags (argparse destinations), some benchmarks' only; --out and --json are every one's
OPTION_FLAGS = ("repeats", "flow_grpo", "minutes", "device", "tiny", "stages", "time_budget", "recipe", "all_recipes",
                "gpus", "markdown", "resolution", "frames", "micro_batch")


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
    # the unset value of each option flag, read back from the parser so no default is written twice
    b.set_defaults(fn=run_bench_command, option_defaults={name: b.get_default(name) for name in OPTION_FLAGS})


#: the memory flags that size a recipe, meaningless for the measured tiny runs
_RECIPE_ONLY = ("gpus", "markdown", "resolution", "frames", "micro_batch")
#: the largest --repeats; a guard against a typo turning a benchmark into an endless loop
MAX_REPEATS = 10_000


def _flag(name: str) -> str:
    return "--all" if name == "all_recipes" else "--" + name.replace("_", "-")


def check_bench_flags(args: argparse.Namespace) -> None:
    """A UserError naming the first bad flag of ``flowgrpo bench``, before anything runs.

    Refused: a flag the chosen benchmark does not take (it was silently ignored); ``--repeats``
    outside 0..MAX_REPEATS; ``--minutes`` / ``--time-budget`` negative or not finite (NaN passed every
    comparison); ``--gpus`` below 0; ``--resolution`` not a multiple of 16 (every recipe's VAE and
    patching need it) or ``--frames`` not 4k + 1 (the video VAEs compress time 4x, keeping the first
    frame); the memory sizing flags without ``--recipe`` / ``--all``; an unknown ``--recipe``;
    ``--out`` an existing file and ``--json`` an existing folder."""
    entry = BENCHMARKS[args.what]
    taken = set(entry.options) | ({"flow_grpo"} if args.what == "reference" else set())
    for name, unset in args.option_defaults.items():
        if getattr(args, name) != unset and name not in taken:  # NaN != anything: a NaN flag counts as given
            takes = ", ".join([_flag(n) for n in OPTION_FLAGS if n in taken] + ["--out", "--json"])
            raise UserError(f"bench {args.what} does not take {_flag(name)} (its flags: {takes})")
    if not 0 <= args.repeats <= MAX_REPEATS:
        raise UserError(f"--repeats must be in 0..{MAX_REPEATS} (0: the benchmark's default), got {args.repeats}")
    for name in ("minutes", "time_budget"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise UserError(f"{_flag(name)} must be a finite number >= 0 (0: the benchmark's default), got {value:g}")
    for name in ("gpus", "resolution", "frames", "micro_batch"):
        if getattr(args, name) < 0:
            raise UserError(f"{_flag(name)} must be >= 0 (0: the recipe's own), got {getattr(args, name)}")
    if args.resolution % 16:
        raise UserError(f"--resolution must be a multiple of 16 (the VAE's 8x and the 2x2 patches), "
                        f"got {args.resolution}")
    if args.frames and (args.frames - 1) % 4:
        raise UserError(f"--frames must be 4k + 1 (the video VAEs compress time 4x, keeping the first frame), "
                        f"got {args.frames}")
    if args.what == "memory":
        given = [n for n in _RECIPE_ONLY if getattr(args, n)]
        if given and not (args.recipe or args.all_recipes):
            raise UserError(f"{_flag(given[0])} sizes a recipe: add --recipe NAME or --all")
        if args.recipe:
            from ..realsize.configs import recipe_names

            if args.recipe not in recipe_names():
                raise UserError(f"--recipe {args.recipe!r} is not a sized recipe; valid: {', '.join(recipe_names())}")
    from ..benchmarks import check_output_paths

    check_output_paths(args.out, args.json)


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.what``; its CSV/PNG go into ``--out`` (None: the current directory)."""
    entry = BENCHMARKS[args.what]
    check_bench_flags(args)
    leading = []
    if args.what == "reference":
        if not args.flow_grpo:
            raise UserError("bench reference needs --flow-grpo PATH (a checkout of github.com/yifan123/flow_grpo)")
        leading = [args.flow_grpo]
    run = getattr(importlib.import_module(f"flowgrpo.benchmarks.{entry.module}"), entry.function)
    options = {name: getattr(args, name) for name in entry.options if getattr(args, name, None)}
    if "stages" in options:
        from flowgrpo.benchmarks.bench_gpu import parse_stages

        try:
            options["stages"] = parse_stages(options["stages"])
        except ValueError as exc:
            raise UserError(f"bench gpu --stages: {exc}") from None
    run(*leading, args.json, **{entry.out_keyword: args.out}, **options)
    return 0
