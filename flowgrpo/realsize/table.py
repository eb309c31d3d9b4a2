"""The per-GPU memory table of the recipes: rows, rich / markdown rendering, the docs' marked section.

A row is one recipe: :func:`~flowgrpo.realsize.memory.training_state` (weights and LoRA training
state per layout) plus :func:`~flowgrpo.realsize.activations.activation_bytes` (one training
forward of the recipe's micro-batch), and the whole run's per-GPU budget of every loaded module by
phase and layout (:mod:`flowgrpo.realsize.recipe_budget`, :mod:`flowgrpo.realsize.budget`). The sample size comes from the recipe YAML
(``flowgrpo/recipes/<name>.yaml`` through ``flowgrpo.config.load_config(recipe=...)``) where it
exists, else from the adapter's defaults (:func:`recipe_geometry`); explicit values override both.
All sizes are GiB (2**30 bytes).
"""

from __future__ import annotations

import re
from pathlib import Path

from .activations import Geometry, activation_bytes
from .configs import recipe_config, recipe_names, transformer_config
from .memory import training_state

GIB = 2**30
BEGIN, END = "<!-- memory-table:begin -->", "<!-- memory-table:end -->"
#: adapters' own defaults (``resolution``, ``max_sequence_length`` / text tokens) where model.* leaves them unset
_ADAPTER_DEFAULTS = {"sd3": (512, 256), "wan": (480, 512), "flux": (1024, 512)}
#: text tokens in front of the T5 ones (SD3: CLIP's 77) and fixed text lengths (HunyuanVideo 1.5's MLLM: 1000)
_TEXT_PREFIX = {"StableDiffusion3Pipeline": 77}
_FIXED_TEXT = {"HunyuanVideo15Pipeline": 1000}


def recipe_geometry(recipe: str, resolution: int | None = None, frames: int | None = None,
                    micro_batch: int | None = None) -> tuple[Geometry, dict]:
    """The training micro-batch of ``recipe`` and where its numbers came from.

    From the recipe (``model.resolution``, ``model.num_frames``, ``model.max_sequence_length``,
    ``train.micro_batch``, CFG in the update (:func:`_cfg_in_update`), ``model.gradient_checkpointing``,
    ``model.lora_rank``); a size the recipe leaves null is the adapter's default. Explicit arguments win.
    Returns ``(geometry, info)``; ``info`` holds ``source``, ``checkpointing``, ``cfg`` and ``rank``.
    """
    from ..policies.diffusers.generic.families import family_of

    entry = transformer_config(recipe)
    family = family_of(entry.pipeline)
    res_default, text_default = _ADAPTER_DEFAULTS.get(entry.adapter, (family.resolution, family.max_sequence_length))
    video = entry.class_name.endswith("3DModel")
    cfg = recipe_config(recipe)
    m = cfg.model
    res = m.resolution or res_default
    nframes = (m.num_frames or family.num_frames) if video else 1
    text = m.max_sequence_length or text_default
    batch = cfg.train.micro_batch
    info = {"source": "recipe", "checkpointing": bool(m.gradient_checkpointing),
            "cfg": _cfg_in_update(entry, m.guidance_scale, cfg), "rank": int(m.lora_rank)}
    res = resolution or res
    nframes = (frames or nframes) if video else 1
    batch = micro_batch or batch
    text = _FIXED_TEXT.get(entry.pipeline, _TEXT_PREFIX.get(entry.pipeline, 0) + text)
    reference = family.reference_kwarg is not None
    return Geometry(res, nframes, text, batch * (2 if info["cfg"] else 1), reference), info


def _cfg_in_update(entry, guidance_scale: float, cfg) -> bool:
    """Whether the training forward carries the unconditional half too (the micro-batch doubles): real
    CFG (not a guidance-distilled model's embedded guidance) whose unconditional pass has gradients:
    always through the generic adapter (it replays the pipeline's calls), with ``loss.cfg_uncond_grad``
    for the sd3 / wan adapters."""
    if guidance_scale <= 1 or entry.config.get("guidance_embeds"):
        return False
    return entry.adapter == "pipeline" or bool(cfg.loss.cfg_uncond_grad)


