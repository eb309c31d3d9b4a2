"""flowgrpo: GRPO-style reinforcement learning for flow-matching image and video generators.

Data flow (one package per stage): ``flowgrpo.samplers`` produce rollouts (a forest of
transitions), ``flowgrpo.rewards`` score the leaves, ``flowgrpo.advantages`` assigns credit,
``flowgrpo.ops`` holds the GRPO loss (fused op + reference), ``flowgrpo.trainer`` orchestrates.
"""

__version__ = "0.1.0"
