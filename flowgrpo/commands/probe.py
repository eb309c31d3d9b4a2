"""``flowgrpo shapes probe`` (registered by :func:`register`): what a shapes model's conditioning
can distinguish (:mod:`flowgrpo.shapes.probe`).

    flowgrpo shapes probe [--weights PATH] [--out DIR] [--json PATH] [--prompts N] [--seeds N]
                          [--passk-prompts N] [--n N] [--threads N]

``--weights``: a weights folder (``model.safetensors`` + ``config.json``, default the shipped
weights), a training run folder (its newest intact checkpoint, EMA weights when kept) or one
checkpoint folder (``RUN/checkpoints/ckpt_N``). Writes ``probe.json`` and ``probe.csv`` into ``--out``.

A command module in :mod:`flowgrpo.commands` (as ``flowgrpo bench``), not inside ``flowgrpo.shapes``: it
reads training runs through ``flowgrpo.trainer`` (:func:`load_shapes_policy`, also what the world's
experiment scripts read), and the world sits below the trainer's layers (the shapes reward is one of
the rewards), so living in the world's folder would make a folder-level import cycle.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time
from pathlib import Path

from ..errors import UserError


def flat_rows(res: dict) -> list[tuple[str, str, str, float | int | None]]:
    """(section, key, stat, value) rows of a probe result, for the CSV."""
    rows = []
    for kind, ms in res["sensitivity"].items():
        for m, st in ms.items():
            rows += [("sensitivity", f"{kind}.{m}", k, v) for k, v in st.items()]
    for kind, st in res["same_seed_identity"].items():
        rows += [("same_seed_identity", kind, k, v) for k, v in st.items()]
    for tag, st in res["pass_at_k"].items():
        rows += [("pass_at_k", tag, k, v) for k, v in st.items()]
    c = res["ceiling"]
    for which in ("conditioning", "swap_blind", "behavioural"):
        rows += [("ceiling", f"{which}.{t}", "accuracy", v) for t, v in (c[which] or {}).items()]
    for k, v in res["relation_holds"].items():  # the colour split is one nested level: position.same_colour, ...
        rows += ([("relation_holds", f"position.{k}", kk, vv) for kk, vv in v.items()] if isinstance(v, dict)
                 else [("relation_holds", "position", k, v)])
    rows += [("relation_prior", "position", k, v) for k, v in (res.get("relation_prior") or {}).items()]
    rows += [("placement_given_first", "position", k, v) for k, v in (res.get("placement_given_first") or {}).items()]
    return rows


def print_tables(res: dict, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    def f(v):
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    con = Console(width=None if sys.stdout.isatty() else 120)
    t = Table(title=f"conditioning sensitivity to swaps ({title})")
    for col in ("swap", "pooled cos mean [min, max]", "matched-token cos min: mean [min]", "token change mean", "pairs"):
        t.add_column(col)
    for kind, ms in res["sensitivity"].items():
        p, tk, ch = ms["pooled_cos"], ms["token_cos_min"], ms["token_change"]
        t.add_row(kind, f"{f(p['mean'])} [{f(p['min'])}, {f(p['max'])}]", f"{f(tk['mean'])} [{f(tk['min'])}]",
                  f(ch["mean"]), str(p["n"]))
    con.print(t)
    t = Table(title="pass@k per tag (held-out prompts), ceiling given the conditioning")
    ks = [k for k in res["pass_at_k"]["overall"]]
    for col in ["tag", *ks, "ceiling (cond.)", "ceiling (behav.)", "ceiling (swap-blind)"]:
        t.add_column(col, justify="right")
    c = res["ceiling"]
    for tag, st in res["pass_at_k"].items():
        t.add_row(tag, *[f(st[k]) for k in ks], f(c["conditioning"].get(tag)),
                  f((c["behavioural"] or {}).get(tag)), f(c["swap_blind"].get(tag)))
    con.print(t)
    ids, rel = res["same_seed_identity"], res["relation_holds"]
    con.print(f"same-seed identical scene: order swap of position prompts {f(ids['order_position']['identical'])} "
              f"(n={ids['order_position']['n']}), colour swap {f(ids['colour']['identical'])} (n={ids['colour']['n']})")
    con.print(f"relation holds given one A and one B: {f(rel['rate'])} ({rel['eligible']} of "
              f"{rel['position_samples']} position samples eligible); misses: same line {f(rel['same_line'])}, "
              f"reversed {f(rel['reversed'])}")
    con.print(f"  averaged over prompts, each once: {f(rel['prompt_mean'])} ({rel['prompts']} position prompts; "
              f"the pooled rate above weighs the pass@k prompts' many draws more)")
    null = rel["if_independent"]
    if null["holds"] is not None:
        con.print(f"  if each object were placed on its own (the same samples' cell marginals): holds {f(null['holds'])}, "
                  f"same line {f(null['same_line'])}, reversed {f(null['reversed'])}; coupling "
                  f"{rel['rate'] - null['holds']:+.3f} (0: none; the training data's marginals alone give 0.886)")
    con.print("  " + "; ".join(f"{name}: holds {f(r['rate'])}, same line {f(r['same_line'])}, reversed "
                                f"{f(r['reversed'])} (n={r['eligible']})"
                                for name, r in (("A and B of one colour", rel["same_colour"]),
                                                ("of two colours", rel["other_colours"]))))
    prior = res.get("relation_prior")
    if prior:
        con.print(f"relation prior at sigma 0.98: leans the relation's way for {f(prior['leans_right_way'])} of "
                  f"{prior['n']} position prompts (0.5: blind), mean lean {f(prior['strength'])} (the mean scene: about 0.4)")
    placed = res.get("placement_given_first")
    if placed and placed["eligible"]:
        con.print(f"with A drawn first (sigma {placed['sigma']:g}, A's cell at {placed['lead_sigma']:g}), B lands on A's line "
                  f"{f(placed['same_line'])} of the time (0.2: placed without looking at A; 0: coordinated), on the "
                  f"relation's side {f(placed['holds'])}, reversed {f(placed['reversed'])} ({placed['eligible']} of "
                  f"{placed['n']} samples; A kept {f(placed['kept_first'])})")
    con.print(f"held-out prompts with an indistinguishable swap twin (cos > {c['threshold']}): "
              f"{c['prompts_with_indistinguishable_twin']} of {c['num_prompts']}")


def load_shapes_policy(weights: str | Path | None):
    """(frozen shapes policy in eval mode, evaluation shift, description) for ``weights``: None (the shipped
    weights), a weights folder (``model.safetensors`` + ``config.json``), a shapes run folder (its newest
    intact checkpoint, EMA weights when kept) or one checkpoint folder. What ``flowgrpo shapes probe
    --weights`` and the shapes experiment scripts read; anything else is one UserError."""
    from ..shapes.model import ShapesFlowModel
    from ..shapes.policy import ShapesPolicy
    from ..trainer.checkpoint import CONFIG_FILE, STATE_FILE, load_trained_policy

    if weights is None:
        return ShapesPolicy(train_mode="frozen").eval(), 1.0, "shipped base weights"
    path = Path(weights)
    if (path / "model.safetensors").is_file():
        return ShapesPolicy(ShapesFlowModel.load(path), train_mode="frozen").eval(), 1.0, f"weights {path}"
    if not ((path / CONFIG_FILE).exists() or (path / STATE_FILE).exists()):
        raise UserError(f"{path} is neither a shapes weights folder (model.safetensors), a run directory "
                        "nor a checkpoint folder")
    run = load_trained_policy(path, only_model="shapes")
    run.policy.eval()
    return run.policy, run.cfg.sampler.shift, f"{run.weights.kind} weights of {run.weights.path}"


#: the largest sizes of a probe; the defaults (64, 2, 3, 64) take half a minute on two CPU cores and the
#: time grows with each, so these bound a typo (``--n 100000000`` ran on for hours), not a real use
PROBE_LIMITS = {"prompts": 4096, "seeds": 100, "passk_prompts": 100, "n": 1024}


def _check_probe_flags(args) -> None:
    """A UserError naming the first bad flag of ``flowgrpo shapes probe``, before the model loads."""
    from ..disk import check_output_file, check_output_folder
    from ..samplers.plan import MAX_STEPS

    for name, high in PROBE_LIMITS.items():
        if not 1 <= getattr(args, name) <= high:
            raise UserError(f"--{name.replace('_', '-')} must be in 1..{high}, got {getattr(args, name)}")
    if not 1 <= args.steps <= MAX_STEPS:
        raise UserError(f"--steps must be in 1..{MAX_STEPS}, got {args.steps}")
    if args.threshold is not None and not -1 <= args.threshold <= 1:  # a cosine; NaN fails both comparisons
        raise UserError(f"--threshold is a cosine similarity: it must be in -1..1, got {args.threshold:g}")
    cpus = os.cpu_count() or 1
    if not 0 <= args.threads <= cpus:  # torch crashed creating 100,000 threads
        raise UserError(f"--threads must be in 0..{cpus} (this machine's CPUs; 0: torch's default), got {args.threads}")
    check_output_folder(args.out, "--out")
    if args.json:
        check_output_file(args.json, "--json")


def _cmd_probe(args) -> int:
    import torch

    from ..images import to_uint8
    from ..shapes.evaluate import finish_ode, generate_ode
    from ..shapes.probe import THRESHOLD, run_probe

    _check_probe_flags(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    policy, shift, desc = load_shapes_policy(args.weights)

    def sample(prompts, seeds):
        return to_uint8(generate_ode(policy, prompts, seeds, num_steps=args.steps, shift=shift))

    def predict_x0(prompts, sigma, x):
        hidden, pooled = policy.model.encode(prompts)
        return x - sigma.view(-1, 1, 1, 1) * policy.model(x, sigma, hidden, pooled)  # x0 = x - sigma v

    def finish(prompts, x, sigma):
        return to_uint8(finish_ode(policy, prompts, x, sigma, num_steps=args.steps))

    start = time.time()
    res = run_probe(policy.model.encode, sample, num_prompts=args.prompts, seeds=args.seeds,
                    passk_per_tag=args.passk_prompts, n=args.n, threshold=THRESHOLD if args.threshold is None else args.threshold,
                    labels=lambda prompt, _length: policy.model.token_labels(prompt), predict_x0=predict_x0,
                    finish=finish)
    res["model"], res["seconds"] = desc, round(time.time() - start, 1)
    res["text_encoder"] = policy.model.cfg.text_encoder
    res["settings"].update({"num_steps": args.steps, "shift": shift})
    print_tables(res, desc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps(res, indent=2))
    with open(out / "probe.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["section", "key", "stat", "value"])
        w.writerows(flat_rows(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    print(f"wrote {out / 'probe.json'} and {out / 'probe.csv'} ({res['seconds']} s)")
    return 0


def register(subparsers) -> None:
    """Add ``shapes`` and its subcommands to the ``flowgrpo`` parser's ``subparsers``."""
    s = subparsers.add_parser("shapes", help="shapes-world diagnostics (probe: what the conditioning distinguishes)")
    ssub = s.add_subparsers(dest="shapes_command", required=True)
    p = ssub.add_parser("probe", help="order/binding sensitivity of the conditioning, same-seed identity of swapped "
                                      "prompts, pass@k per tag, the ceiling, the relation-holds rate")
    p.add_argument("--weights", default=None, metavar="PATH",
                   help="weights folder, run directory or checkpoint folder (default: the shipped weights)")
    p.add_argument("--out", default=".", metavar="DIR", help="folder for probe.json and probe.csv")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the JSON here")
    p.add_argument("--prompts", type=int, default=64, help="held-out evaluation prompts (and swap pairs per kind)")
    p.add_argument("--seeds", type=int, default=2, help="same-seed draws per swap pair")
    p.add_argument("--passk-prompts", type=int, default=3, help="held-out prompts per tag for pass@k")
    p.add_argument("--n", type=int, default=64, help="samples per prompt for pass@k (k = 1, 4, 16, 64 up to n)")
    p.add_argument("--steps", type=int, default=20, help="Euler ODE steps (the evaluator's default)")
    p.add_argument("--threshold", type=float, default=None,
                   help="(default 0.99, see flowgrpo.shapes.probe.THRESHOLD) cosine (pooled and every matched token) above which two prompts count as indistinguishable")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    p.set_defaults(fn=_cmd_probe)