def memory_row(recipe: str, gpus: int = 8, resolution: int | None = None, frames: int | None = None,
               micro_batch: int | None = None, rank: int = 0, **switches) -> dict:
    """One recipe's row: counts, per-layout bytes and activations (see the module docstring).

    Keys: ``recipe``, ``class_name``, ``experts``, ``transformer_params``, ``lora_params``,
    ``lora_rank``, ``wrapped_layers``, ``wrapped_by_block``, ``geometry`` (resolution, frames, text
    tokens, batch), ``image_tokens``, ``activations`` (``checkpointing`` / ``no_checkpointing`` bytes
    of one expert's forward), ``checkpointing`` (the recipe's setting), ``per_gpu`` ({layout: bytes
    by kind, ``activations`` and ``total`` included: the transformer alone, 1 and ``gpus`` GPUs}),
    ``source``, and the whole run: ``components`` (every other module the pipeline loads: params,
    bytes), ``budget`` ({layout of :data:`~flowgrpo.realsize.budget.LAYOUTS`: bytes by kind and by
    phase, ``total``}) with ``fits_80`` / ``fits_24`` (:func:`~flowgrpo.realsize.recipe_budget.budgets`).
    ``switches`` (``offload_text_encoders``, ``precompute_prompts``, ``reference_device``,
    ``ema_device``, ``train_mode``) replace the recipe's settings in the whole-run figures.
    """
    from .recipe_budget import budgets, recipe_inputs

    geo, info = recipe_geometry(recipe, resolution, frames, micro_batch)
    rank = rank or info["rank"]
    state = training_state(recipe, gpus_list=sorted({1, gpus}), rank=rank)
    act = activation_bytes(recipe, geo, rank=rank)
    used = act.checkpointing if info["checkpointing"] else act.no_checkpointing
    per_gpu = {}
    for name, kinds in state.per_gpu.items():
        per_gpu[name] = {**kinds, "activations": used, "total": kinds["total"] + used}
    row = state.as_dict()
    row.update(per_gpu=per_gpu, geometry=geo.__dict__, image_tokens=act.image_tokens, source=info["source"],
               checkpointing=info["checkpointing"], cfg_in_update=info["cfg"],
               activations={"checkpointing": act.checkpointing, "no_checkpointing": act.no_checkpointing,
                            "outside": act.outside, "block_inputs": act.block_inputs,
                            "largest_block": max(act.blocks, default=0), "blocks": len(act.blocks)})
    inputs, parts = recipe_inputs(recipe, geo, info, state, act, **switches)
    whole = budgets(inputs)
    row.update(components=parts, budget=whole["layouts"], fits_80=whole["fits_80"], fits_24=whole["fits_24"],
               text_encoders=inputs.text_encoders, trainable="full" if inputs.full_finetune else "lora")
    return row


def memory_rows(recipes=None, gpus: int = 8, **kwargs) -> list[dict]:
    """:func:`memory_row` of every recipe in ``recipes`` (default: all)."""
    return [memory_row(r, gpus, **kwargs) for r in (recipes or recipe_names())]


def _gib(b: int) -> str:
    return f"{b / GIB:.1f}"


