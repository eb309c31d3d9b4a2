"""Diagnostic: fine-tune the shipped base on position scenes only, at high noise, with a leading cell.
Can the MMDiT learn B's placement given A's at all, when given lots of that signal?"""
import sys, json, copy, numpy as np, torch
torch.set_num_threads(1)
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.pretrain import make_batch, parse_noise, cell_noise_levels
out, lead, lo, hi, steps = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
m = ShapesFlowModel.load(None); m.train()
ema = copy.deepcopy(m).requires_grad_(False)
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, weight_decay=0.01, betas=(0.9, 0.99))
rng = np.random.default_rng(1); gen = torch.Generator().manual_seed(2)
noise = parse_noise(None)
tw = {t: (1.0 if t == "position" else 0.0) for t in noise}
for step in range(steps):
    x0, prompts = make_batch(rng, 128, 0.1, noise, tw)
    sigma = lo + (hi - lo) * torch.rand(128, generator=gen)
    s = cell_noise_levels(x0, sigma, lead, gen)
    xt = (1 - s) * x0 + s * torch.randn(x0.shape, generator=gen)
    h, p = m.encode(prompts)
    loss = ((m.predict(xt, sigma, h, p) - x0) ** 2).mean()
    opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    with torch.no_grad():
        for pe, pm in zip(ema.parameters(), m.parameters()):
            pe.lerp_(pm, 1 - min(0.995, (1 + step) / (10 + step)))
    if step % 100 == 0:
        print(step, loss.item(), flush=True)
ema.save(out)
