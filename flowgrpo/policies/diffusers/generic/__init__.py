"""The generic adapter (``model.name=pipeline`` or a pipeline folder without a dedicated adapter).

* :mod:`.adapter`: :class:`~.adapter.PipelinePolicy`, built from what the stock pipeline does in
  two recorded steps (the recording and replay live in :mod:`flowgrpo.diffusers.replay`);
* :mod:`.families`: the declarative entries of the families it knows (guidance keyword, fixed call
  options, LoRA targets, defaults);
* :mod:`.loading`: what makes a pipeline folder trainable, and the ``model.name=pipeline`` factory;
* :mod:`.experts`: pipelines with more than one denoiser (Wan 2.2 A14B), which expert runs when.
"""