def table_cells(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and cells shared by the rich and markdown renderings: one line per recipe and layout of
    the whole-run budget (``row["budget"]``), the fitting layouts on the recipe's first line."""
    head = ["recipe", "params", "LoRA (rank)", "sample", "layout", "transformer", "text enc.", "VAE",
            "LoRA/Adam/EMA/ref", "rollout", "update", "peak GiB (phase)", "fits 80 GB", "fits 24 GB"]
    cells = []
    for r in rows:
        g = r["geometry"]
        sample = f"{g['resolution']}px" + (f" x{g['frames']}f" if g["frames"] > 1 else "") + f" b{g['batch']}"
        enc_note = {"resident": "", "visiting": " (off)", "precomputed": " (freed)"}[r["text_encoders"]]
        for i, (layout, b) in enumerate(r["budget"].items()):
            state = b["lora_weights"] + b["adamw"] + b["ema"] + b["reference"]
            first = i == 0
            params = f"{r['transformer_params'] / 1e9:.2f}B" + (f" ({r['experts']} experts)" if r["experts"] > 1 else "")
            lora = f"{r['lora_params'] / 1e6:.1f}M (r{r['lora_rank']})" if r["trainable"] == "lora" else "full"
            cells.append([r["recipe"] if first else "", params if first else "", lora if first else "",
                          sample if first else "", layout, _gib(b["transformer"]), _gib(b["text_encoders"]) + enc_note,
                          _gib(b["vae"]), _gib(state), _gib(b["phases"]["rollout"]), _gib(b["phases"]["update"]),
                          f"{_gib(b['total'])} ({b['peak_phase']})",
                          (r["fits_80"] or "none") if first else "", (r["fits_24"] or "none") if first else ""])
    return head, cells


def print_table(rows: list[dict], title: str = "per-GPU training memory (every loaded module, peak phase)") -> None:
    """The rows as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    head, cells = table_cells(rows)
    table = Table(title=title)
    for i, h in enumerate(head):
        table.add_column(h, justify="left" if i in (0, 3, 4, 11, 12, 13) else "right")
    for c in cells:
        table.add_row(*c)
    Console(width=200).print(table)


def markdown_table(rows: list[dict]) -> str:
    """The rows as a GitHub markdown table (one line per recipe and layout)."""
    head, cells = table_cells(rows)
    left = (0, 3, 4, 11, 12, 13)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" if i in left else "---:" for i in range(len(head))) + "|"]
    lines += ["| " + " | ".join(c) + " |" for c in cells]
    lines += ["", "GiB per GPU (2^30 bytes) of every module the recipe's pipeline loads, built at its published size "
              "without weights: the transformer (every expert; FSDP: 1/8 plus two gathered blocks; FSDP+offload: "
              "the gathered blocks only), the text encoders (`(off)`: `model.offload_text_encoders`, on the GPU "
              "only while prompts are encoded; `(freed)`: `model.precompute_prompts`), the VAE, float32 LoRA "
              "weights + AdamW moments + EMA (+ a full fine-tune's reference copy). `rollout`: the iteration's "
              "rollout phase (those, the stored trajectory and one no-grad forward of the rollout micro-batch with "
              "its CFG half); `update`: the training phase (gradients and the activations of one micro-batch, `b` "
              "samples, with the recipe's gradient checkpointing). The peak is the largest phase (encode, rollout, "
              "decode, update, step: the DDP step adds the flat float32 gradient sum); `fits`: the first layout "
              "whose peak is under 90 % of the GPU's memory (GB = 10^9 bytes), the rest left for the CUDA context "
              "and the allocator. Method: [results/real_models.md](results/real_models.md#real-size-without-weights)."]
    return "\n".join(lines) + "\n"


_MARKED = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)


def has_markers(path: str | Path) -> bool:
    """Whether ``path`` is a text file holding the ``memory-table`` begin and end markers, in order."""
    path = Path(path)
    try:
        return path.is_file() and bool(_MARKED.search(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError):
        return False


def replace_marked(path: str | Path, content: str) -> bool:
    """Replace what lies between the ``memory-table`` markers of ``path`` by ``content``; False (file
    untouched) when the file or either marker is missing."""
    path = Path(path)
    if not has_markers(path):
        return False
    text = path.read_text(encoding="utf-8")
    pattern = _MARKED
    path.write_text(pattern.sub(lambda _: f"{BEGIN}\n{content.rstrip()}\n{END}", text, count=1), encoding="utf-8")
    return True
