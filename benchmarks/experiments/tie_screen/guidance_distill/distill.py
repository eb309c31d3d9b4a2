"""Guidance distillation screen (issue 29, 27 Nov, fourth session): fine-tune a shapes model so that its
guidance-1 prediction matches its own frozen copy's classifier-free-guided one at scale G,

    target = x0_u + G (x0_c - x0_u)      (teacher's x0 predictions, no gradient; the model predicts x0),
    loss   = mean((x0_student(x_sigma, c) - target)^2),

on clean position scenes (training prompts; DATA = position) or on the pretraining's own batches (DATA =
pretrain: its caption noise and tag weights, 10 % empty captions, whose target is then the teacher's
unconditional prediction, so guidance still works on the student), x_sigma = (1 - sigma) x0 + sigma eps with the pretraining
noise-level sampler (logit-normal shifted by 3). It asks whether a base whose guidance-1 sampling is
the guided model's coordinates two objects better than supervised training alone. An EMA (0.99) of
the student is saved as OUT/step_N every 200 steps.

With SIGMA_LO > 0 the guidance applies only where sigma >= SIGMA_LO (a guidance interval: below it the
target is the teacher's conditional prediction, so fine detail is left as the model draws it).

Usage: python distill.py TEACHER_DIR OUT G [STEPS [LR [DATA [SIGMA_LO]]]]
"""
import copy, json, sys, time
from pathlib import Path
import numpy as np
import torch
torch.set_num_threads(1)
from flowgrpo.samplers.schedule import shift_sigmas
from flowgrpo.shapes.model import ShapesFlowModel
from flowgrpo.shapes.pretrain import DEFAULT_CAPTION_NOISE, DEFAULT_TAG_WEIGHTS, make_batch
from flowgrpo.shapes.world import TAGS


def distill(teacher, batches, G: float, sigma_lo: float, steps: int, lr: float, out: Path, meta: dict,
            rng: np.random.Generator, batch: int = 64) -> None:
    """Fine-tune a copy of ``teacher`` (a ShapesFlowModel) toward teacher x0_u + g (x0_c - x0_u), g = G
    where sigma >= sigma_lo and 1 below; ``batches(rng, batch)`` -> (x0 [B, 3, 32, 32] in [-1, 1],
    captions). Saves the EMA (0.99) as OUT/step_N and a loss line in OUT/log.jsonl every 200 steps."""
    teacher = teacher.requires_grad_(False).eval()
    student = copy.deepcopy(teacher).requires_grad_(True).train()
    ema = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters(), lr=lr, weight_decay=0.0)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "log.jsonl").open("a")
    t0 = time.time(); losses = []
    for step in range(1, steps + 1):
        x0, prompts = batches(rng, batch)
        sigma = shift_sigmas(torch.sigmoid(torch.randn(batch)), 3.0)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * torch.randn_like(x0)
        with torch.no_grad():
            hc, pc = teacher.encode(prompts)
            hu, pu = teacher.encode([""] * batch)
            xc, xu = teacher.predict(xt, sigma, hc, pc), teacher.predict(xt, sigma, hu, pu)
            scale = torch.where(sigma >= sigma_lo, G, 1.0).view(-1, 1, 1, 1)
            target = xu + scale * (xc - xu)
        h, p = student.encode(prompts)
        loss = torch.mean((student.predict(xt, sigma, h, p) - target) ** 2)
        opt.zero_grad(set_to_none=True); loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0); opt.step()
        with torch.no_grad():
            for pe, pm in zip(ema.parameters(), student.parameters()):
                pe.lerp_(pm, 0.01)
        losses.append(loss.item())
        if step % 200 == 0:
            ema.save(out / f"step_{step}", extra={"distill": {**meta, "G": G, "step": step, "lr": lr, "sigma_lo": sigma_lo}})
            rec = {"step": step, "loss": float(np.mean(losses)), "minutes": (time.time() - t0) / 60}
            log.write(json.dumps(rec) + "\n"); log.flush(); print(rec, flush=True); losses = []


if __name__ == "__main__":
    src, out, G = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3])
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 800
    lr = float(sys.argv[5]) if len(sys.argv) > 5 else 1e-4
    data = sys.argv[6] if len(sys.argv) > 6 else "position"
    sigma_lo = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    torch.manual_seed(0)
    if data == "position":
        noise, weights, drop = {t: 0.0 for t in TAGS}, {t: float(t == "position") for t in TAGS}, 0.0
    else:
        noise, weights, drop = DEFAULT_CAPTION_NOISE, DEFAULT_TAG_WEIGHTS, 0.1
    distill(ShapesFlowModel.load(src), lambda rng, b: make_batch(rng, b, drop, noise, weights), G, sigma_lo,
            steps, lr, out, {"teacher": src, "data": data}, np.random.default_rng(0))
