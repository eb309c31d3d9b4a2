"""Tiny random pipelines built offline, for the tests, the benchmarks and examples; no adapter code.

Each has the real classes and wiring of its stock pipeline with a few thousand random weights, and
tokenizers built without hub access: :mod:`.sd3` (SD3.5-M flavour, also the ``sd3-tiny`` adapter),
:mod:`.flux` (FLUX.1), :mod:`.wan` (Wan 2.1), and the families of the generic adapter in
:mod:`.families` (image, with the :data:`~.families.TINY_PIPELINES` registry), :mod:`.families_video`
and :mod:`.families_edit`.
"""
