"""Recording a stock diffusers pipeline's transformer calls, and replaying them with gradients.

Shared by the plug-in (:class:`~flowgrpo.diffusers.recorder.StepRecorder`, through
:mod:`flowgrpo.diffusers.general_replay`) and the generic adapter
(:mod:`flowgrpo.policies.diffusers.generic`):

* :mod:`.step_record`: what a pipeline hands its transformer and its scheduler in one step;
* :mod:`.call_replay`: how each argument of a recorded call is rebuilt on new latents and sigmas;
* :mod:`.velocity_combine`: how a step combines its calls' outputs into the velocity (guidance);
* :mod:`.latent_layout`: how a pipeline's ``latents=`` argument maps to the sample it steps;
* :mod:`.row_calls`: pipelines that take one prompt per call, replayed one row at a time.

They import torch only, but importing one runs :mod:`flowgrpo.diffusers`, which imports diffusers.
"""
