"""``flowgrpo realsize write-pipeline | lora-layers`` (registered by :func:`register`).

    flowgrpo realsize write-pipeline --recipe sd35-medium --out DIR [--seed N]
    flowgrpo realsize lora-layers --recipe sd35-medium [--preset flow-grpo] [--json PATH]

The memory table itself is ``flowgrpo bench memory --recipe NAME --gpus N`` (``flowgrpo bench``).
"""

from __future__ import annotations

import json


def _cmd_write_pipeline(args) -> int:
    from ..errors import UserError
    from ..policies.diffusers.common import show_library_progress
    from .pipeline_folder import write_pipeline

    from .configs import transformer_config

    config = transformer_config(args.recipe).config
    key = "num_layers" if "num_layers" in config else "n_layers"  # Z-Image names its depth n_layers
    depth = config[key]
    if args.num_layers and not 1 <= args.num_layers <= depth:  # 100000 ran on for hours
        raise UserError(f"--num-layers must be in 1..{depth} (the real depth of {args.recipe}; 0: all of them), "
                        f"got {args.num_layers}")
    if not 0 <= args.seed < 2**63:
        raise UserError(f"--seed must be in 0..2^63-1, got {args.seed}")
    show_library_progress(False)  # transformers' "Writing model shards" bar per text encoder: noise here
    overrides = {key: args.num_layers} if args.num_layers else {}
    try:
        out = write_pipeline(args.recipe, args.out, seed=args.seed, **overrides)
    except (KeyError, ValueError) as exc:
        raise UserError(str(exc).strip("'\"")) from None
    print(f"{out}: {args.recipe} pipeline, real transformer configuration with random weights (bf16); "
          f"train it with model.name={out}")
    return 0


def _cmd_lora_layers(args) -> int:
    from ..disk import check_output_file, write_text_atomically
    from ..errors import UserError
    from .memory import lora_layer_counts

    if args.rank < 0:
        raise UserError(f"--rank must be >= 0 (0: the recipe's), got {args.rank}")
    out = check_output_file(args.json, "--json") if args.json else None
    counts = lora_layer_counts(args.recipe, rank=args.rank, preset=args.preset)
    for block, n in counts["wrapped_by_block"].items():
        print(f"{block:40s} {n:6d}")
        for layer, m in counts["wrapped_by_layer"].items():
            if layer.startswith(block + "."):
                print(f"  {layer[len(block) + 1:]:38s} {m:6d}")
    print(f"{'total wrapped linear layers':40s} {counts['wrapped']:6d}   LoRA parameters {counts['lora_params']:,} "
          f"(rank {counts['rank']})")
    if out is not None:
        write_text_atomically(out, json.dumps(counts, indent=2))
    return 0


def register(subparsers) -> None:
    """Add ``realsize`` and its subcommands to the ``flowgrpo`` parser's ``subparsers``."""
    from .configs import recipe_names

    r = subparsers.add_parser("realsize", help="real-size models without weights: random-weight pipeline folders, "
                                               "LoRA layers of a recipe")
    rsub = r.add_subparsers(dest="realsize_command", required=True)
    w = rsub.add_parser("write-pipeline", help="write a pipeline folder with the recipe's real transformer "
                                               "(random weights, shrunk text encoders of real output width)")
    w.add_argument("--recipe", required=True, choices=recipe_names())
    w.add_argument("--out", required=True, metavar="DIR")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--num-layers", type=int, default=0, help="fewer transformer blocks (0: the real depth)")
    w.set_defaults(fn=_cmd_write_pipeline)
    ll = rsub.add_parser("lora-layers", help="the linear layers the recipe's LoRA wraps, per block type (meta device)")
    ll.add_argument("--recipe", required=True, choices=recipe_names())
    ll.add_argument("--rank", type=int, default=0, help="LoRA rank (0: the recipe's)")
    ll.add_argument("--preset", default=None, help="the method whose LoRA settings count (default: the recipe's own)")
    ll.add_argument("--json", default=None, metavar="PATH")
    ll.set_defaults(fn=_cmd_lora_layers)
