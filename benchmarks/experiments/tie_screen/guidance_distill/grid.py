"""The image grid guidance_grid.png, written to benchmarks/results/tie_screen/guidance_distill/ unless
OUT is given: 12 held-out position prompts (seeds 8000-8011), one row per model and guidance: clean grid
model at 1 and 4, guidance 4 distilled in, the default (15 min, seed 6) at 1 and 2, its own guidance 2
distilled in. Paths are the session's scratch folders; see README.md here and beside the image.
Usage: python grid.py [OUT]"""
import sys
from pathlib import Path
import numpy as np, torch
torch.set_num_threads(1)
from PIL import Image
from flowgrpo.commands.probe import load_shapes_policy
from flowgrpo.shapes.evaluate import generate_ode
from flowgrpo.shapes.prompts import split_specs
from flowgrpo.images import to_uint8
RESULTS = Path(__file__).resolve().parents[3] / "results" / "tie_screen" / "guidance_distill"  # the data's folder
specs = list(split_specs("position")[1])[:12]
rows = []
for w, g in [("/work/scr/posB_grid/snapshots/step_1500", 1), ("/work/scr/posB_grid/snapshots/step_1500", 4), ("/work/scr/gd_g4/step_800", 1), ("/work/scr/rl/default-s6", 1), ("/work/scr/rl/default-s6", 2), ("/work/scr/gds_g2/step_800", 1)]:
    pol = load_shapes_policy(w)[0]; pol.guidance_scale = g
    with torch.no_grad():
        im = to_uint8(generate_ode(pol, [s.prompt for s in specs], list(range(8000, 8012)), num_steps=20))
    rows.append(np.concatenate([np.pad(i, ((2, 2), (2, 2), (0, 0)), constant_values=80) for i in im], 1))
Image.fromarray(np.concatenate(rows, 0)).resize((12 * 36 * 3, 6 * 36 * 3), Image.NEAREST).save(sys.argv[1] if len(sys.argv) > 1 else RESULTS / "guidance_grid.png")
