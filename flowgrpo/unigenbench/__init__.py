"""UniGenBench: generate, judge and report the semantic-consistency benchmark in one resumable command.

UniGenBench (Wang et al., *Pref-GRPO*, arXiv:2508.20751, and *UniGenBench++*, arXiv:2510.18701;
prompts CC BY 4.0, see ``data/ATTRIBUTION.md``) has 600 prompts in four sets (en, zh, en_long,
zh_long), each with 1-10 checkpoints from 10 primary and 27 sub-dimensions. One module a stage:

* :mod:`.prompts`: the shipped prompt files (or ``--csv``), malformed rows reported and skipped;
* :mod:`.protocol`: the official judge question (templates as data) and the answer parser;
* :mod:`.generate`: ``{index}_{j}.png`` for any supported model or a trained run, resumable;
* :mod:`.judgements`: the append-only ``judgements.jsonl`` a killed run resumes from;
* :mod:`.score`: the concurrent judging over an OpenAI-compatible endpoint;
* :mod:`.summary`: accuracies per dimension, the leaderboard CSV and ``compare``;
* :mod:`.report`: the bar chart and the self-contained ``report.html``;
* :mod:`.evaluator`: the ``unigenbench`` evaluator for training (``eval.evaluator=unigenbench``);
* :mod:`.fake_judge`: a deterministic OpenAI-compatible judge for tests and benchmarks;
* :mod:`.cli`: ``flowgrpo unigenbench check | generate | score | compare``.
"""
