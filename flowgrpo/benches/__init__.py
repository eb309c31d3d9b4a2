"""The field's benchmarks (GenEval, OCR, PickScore, HPS, ImageReward) on any run, pipeline or LoRA.

* :mod:`.suites`: each benchmark as data (:class:`~.suites.Bench`: its metric, protocol, headline);
* :mod:`.scoring`: a benchmark's scorer and the summary of one model's scores (per tag, headline);
* :mod:`flowgrpo.commands.bench_eval`: ``flowgrpo eval TARGET --bench NAME`` (drawing, scoring, resuming, the table);
* :mod:`flowgrpo.evaluation.bench`: the ``bench`` held-out evaluator, the same numbers during training.
"""
