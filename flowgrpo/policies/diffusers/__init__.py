"""Adapters over diffusers transformer pipelines: a :class:`~flowgrpo.policies.base.Policy` per family.

* :mod:`.sd3`, :mod:`.flux`, :mod:`.wan`: the dedicated adapters (SD3 / 3.5, FLUX.1, Wan 2.1), each
  encoding prompts with its family's own recipe;
* :mod:`.generic`: the adapter for any other flow-matching pipeline folder, which learns how to
  call the transformer by recording the stock pipeline (:mod:`flowgrpo.diffusers.replay`);
* what they share: :mod:`.policy` (:class:`~.policy.DiffusersPolicy`, their base class),
  :mod:`.switches` (the memory and speed switches of ``ModelConfig``, its base) and :mod:`.common`
  (loading, dtypes, the trainable part, the scheduler's sigma grid).

Nothing is imported here: an adapter is imported when the registry builds it.
"""
