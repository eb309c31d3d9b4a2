"""The ``flowgrpo`` command line.

    flowgrpo train [--preset NAME] [--recipe NAME] [--config FILE] [key.sub=value ...] [--resume RUN_DIR]
    flowgrpo eval RUN_DIR_OR_CHECKPOINT [--json PATH]
    flowgrpo compare RUN_DIR [RUN_DIR ...] [--within D] [--out DIR] [--json PATH]
    flowgrpo export RUN_DIR --to DIR [--fuse] [--checkpoint N] [--raw]
    flowgrpo sample RUN_DIR --prompts FILE --out DIR [--weights ema|raw] [--seed N] [--steps N] [--guidance G]
    flowgrpo presets | recipes
    flowgrpo config explain [SECTION | SECTION.KEY]      (also: flowgrpo train --help-config [SECTION])
    flowgrpo config show [--preset NAME] [--recipe NAME] [--config FILE] [key.sub=value ...]
    flowgrpo bench ops|samplers|e2e|profile|reward-server|plugin|scaling|overlap [--out DIR] [--json PATH]
    flowgrpo bench reference --flow-grpo PATH [--out DIR] [--json PATH]
    flowgrpo bench memory [--out DIR] [--json PATH]
    flowgrpo serve-reward --reward NAME [--option k=v ...] [--host H] [--port P] [--token-env VAR]
    flowgrpo unigenbench check|generate|score|compare ...   (flowgrpo.unigenbench.cli)
    flowgrpo build-ext [--cuda] | doctor

Benchmarks write their CSV/PNG into ``--out`` (default: the current directory), never next to the
installed code.

Bad input (config keys, values, presets, prompt files, missing weights) prints one line naming the
problem and exits with code 2.

This module parses and dispatches; the commands with code of their own live in
:mod:`flowgrpo.commands` (train, sample, export, bench, shapes probe).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
import threading
from pathlib import Path

from .commands.bench import add_bench_parser
from .errors import UserError
from .commands.train import check_text_file, cmd_train


def _cmd_export(args) -> int:
    from .commands.export import export_run

    export_run(args.run_dir, args.to, fuse=args.fuse, checkpoint=args.checkpoint, raw=args.raw)
    return 0


def _cmd_presets(args) -> int:
    """The papers' methods, then each world's presets under a line naming the world they were tuned on."""
    from .config import preset_names
    from .config.show import preset_description
    from .presets import WORLDS, preset_world

    groups: dict[str | None, list[str]] = {}
    for name in preset_names():
        groups.setdefault(preset_world(name), []).append(name)
    for i, (world, names) in enumerate(groups.items()):
        print(("\n" if i else "") + ("the papers' methods (flowgrpo/presets):" if world is None else
                                     f"tuned for the {world} world (flowgrpo/presets/{WORLDS}/{world}; "
                                     f"settings measured with --recipe {world}):"))
        for name in names:
            print(f"  {name:24s} {preset_description(name, world)}")
    return 0


def _cmd_recipes(args) -> int:
    from .config.show import recipe_description
    from .recipes import recipe_names

    for name in recipe_names():
        print(f"{name:20s} {recipe_description(name)}")
    return 0


def _cmd_config(args) -> int:
    from .config.help import explain_config

    return explain_config(args.section)


def _cmd_config_show(args) -> int:
    from .config.layers import RECIPE_METHOD
    from .config.show import show_config

    if args.config:
        check_text_file(Path(args.config), "config file")
    return show_config(args.preset or RECIPE_METHOD, args.recipe, args.config, args.overrides)


def _cmd_serve_reward(args) -> int:
    from .serve import serve_reward

    return serve_reward(args.reward, args.option, host=args.host, port=args.port, token_env=args.token_env,
                        max_batch=args.max_batch, window_ms=args.window_ms, max_body_mb=args.max_body_mb,
                        max_image_pixels=args.max_image_pixels, max_decoded_mb=args.max_decoded_mb,
                        max_images=args.max_images, body_timeout_s=args.body_timeout_s,
                        max_inflight_mb=args.max_inflight_mb, max_bodies_mb=args.max_bodies_mb,
                        queue_timeout_s=args.queue_timeout_s, header_timeout_s=args.header_timeout_s,
                        max_connections=args.max_connections, log_level=args.log_level)


def _cmd_build_ext(args) -> int:
    from .ops.build import build_extension

    try:
        path = build_extension(cuda=args.cuda, verbose=not args.quiet)
    except RuntimeError as exc:
        print(f"flowgrpo: build failed: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _cmd_doctor(args) -> int:
    from .ops.doctor import doctor_report

    print("\n".join(doctor_report()))
    return 0


def _add_layer_options(parser) -> None:
    """``--preset``, ``--recipe``, ``--config`` and the overrides of ``train`` and ``config show``."""
    parser.add_argument("--preset", default=None,
                        help="method preset (see `flowgrpo presets`; default: the recipe's method, shapes-nft on shapes)")
    parser.add_argument("--recipe", default=None,
                        help="recipe: the world or model family (see `flowgrpo recipes`; default: shapes, or "
                             "diffusers when model.name names another model)")
    parser.add_argument("--config", default=None, help="YAML config file applied on top of the recipe and preset")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flowgrpo", description="GRPO for flow-matching generators")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy (default: the embedded shapes world)")
    _add_layer_options(t)
    t.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue an interrupted run")
    t.add_argument("--help-config", nargs="?", const="", default=None, metavar="SECTION",
                   help="explain the config keys (of one section) and exit; same as `flowgrpo config explain`")
    t.add_argument("--num-processes", type=int, default=1, metavar="N",
                   help="run on N processes (one per GPU; gloo processes on a CPU-only machine) through accelerate launch")
    t.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="accelerate config for --num-processes (e.g. configs/accelerate/fsdp.yaml)")
    t.set_defaults(fn=cmd_train)
    __import__("flowgrpo.commands.evaluate", fromlist=["register"]).register(sub)  # flowgrpo eval
    ex = sub.add_parser("export", help="write a run's trained weights: a LoRA in diffusers' format (or the fused "
                                       "pipeline); a full fine-tune as a pipeline folder (the shapes world: its "
                                       "weights folder)")
    ex.add_argument("run_dir", metavar="RUN_DIR")
    ex.add_argument("--to", required=True, metavar="DIR", help="output folder")
    ex.add_argument("--fuse", action="store_true", help="write the base pipeline with the LoRA fused into it")
    ex.add_argument("--checkpoint", type=int, default=None, metavar="N", help="checkpoint iteration (default: latest)")
    ex.add_argument("--raw", action="store_true", help="the raw trained weights instead of their EMA")
    ex.set_defaults(fn=_cmd_export)
    p = sub.add_parser("presets", help="list the shipped method presets")
    p.set_defaults(fn=_cmd_presets)
    r = sub.add_parser("recipes", help="list the shipped recipes (the world and each model family)")
    r.set_defaults(fn=_cmd_recipes)
    c = sub.add_parser("config", help="explain the run configuration")
    csub = c.add_subparsers(dest="config_command", required=True)
    ce = csub.add_parser("explain", help="every config key: type, default, choices and help")
    ce.add_argument("section", nargs="?", default=None, metavar="SECTION",
                    help="a section (model, sampler, loss, ...) or one key (loss.grpo.kl_beta); default: all")
    ce.set_defaults(fn=_cmd_config)
    cs = csub.add_parser("show", help="the resolved configuration as YAML, each key annotated with the layer that set it")
    _add_layer_options(cs)
    cs.set_defaults(fn=_cmd_config_show)
    add_bench_parser(sub)
    s = sub.add_parser("serve-reward", help="serve a reward over HTTP (JSON; for the `remote` reward)")
    s.add_argument("--reward", required=True, help="reward name (as in reward.weights)")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="an option of the reward (value parsed as YAML); repeatable")
    s.add_argument("--host", default="127.0.0.1", help="bind address (non-loopback needs --token-env)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--token-env", default=None, metavar="VAR",
                   help="environment variable holding the bearer token clients must send")
    s.add_argument("--max-batch", type=int, default=32, help="images per reward call")
    s.add_argument("--window-ms", type=float, default=5.0, help="how long a batch waits for more requests")
    s.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body in MiB")
    s.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="largest image (width x height)")
    from .serve.codec import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_DECODED_MB, DEFAULT_MAX_IMAGES

    s.add_argument("--max-decoded-mb", type=float, default=DEFAULT_MAX_DECODED_MB,
                   help="decoded images per request and per reward call (float32 RGB), MiB; larger requests get 413")
    s.add_argument("--max-images", type=int, default=DEFAULT_MAX_IMAGES,
                   help="images per request (also bounds a pairwise reward's pairs); more get 413")
    s.add_argument("--body-timeout-s", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds for a request body to arrive (408 after)")
    from .serve import codec

    s.add_argument("--max-inflight-mb", type=float, default=codec.DEFAULT_MAX_INFLIGHT_MB,
                   help="decoded images of all requests in flight (float32 RGB), MiB; more wait, then 503")
    s.add_argument("--max-bodies-mb", type=float, default=codec.DEFAULT_MAX_BODIES_MB,
                   help="request bodies of all requests in flight, MiB; more wait, then 503")
    s.add_argument("--queue-timeout-s", type=float, default=codec.DEFAULT_QUEUE_TIMEOUT_S,
                   help="seconds a request waits for room in those budgets (503 with Retry-After after)")
    s.add_argument("--header-timeout-s", type=float, default=codec.DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection gets to send its request headers (closed after)")
    s.add_argument("--max-connections", type=int, default=codec.DEFAULT_MAX_CONNECTIONS,
                   help="open connections at most; beyond, the longest idle one is closed")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=_cmd_serve_reward)
    x = sub.add_parser("build-ext", help="build the fused loss extension ahead of time")
    x.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=None,
                   help="build the CUDA kernels too (default: when a GPU is visible)")
    x.add_argument("--quiet", action="store_true", help="hide compiler output")
    x.set_defaults(fn=_cmd_build_ext)
    d = sub.add_parser("doctor", help="report the environment and which loss backend runs")
    d.set_defaults(fn=_cmd_doctor)
    from .unigenbench.cli import register as register_unigenbench

    register_unigenbench(sub)
    __import__("flowgrpo.realsize.cli", fromlist=["register"]).register(sub)  # flowgrpo realsize ...
    __import__("flowgrpo.commands.probe", fromlist=["register"]).register(sub)  # flowgrpo shapes probe
    __import__("flowgrpo.commands.sample", fromlist=["register"]).register(sub)  # flowgrpo sample
    __import__("flowgrpo.commands.compare", fromlist=["register"]).register(sub)  # flowgrpo compare
    return ap


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, except that ``key=value`` overrides may stand on either side of the options
    (``flowgrpo train a=1 --preset shapes b=2``): argparse stops filling a positional list at the first
    option, so the words after it come back unrecognized; they join the overrides in command-line order
    (argparse's ``parse_intermixed_args`` does not take subcommands)."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list):
        words = [a for a in extra if not a.startswith("-")]
        args.overrides += words
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


#: errors of the disk rather than of the code (full, over quota, read-only, not ours): one line, exit 2
_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)


def _disk_error_line(exc: OSError) -> str:
    return exc.strerror + (f": {exc.filename}" if exc.filename else "")


def _quiet_disk_errors_in_threads() -> None:
    """A background writer (TensorBoard's event thread) that meets a full or read-only disk prints one
    warning line instead of its traceback; the main thread reports its own error, or finishes."""
    default = threading.excepthook
    if getattr(default, "flowgrpo", False):
        return

    def hook(args) -> None:
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in _DISK_ERRNOS:
            name = args.thread.name if args.thread is not None else "a thread"
            print(f"flowgrpo: warning: background writer {name} stopped: {_disk_error_line(args.exc_value)}",
                  file=sys.stderr)
        else:
            default(args)

    hook.flowgrpo = True
    threading.excepthook = hook


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    _quiet_disk_errors_in_threads()
    args = parse_args(build_parser(), argv)
    args.raw_argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.fn(args)
    except UserError as exc:
        print(f"flowgrpo: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # output piped into `head` and the like: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # the disk, not the code: full, read-only, not ours (one line, as bad input)
        if exc.errno not in _DISK_ERRNOS:
            raise
        print(f"flowgrpo: error: {_disk_error_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flowgrpo: interrupted (checkpoints written so far are kept; resume with --resume RUN_DIR)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
