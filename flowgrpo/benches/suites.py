"""The field's benchmarks as data: what each scores, over which prompts, and its headline number.

A :class:`Bench` names the metric that scores one image (a reward of :data:`flowgrpo.rewards.REWARDS`;
GenEval's is the ``geneval`` reward's official verdict), the protocol (images per prompt, steps where its reference fixes
them) and how the headline is defined, as its paper defines it:

* ``tag_mean_accuracy``: GenEval's overall score, the mean over its six tags of each tag's accuracy
  (Ghosh et al. 2023, djghosh13/geneval ``evaluation/summary_scores.py``);
* ``mean_score``: the mean per-image score (OCR accuracy, PickScore, HPS, ImageReward as Flow-GRPO
  reports them on their test prompts).

The prompt sets are the benchmarks' own. Those of GenEval, OCR and PickScore are shipped, byte for byte,
in ``flowgrpo/benches/data/`` (their sources, commits and MIT licences: ``data/LICENSES.md`` there):
:attr:`Bench.shipped` names the file that ``--prompts`` defaults to (:meth:`Bench.shipped_prompts`,
:func:`bench_prompts`). HPS and ImageReward ship none: ``--prompts`` takes the file.
:attr:`Bench.prompts` says which set each is defined on and where it comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

from ..errors import UserError
from ..registry import Registry

#: the folder of this package that holds the shipped prompt files and their licences
DATA_FOLDER = "data"


@dataclass(frozen=True)
class Bench:
    """One benchmark (see the module docstring)."""

    name: str
    #: the reward that scores one image (``geneval``: with ``score: geneval``, the official verdict, 1 or 0)
    metric: str
    headline: Literal["tag_mean_accuracy", "mean_score"]
    #: the prompt file it is defined on, and where a user gets it
    prompts: str
    #: where its numbers are defined
    source: str
    #: images per prompt in the benchmark's protocol
    images_per_prompt: int = 1
    #: a sample counts as correct when its score reaches this (None: the metric has no verdict)
    threshold: float | None = None
    #: options of the metric that the benchmark fixes (the user's ``--option`` add to them)
    metric_options: dict = field(default_factory=dict)
    #: the prompt file shipped with flowgrpo that ``--prompts`` defaults to, a file name in
    #: ``flowgrpo/benches/data/`` (None: none is shipped, ``--prompts`` is required)
    shipped: str | None = None

    def shipped_prompts(self) -> Path | None:
        """The path of the shipped prompt file (:attr:`shipped`), or None where none is shipped."""
        return None if self.shipped is None else shipped_file(self.shipped)


#: name -> :class:`Bench`
BENCHES: Registry = Registry("benchmark")


def register_bench(bench: Bench) -> Bench:
    """Add ``bench`` to :data:`BENCHES` (a duplicate name is refused)."""
    BENCHES.register(bench.name)(lambda: bench)
    return bench


register_bench(Bench(
    "geneval", "geneval", "tag_mean_accuracy", threshold=1.0, images_per_prompt=4, metric_options={"score": "geneval"},
    prompts="GenEval's prompts/evaluation_metadata.jsonl (553 prompts with their metadata; "
            "github.com/djghosh13/geneval), shipped as flowgrpo/benches/data/geneval_evaluation_metadata.jsonl",
    shipped="geneval_evaluation_metadata.jsonl",
    source="Ghosh et al. 2023, GenEval; overall = mean of the per-tag accuracies (evaluation/summary_scores.py)"))
register_bench(Bench(
    "ocr", "ocr", "mean_score",
    prompts="Flow-GRPO's dataset/ocr/test.txt (1,018 prompts quoting the text to render; "
            "github.com/yifan123/flow_grpo), shipped as flowgrpo/benches/data/flowgrpo_ocr_test.txt",
    shipped="flowgrpo_ocr_test.txt",
    source="Flow-GRPO (Liu et al. 2025): OCR accuracy, 1 - edit distance / length of the quoted text"))
register_bench(Bench(
    "pickscore", "pickscore", "mean_score",
    prompts="Flow-GRPO's dataset/pickscore/test.txt (2,048 Pick-a-Pic prompts; github.com/yifan123/flow_grpo), "
            "shipped as flowgrpo/benches/data/flowgrpo_pickscore_test.txt",
    shipped="flowgrpo_pickscore_test.txt",
    source="Kirstain et al. 2023, PickScore; as Flow-GRPO reports it on its PickScore test prompts"))
register_bench(Bench(
    "hps", "hpsv2", "mean_score",
    prompts="a held-out prompt file, given with --prompts (HPDv2's test prompts, or Flow-GRPO's "
            "dataset/pickscore/test.txt, shipped as flowgrpo/benches/data/flowgrpo_pickscore_test.txt)",
    source="Wu et al. 2023, HPSv2.1"))
register_bench(Bench(
    "imagereward", "imagereward", "mean_score",
    prompts="a held-out prompt file, given with --prompts (ImageReward's benchmark prompts, or Flow-GRPO's "
            "dataset/pickscore/test.txt, shipped as flowgrpo/benches/data/flowgrpo_pickscore_test.txt)",
    source="Xu et al. 2023, ImageReward"))


def bench_names() -> list[str]:
    """The registered benchmarks' names."""
    return BENCHES.names()


def get_bench(name: str) -> Bench:
    """The :class:`Bench` called ``name``; a UserError lists the valid names."""
    return BENCHES.build(name)


def shipped_file(name: str) -> Path | None:
    """The path of ``name`` when it is the name of a file shipped in ``flowgrpo/benches/data/`` (e.g.
    ``flowgrpo_geneval_test_metadata.jsonl``), else None."""
    if not name or "/" in name or "\\" in name:
        return None
    path = Path(str(resources.files(__package__).joinpath(DATA_FOLDER, name)))
    return path if path.is_file() else None


def bench_prompts(bench: Bench, given: str | None) -> str:
    """The prompt file of a benchmark run: ``given`` (``--prompts``) where given (a path, or the name of
    a shipped file: :func:`shipped_file`, which a recipe can name wherever flowgrpo is installed), else
    the shipped one (:meth:`Bench.shipped_prompts`); a one-line UserError where neither exists."""
    if given:
        shipped = None if Path(str(given)).exists() else shipped_file(str(given))
        return str(shipped or given)
    shipped = bench.shipped_prompts()
    if shipped is None:
        raise UserError(f"--bench {bench.name} needs --prompts FILE (the benchmark's prompt set; none is shipped "
                        "for it)")
    return str(shipped)
