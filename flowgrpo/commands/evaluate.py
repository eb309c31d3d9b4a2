"""``flowgrpo eval``: the held-out evaluation of a finished run, or a benchmark of any model.

* ``flowgrpo eval RUN [--evaluator NAME] [eval.KEY=VALUE ...] [--json PATH]``: the run's held-out evaluator
  (or the one named: a run trained with ``eval.evaluator=none`` is evaluated afterwards) on its trained
  weights; its rewards and objective are not rebuilt;
* ``flowgrpo eval TARGET --bench NAME [--prompts FILE] --out DIR``: a benchmark of the field (GenEval, OCR,
  PickScore, HPS, ImageReward; :mod:`flowgrpo.benches`) on a run (trained and base side by side), a
  pipeline folder or an exported LoRA (``--base``), resumable; ``--prompts`` defaults to the benchmark's
  shipped prompt set (GenEval, OCR, PickScore) and is required for the others.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError


def eval_overrides(overrides: list[str], evaluator: str | None) -> tuple[str, ...]:
    """The config overrides of ``flowgrpo eval``: ``eval.*`` keys only (the run's model and sampler are its
    own), plus ``--evaluator`` as ``eval.evaluator``; anything else is one UserError naming the key."""
    for override in overrides:
        key = override.split("=", 1)[0]
        if not key.startswith("eval.") or "=" not in override:
            raise UserError(f"flowgrpo eval takes eval.KEY=VALUE settings only, got {override!r} (the run's own "
                            "model and sampler are evaluated; see `flowgrpo config explain eval`)")
    return (*overrides, *([f"eval.evaluator={evaluator}"] if evaluator else []))


def _model_overrides(overrides: list[str]) -> tuple[str, ...]:
    """A benchmark's overrides: ``model.*`` settings of a pipeline or LoRA target (resolution, dtype, guidance)."""
    for override in overrides:
        if not override.startswith("model.") or "=" not in override:
            raise UserError(f"flowgrpo eval --bench takes model.KEY=VALUE settings for a pipeline or LoRA target "
                            f"only, got {override!r}")
    return tuple(overrides)


def cmd_eval(args) -> int:
    """Run ``flowgrpo eval`` (see the module docstring)."""
    if args.bench:
        return _cmd_bench(args)
    for flag, unset in args.bench_flag_defaults.items():
        if getattr(args, flag) != unset:  # the held-out evaluation takes its sizes from eval.* (was silently ignored)
            raise UserError(f"--{flag.replace('_', '-')} belongs to a benchmark: add --bench NAME "
                            "(the held-out evaluation takes eval.KEY=VALUE settings)")
    from ..disk import check_output_file, write_text_atomically
    from ..evaluation import build_evaluator
    from ..trainer.checkpoint import load_trained_policy
    from ..memory_floor import check_evaluation_floor

    # before the evaluation (minutes): a --json path that cannot be written would lose its result
    out = check_output_file(args.json, "--json") if args.json else None
    run = load_trained_policy(Path(args.target), overrides=eval_overrides(args.overrides, args.evaluator))
    cfg, policy, ckpt = run.cfg, run.policy, run.weights.path
    evaluator, note = build_evaluator(cfg.eval, policy, cfg.sampler.shift)
    if evaluator is None:
        raise UserError(note)
    check_evaluation_floor(cfg, policy, evaluator, next(policy.parameters()).device)
    # the JSON keeps the per-sample verdicts ("correct"), so two evaluations can be compared sample by sample
    res = evaluator.evaluate(policy).to_json(with_correct=True)
    res["checkpoint"] = str(ckpt)
    _print_accuracy_table(res, ckpt)
    if out is not None:
        write_text_atomically(out, json.dumps(res, indent=2))
    return 0


def _print_accuracy_table(res: dict, ckpt) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"held-out evaluation of {ckpt}")
    table.add_column("tag")
    table.add_column("accuracy", justify="right")
    for tag, acc in res["per_tag"].items():
        table.add_row(tag, f"{acc:.3f}")
    table.add_row("[bold]overall", f"[bold]{res['accuracy']:.3f}")
    if res.get("num_unseen"):
        table.add_row(f"never-trained prompts ({res['num_unseen']} samples)", f"{res['accuracy_unseen']:.3f}")
    Console().print(table)


