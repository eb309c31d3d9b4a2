"""Screen (issue 29, 27 Nov, fourth session): clean position-only pretraining (posB_sincos's arguments) with same-colour position pairs
drawn half of the time (17 % of the training pool). Usage: python pretrain_samecol.py OUT SHARE"""
import sys
import flowgrpo.shapes.pretrain as pre
from flowgrpo.shapes.prompts import split_specs, sample_train_spec
out, share = sys.argv[1], float(sys.argv[2])
pool = split_specs("position")[0]
same = [s for s in pool if s.objects[0].color == s.objects[1].color]
diff = [s for s in pool if s.objects[0].color != s.objects[1].color]
def patched(rng, tag=None):
    if tag == "position":
        sub = same if rng.random() < share else diff
        return sub[rng.integers(len(sub))]
    return sample_train_spec(rng, tag)
pre.sample_train_spec = patched
pre.main(["--out", out, "--steps", "1500", "--batch", "128", "--lr", "0.001", "--warmup", "300",
          "--caption-noise", "position=0", "--tag-weights",
          "single_object=0,two_object=0,counting=0,colors=0,color_attr=0,position=1", "--eval-every", "500",
          "--eval-cfg", "3", "--eval-prompts", "12", "--sigma-shift", "3", "--position-code", "sincos",
          "--cell-offset-bias", "--threads", "1", "--minutes", "120"])
