"""What the ``flowgrpo`` subcommands do, one module per command; :mod:`flowgrpo.cli` parses and calls them.

* :mod:`.train`: ``flowgrpo train`` (a fresh run, a resumed one, one rank of a launched run);
* :mod:`.sample`: ``flowgrpo sample`` (images or videos from a trained run);
* :mod:`.export`: ``flowgrpo export`` (a run's LoRA in diffusers' format, or the fused pipeline);
* :mod:`.bench`: ``flowgrpo bench`` (which benchmark of ``flowgrpo.benchmarks`` runs);
* :mod:`.probe`: ``flowgrpo shapes probe`` (what a shapes model's conditioning distinguishes).

The outermost layer: these modules import the trainer, the policies and the output writers; nothing
in the engine imports them.
"""
