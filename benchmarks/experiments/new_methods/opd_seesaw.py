"""Flow-OPD against multi-task GRPO on the shapes world (issue 47, item 7): the "seesaw".

Per training seed S (resumable: finished runs are reused, interrupted ones resumed):

1. one teacher per tag (default position, counting, colors): ``--preset shapes-nft`` on a prompt file
   holding that tag's training prompts only, ``--teacher-minutes`` CPU-minutes;
2. the student: ``--preset flow-opd`` on the three tags' prompts together, each prompt routed to its
   tag's teacher, cold-started from the teachers' merge, ``--student-minutes``;
3. the baseline, multi-task GRPO on the same prompts and reward: ``--preset flow-grpo``, one run for the
   student's minutes and one for the whole pipeline's (teachers + student), so it is compared at the
   student's own CPU time and at the CPU time the whole distillation cost.

Every run uses ``train.clock=cpu``, so runs sharing the machine are timed as a quiet machine would.
The table is each model's final held-out accuracy on each of the tags (the recipe's evaluation:
16 prompt slots a tag x 12 seeds), their mean, the all-tag accuracy and fidelity. Writes
``seesaw.csv``, ``seesaw.json`` and ``seesaw.png`` into ``--out``.

    python benchmarks/experiments/new_methods/opd_seesaw.py --seeds 0 --teacher-minutes 5 \\
        --student-minutes 5 --runs-dir RUNS --out OUT
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

from flowgrpo.benchmarks import print_table, write_csv, write_json
from flowgrpo.benchmarks.bench_e2e import RunSpec, add_runner_arguments, run_specs
from flowgrpo.shapes.prompts import split_specs

TAGS = ("position", "counting", "colors")


def write_prompt_files(folder: Path, tags: tuple[str, ...]) -> dict[str, Path]:
    """One ``.jsonl`` of training prompts per tag and ``mixed.jsonl`` with all of them (held-out prompts
    never appear: :func:`split_specs`' training pools)."""
    folder.mkdir(parents=True, exist_ok=True)
    files, mixed = {}, []
    for tag in tags:
        rows = [{"prompt": s.prompt, "tag": tag} for s in split_specs(tag)[0]]
        files[tag] = folder / f"{tag}.jsonl"
        files[tag].write_text("".join(json.dumps(r) + "\n" for r in rows))
        mixed += rows
    files["mixed"] = folder / "mixed.jsonl"
    files["mixed"].write_text("".join(json.dumps(r) + "\n" for r in mixed))
    return files


def baseline_name(seed: int, minutes: float) -> str:
    return f"grpo-{minutes:g}min-s{seed}"


def seed_specs(seed: int, tags, files, runs_dir: Path, teacher_min: float, student_min: float,
               student_overrides: list[str], overrides: list[str]) -> list[RunSpec]:
    """One training seed's runs, the longest first so that two jobs finish together: the baseline at the
    whole pipeline's minutes, the teachers, the student (it waits for its teachers), the short baseline."""
    common = [f"train.seed={seed}", "train.clock=cpu", *overrides]
    total = student_min + len(tags) * teacher_min

    def grpo(minutes: float) -> RunSpec:
        return RunSpec(baseline_name(seed, minutes), ("--preset", "flow-grpo", f"data.prompts={files['mixed']}",
                                                      f"train.max_minutes={minutes}", f"eval.every_minutes={minutes}",
                                                      *common))

    specs = [grpo(total)]
    specs += [RunSpec(f"teacher-{t}-s{seed}", ("--preset", "shapes-nft", f"data.prompts={files[t]}",
                                               f"train.max_minutes={teacher_min}",
                                               f"eval.every_minutes={teacher_min}", *common)) for t in tags]
    routes = ", ".join(f"{t}: {runs_dir / f'teacher-{t}-s{seed}'}" for t in tags)
    specs.append(RunSpec(f"opd-s{seed}", ("--preset", "flow-opd", f"data.prompts={files['mixed']}",
                                          f"loss.flow_opd.teachers={{{routes}}}", f"train.max_minutes={student_min}",
                                          f"eval.every_minutes={student_min}", *common, *student_overrides)))
    return specs + [grpo(student_min)]


def model_row(label: str, seed: int, summary: dict, tags, before: bool = False) -> dict:
    """One table row from a run summary (``before``: its evaluation of the starting model)."""
    ev = summary["eval_before" if before else "eval_after"]
    per_tag = ev["per_tag"]
    return {"model": label, "seed": seed, "cpu_minutes": 0.0 if before else summary["train_seconds"] / 60,
            **{t: per_tag[t] for t in tags}, "mean_of_tags": sum(per_tag[t] for t in tags) / len(tags),
            "accuracy_all_tags": ev["accuracy"], "fidelity": ev.get("fidelity")}


def collect(runs_dir: Path, seeds, tags, teacher_min: float, student_min: float) -> list[dict]:
    """The table's rows of every finished run under ``runs_dir``."""
    rows = []
    total = student_min + len(tags) * teacher_min
    for s in seeds:
        names = [(f"teacher-{t}-s{s}", f"teacher {t}") for t in tags] + [
            (f"opd-s{s}", "flow-opd student"), (baseline_name(s, student_min), "flow-grpo, the student's minutes"),
            (baseline_name(s, total), "flow-grpo, the whole pipeline's minutes")]
        found = [(label, json.loads((runs_dir / n / "summary.json").read_text()))
                 for n, label in names if (runs_dir / n / "summary.json").is_file()]
        # every run starts from the base except the student, whose evaluation before is its cold start
        base = next((summ for label, summ in found if label != "flow-opd student"), None)
        if base is not None:
            rows.append(model_row("base", s, base, tags, before=True))
        for label, summ in found:
            if label == "flow-opd student":
                rows.append(model_row("student's cold start (before OPD)", s, summ, tags, before=True))
            rows.append(model_row(label, s, summ, tags))
    return rows


def report(rows: list[dict], tags, out: Path) -> None:
    """Print the table; write seesaw.csv, seesaw.json and seesaw.png (per-tag bars per model)."""
    out.mkdir(parents=True, exist_ok=True)
    keys = ["model", "seed", "cpu_minutes", *tags, "mean_of_tags", "accuracy_all_tags", "fidelity"]
    write_csv(out / "seesaw.csv", rows, keys)
    write_json(out / "seesaw.json", {"rows": rows})
    print_table(keys, [[f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys] for r in rows],
                title="Flow-OPD student, its teachers and multi-task Flow-GRPO: held-out accuracy per tag")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows)), 3.8))
    width = 0.8 / (len(tags) + 1)
    for j, key in enumerate([*tags, "mean_of_tags"]):
        ax.bar([i + j * width for i in range(len(rows))], [r[key] for r in rows], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([textwrap.fill(r["model"], 18) + f"\ns{r['seed']}, {r['cpu_minutes']:.0f} min" for r in rows],
                       fontsize=7)
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, ncol=len(tags) + 1)
    ax.set_title("Flow-OPD student vs its teachers and multi-task Flow-GRPO (shapes world, CPU-minutes)")
    fig.tight_layout()
    fig.savefig(out / "seesaw.png", dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--tags", nargs="+", default=list(TAGS))
    ap.add_argument("--teacher-minutes", type=float, default=5.0, help="CPU-minutes of each teacher")
    ap.add_argument("--student-minutes", type=float, default=5.0, help="CPU-minutes of the student")
    ap.add_argument("--student", nargs="*", default=[], help="key=value overrides of the student only")
    add_runner_arguments(ap)
    a = ap.parse_args(argv)
    runs_dir, tags = Path(a.runs_dir).resolve(), tuple(a.tags)
    if not a.aggregate_only:
        files = write_prompt_files(runs_dir / "prompts", tags)
        specs = [sp for s in a.seeds for sp in seed_specs(s, tags, files, runs_dir, a.teacher_minutes,
                                                           a.student_minutes, a.student, a.overrides)]
        run_specs(specs, runs_dir, a.jobs, tag="seesaw")
    report(collect(runs_dir, a.seeds, tags, a.teacher_minutes, a.student_minutes), tags, Path(a.out))


if __name__ == "__main__":
    main()
