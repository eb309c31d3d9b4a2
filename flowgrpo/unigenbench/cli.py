"""``flowgrpo unigenbench check | generate | score | compare`` (registered by :func:`register`).

    flowgrpo unigenbench check [--set SET | --csv FILE]
    flowgrpo unigenbench generate --model MODEL_OR_RUN_DIR --set SET --out DIR [--images-per-prompt 4]
                                  [--seed N] [--limit N] [--steps N] [--guidance G] [key=value ...]
    flowgrpo unigenbench score DIR --set SET --judge-url URL [--judge-model NAME] [--api-key-env VAR]
                               [--workers N] [--limit N] [--out RESULTS_DIR] [--retry-failed]
    flowgrpo unigenbench compare RESULTS_A RESULTS_B [--json PATH]
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import UserError
from .prompts import SETS


def _cmd_check(args) -> int:
    from .prompts import load_prompt_set, read_prompt_file

    if args.csv and not args.set:
        sets = [read_prompt_file(args.csv)]
    else:
        sets = [load_prompt_set(name, args.csv) for name in ([args.set] if args.set else SETS)]
    for ps in sets:
        checkpoints = sum(len(p.testpoints) for p in ps.prompts)
        print(f"{ps.source.name}: set {ps.name} ({ps.language}), {len(ps.prompts)} prompts, {checkpoints} checkpoints, "
              f"{len(ps.problems)} malformed rows")
        for problem in ps.problems:
            print(f"  {problem}")
    return 0


def _cmd_generate(args) -> int:
    from ..disk import check_output_folder
    from .generate import GenerateOptions, generate_folder
    from .prompts import load_prompt_set

    if args.guidance is not None and not (math.isfinite(args.guidance) and args.guidance >= 0):
        raise UserError(f"--guidance must be a finite number >= 0, got {args.guidance}")  # NaN drew NaN images
    check_output_folder(args.out, "--out", "a rerun into it resumes")
    opts = GenerateOptions(images_per_prompt=args.images_per_prompt, seed=args.seed, steps=args.steps,
                           guidance=args.guidance, batch_size=args.batch_size, limit=args.limit,
                           overrides=list(args.overrides))
    try:
        counts = generate_folder(args.model, load_prompt_set(args.set, args.csv), args.out, opts, progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"interrupted: the images made so far are kept in {args.out}; run the same command to go on")
        return 130
    print(f"{args.out}: {counts['images']} images ({counts['generated']} made now, {counts['kept']} kept)")
    return 0


def _print_summary(summary: dict, results_dir: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"UniGenBench {summary['set']}, judge {summary['judge_model']}: {summary['images']} images, "
                        f"{summary['failed']} failed")
    table.add_column("dimension")
    table.add_column("accuracy %", justify="right")
    table.add_column("checkpoints", justify="right")
    for name, acc in summary["primary"].items():
        table.add_row(name, f"{100 * acc:.2f}", str(summary["counts"]["primary"][name][1]))
    overall = summary["overall"]
    table.add_row("[bold]Overall (mean of primary)", f"[bold]{'-' if overall is None else f'{100 * overall:.2f}'}",
                  str(summary["checkpoints"]))
    Console().print(table)
    if summary["failed"]:
        print(f"{summary['failed']} judgements failed and are left out (see {results_dir / 'judgements.jsonl'}); "
              "--retry-failed asks for them again")
    print(f"wrote {results_dir / 'summary.json'}, scores.csv, scores.png and report.html")


#: the most requests in flight and extra attempts per image ``unigenbench score`` makes
MAX_WORKERS = 1024
MAX_RETRIES = 100


def _cmd_score(args) -> int:
    from .prompts import load_prompt_set
    from .score import JudgeOptions, score_folder

    from ..output.drawing import MAX_IMAGES_PER_PROMPT
    from ..rewards.http_client import max_response_bytes

    for flag, value, low in (("--workers", args.workers, 1), ("--retries", args.retries, 0),
                             ("--max-tokens", args.max_tokens, 1), ("--images-per-prompt", args.images_per_prompt, 1)):
        if value < low:
            raise UserError(f"{flag} must be at least {low}, got {value}")
    # upper bounds: a folder holds at most generate's images per prompt (1e8 hung listing them); more
    # workers or retries than these only hammer one judge
    for flag, value, high in (("--images-per-prompt", args.images_per_prompt, MAX_IMAGES_PER_PROMPT),
                              ("--workers", args.workers, MAX_WORKERS), ("--retries", args.retries, MAX_RETRIES)):
        if value > high:
            raise UserError(f"{flag} must be at most {high}, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):  # NaN reached asyncio as a traceback
        raise UserError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")
    max_response_bytes(args.max_response_mb, "--max-response-mb")  # before the folder is read, not after
    results = Path(args.out) if args.out else Path(args.images) / f"results_{args.set}"
    opts = JudgeOptions(url=args.judge_url, model=args.judge_model, api_key_env=args.api_key_env,
                        workers=args.workers, timeout=args.timeout, retries=args.retries, max_tokens=args.max_tokens,
                        max_response_mb=args.max_response_mb)
    try:
        summary = score_folder(args.images, load_prompt_set(args.set, args.csv), results, opts,
                               images_per_prompt=args.images_per_prompt, limit=args.limit,
                               retry_failed=args.retry_failed, progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"interrupted: the judgements so far are kept in {results / 'judgements.jsonl'}; "
              "run the same command to go on")
        return 130
    _print_summary(summary, results)
    return 0


def _cmd_compare(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from .summary import compare_summaries, read_summary

    from ..disk import check_output_file, write_text_atomically

    out = check_output_file(args.json, "--json") if args.json else None
    a, b = read_summary(args.a), read_summary(args.b)
    rows = compare_summaries(a, b)
    if a["judge_model"] != b["judge_model"]:
        print(f"note: different judges ({a['judge_model']} vs {b['judge_model']}): the deltas mix judge and model")

    def fmt(v, sign=False):
        return "-" if v is None else (f"{v:+.2f}" if sign else f"{v:.2f}")

    table = Table(title=f"UniGenBench {a['set']}: B - A in points (A = {args.a}, B = {args.b})")
    for col, just in (("dimension", "left"), ("A %", "right"), ("B %", "right"), ("B - A", "right")):
        table.add_column(col, justify=just)
    for level, name, pa, pb, delta in rows:
        label = {"overall": f"[bold]{name}", "primary": name, "sub": f"  {name}"}[level]
        color = "" if delta is None or abs(delta) < 0.005 else ("[green]" if delta > 0 else "[red]")
        table.add_row(label, fmt(pa), fmt(pb), f"{color}{fmt(delta, sign=True)}")
    Console().print(table)
    if out is not None:
        data = [{"level": lv, "dimension": n, "a": pa, "b": pb, "delta": d} for lv, n, pa, pb, d in rows]
        write_text_atomically(out, json.dumps({"a": str(args.a), "b": str(args.b), "rows": data}, indent=2,
                                              ensure_ascii=False))
    return 0


def register(subparsers) -> None:
    """Add ``unigenbench`` and its subcommands to the ``flowgrpo`` parser's ``subparsers``."""
    from ..rewards.http_client import DEFAULT_MAX_RESPONSE_MB

    u = subparsers.add_parser("unigenbench", help="UniGenBench: generate, judge (resumable), report and compare")
    usub = u.add_subparsers(dest="unigenbench_command", required=True)
    sets = list(SETS)

    c = usub.add_parser("check", help="read the prompt files and report malformed rows")
    c.add_argument("--set", choices=sets, default=None, help="one set (default: all four shipped sets)")
    c.add_argument("--csv", default=None, metavar="FILE", help="a newer prompt file (with --set for its language)")
    c.set_defaults(fn=_cmd_check)

    g = usub.add_parser("generate", help="generate {index}_{j}.png for a set (skips images already made)")
    g.add_argument("--model", required=True, metavar="MODEL_OR_RUN_DIR",
                   help="a model.name (adapter, pipeline folder, cached hub id) or a run directory (its latest weights)")
    g.add_argument("--set", required=True, choices=sets)
    g.add_argument("--out", required=True, metavar="DIR")
    g.add_argument("--csv", default=None, metavar="FILE", help="a newer prompt file of the set's language")
    g.add_argument("--images-per-prompt", type=int, default=4)
    g.add_argument("--seed", type=int, default=0, help="base seed; image (index, j) gets its own noise from it")
    g.add_argument("--limit", type=int, default=None, help="only the first N prompts (N >= 1)")
    g.add_argument("--steps", type=int, default=None, help="ODE steps (default: the config's eval.num_steps)")
    g.add_argument("--guidance", type=float, default=None, help="CFG scale (default: model.guidance_scale)")
    g.add_argument("--batch-size", type=int, default=4, help="images per model call")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument("overrides", nargs="*", help="config overrides such as model.resolution=1024 model.dtype=bfloat16")
    g.set_defaults(fn=_cmd_generate)

    s = usub.add_parser("score", help="judge a folder of images over an OpenAI-compatible API (resumable)")
    s.add_argument("images", metavar="DIR", help="folder of {index}_{j}.png")
    s.add_argument("--set", required=True, choices=sets)
    s.add_argument("--judge-url", required=True, help="API root, e.g. http://127.0.0.1:8080/v1 (vllm serve)")
    s.add_argument("--judge-model", default="QwenVL", help="served model name (default: QwenVL, as in the official vLLM command)")
    s.add_argument("--api-key-env", default=None, metavar="VAR", help="environment variable holding the API key")
    s.add_argument("--workers", type=int, default=16, help="requests in flight")
    s.add_argument("--limit", type=int, default=None, help="only the first N prompts (N >= 1)")
    s.add_argument("--out", default=None, metavar="RESULTS_DIR", help="results folder (default: DIR/results_SET)")
    s.add_argument("--csv", default=None, metavar="FILE", help="a newer prompt file of the set's language")
    s.add_argument("--images-per-prompt", type=int, default=4)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds per attempt, the whole exchange")
    s.add_argument("--retries", type=int, default=3, help="extra attempts per image (errors, unreadable answers)")
    s.add_argument("--max-tokens", type=int, default=2048)
    s.add_argument("--max-response-mb", type=float, default=DEFAULT_MAX_RESPONSE_MB,
                   help="the largest judge answer read, MiB after decompression (a larger one stops the run)")
    s.add_argument("--retry-failed", action="store_true", help="ask again for images whose judgement failed")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(fn=_cmd_score)

    m = usub.add_parser("compare", help="per-dimension deltas between two results folders (B - A)")
    m.add_argument("a", metavar="RESULTS_A")
    m.add_argument("b", metavar="RESULTS_B")
    m.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    m.set_defaults(fn=_cmd_compare)