def _cmd_bench(args) -> int:
    from ..disk import check_output_folder
    from .bench_eval import BenchOptions, run_bench
    from ..benches.suites import bench_prompts, get_bench
    from ..output.drawing import check_draw_flags
    from ..serve.server import parse_options

    bench = get_bench(args.bench)  # an unknown name lists the valid ones before anything loads
    if args.evaluator or args.json:
        raise UserError("--evaluator and --json belong to the held-out evaluation; a benchmark writes into --out")
    if not args.out:
        raise UserError(f"--bench {args.bench} needs --out DIR")
    check_output_folder(args.out, "--out", "a rerun into it resumes")
    check_draw_flags(seed=args.seed, images_per_prompt=args.images_per_prompt, steps=args.steps,
                     batch_size=args.batch_size)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise UserError(f"--max-prompts must be at least 1, got {args.max_prompts}")
    # --prompts, else the benchmark's shipped set; a benchmark that ships none needs --prompts (one line)
    bench_prompts(bench, args.prompts)
    opts = BenchOptions(bench=args.bench, prompts=args.prompts, out=args.out, base=args.base, seed=args.seed,
                        steps=args.steps, images_per_prompt=args.images_per_prompt, max_prompts=args.max_prompts,
                        batch_size=args.batch_size, options=parse_options(args.option),
                        model_overrides=_model_overrides(args.overrides))
    run_bench(args.target, opts)
    return 0


def register(subparsers) -> None:
    """Add ``eval`` to the ``flowgrpo`` parser's ``subparsers``."""
    from ..benches.suites import bench_names, get_bench

    e = subparsers.add_parser("eval", help="held-out evaluation of a run, or a benchmark (--bench) of any run, "
                                           "pipeline folder or exported LoRA")
    e.add_argument("target", metavar="TARGET", help="a run folder or checkpoint; with --bench also a pipeline "
                                                    "folder or an exported LoRA folder")
    e.add_argument("--json", default=None, help="held-out evaluation: also write the result here")
    e.add_argument("--evaluator", default=None, metavar="NAME",
                   help="the held-out evaluator (default: the run's eval.evaluator; auto: the model's own); "
                        "a run trained with eval.evaluator=none is evaluated with it")
    e.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="eval.* settings of the held-out evaluation (eval.num_prompts=64); with --bench, model.* "
                        "settings of a pipeline or LoRA target (model.resolution=512)")
    b = e.add_argument_group("benchmark (--bench)")
    b.add_argument("--bench", default=None, metavar="NAME", help=f"a benchmark: {', '.join(bench_names())}")
    b.add_argument("--prompts", default=None, metavar="FILE",
                   help="the benchmark's prompt file (.txt or .jsonl); default: the benchmark's shipped set ("
                        f"{', '.join(n for n in bench_names() if get_bench(n).shipped)}), required for the others")
    b.add_argument("--out", default=None, metavar="DIR", help="output folder (a rerun into it resumes)")
    b.add_argument("--base", default=None, metavar="DIR", help="the pipeline folder an exported LoRA was trained on")
    b.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the benchmark's metric (a model weight path, ...); repeatable")
    b.add_argument("--seed", type=int, default=0, help="image j of prompt i starts from noise seed (seed*100000+i)*100+j")
    b.add_argument("--steps", type=int, default=None, help="ODE steps (default: the run's or recipe's eval.num_steps)")
    b.add_argument("--images-per-prompt", type=int, default=None, help="default: the benchmark's protocol (GenEval 4)")
    b.add_argument("--max-prompts", type=int, default=None, help="the first N prompts only (a quick look)")
    b.add_argument("--batch-size", type=int, default=4, help="images drawn and scored per call")
    # each benchmark flag's unset value, read back from the parser: the held-out evaluation refuses a set one
    e.set_defaults(fn=cmd_eval, bench_flag_defaults={a.dest: a.default for a in b._group_actions if a.dest != "bench"})
