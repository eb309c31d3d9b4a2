"""What a run shows people: images drawn from a policy, grids, curves and videos.

* :mod:`.drawing`: deterministic drawing from a policy (the ODE from per-image seeds), for
  ``flowgrpo sample`` and the ``edit`` held-out evaluator;
* :mod:`.plots`: sample grids (captioned, labelled) and reward / accuracy curves;
* :mod:`.video_io`: an mp4 per video and a grid of frames per video.

Pixels themselves (8-bit conversion, PNG bytes, grids) are :mod:`flowgrpo.images`, shared with the
rewards' wire format.
"""
