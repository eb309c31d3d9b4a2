"""Model FLOPs of the bench's transformers, counted from their shapes, and the utilisation they give.

:func:`forward_flops` counts the multiply-adds of one forward of an SD3 (MMDiT), FLUX.1 or Wan 2.1
transformer from its config and the token counts alone (nothing runs). :func:`iteration_flops`
turns that into the FLOPs of a rollout and of an update as the trainer runs them, and
:func:`mfu` divides by time and the device's dense bf16 peak (:data:`PEAK_BF16_TFLOPS`): model FLOPs
utilisation, the distance to the physical limit. The count is checked against
``torch.utils.flop_counter.FlopCounterMode`` on the tiny SD3, FLUX and Wan (tests/test_bench_gpu.py).

Conventions: a matmul of [M, K] by [K, N] is 2 M K N FLOPs; attention of L query and L' key tokens
of width d (all heads) is 4 L L' d (Q K^T and the weighted sum of V; softmax, norms, activations,
RoPE and the VAE are not counted: they are a few per cent of a forward at these sizes). Model FLOPs
count what the algorithm needs: gradient checkpointing's recomputed forward is not counted, so a
checkpointed run shows a lower utilisation for the same work.
"""

from __future__ import annotations

from dataclasses import dataclass

#: dense (no sparsity) bf16 tensor-core peak, TFLOP/s, by device name; most specific names first
PEAK_BF16_TFLOPS = {
    "H100 PCIe": 756.0,    # NVIDIA H100 datasheet: 1,513 TFLOPS bf16 with sparsity, half dense
    "H100 NVL": 835.0,     # NVIDIA H100 NVL datasheet: 1,671 with sparsity
    "H100": 989.0,         # NVIDIA H100 SXM5 datasheet: 1,979 with sparsity (989.4 dense)
    "GH200": 989.0,        # NVIDIA GH200 datasheet: the H100 SXM tensor cores
    "H200": 989.0,         # NVIDIA H200 datasheet: 1,979 with sparsity (H100's tensor cores, more HBM)
    "B200": 2250.0,        # NVIDIA HGX B200 datasheet: 4.5 PFLOPS with sparsity per GPU
    "A100": 312.0,         # NVIDIA A100 datasheet: 312 dense, 624 with sparsity (40 and 80 GB alike)
    "L40S": 362.0,         # NVIDIA L40S datasheet: 362.05 dense, 733 with sparsity
    "L4": 121.0,           # NVIDIA L4 datasheet: 242 with sparsity
    "A10G": 70.0,          # AWS A10G (g5): 70 TFLOPS bf16 dense (AWS G5 documentation)
    "A10": 125.0,          # NVIDIA A10 datasheet: 125 dense, 250 with sparsity
    "RTX 4090": 165.2,     # NVIDIA Ada whitepaper: 165.2 bf16 with fp32 accumulate, dense
    "MI300X": 1307.4,      # AMD Instinct MI300X datasheet: 1,307.4 dense bf16
}


def peak_bf16_tflops(device_name: str | None) -> tuple[float | None, str]:
    """(the dense bf16 peak in TFLOP/s, where it came from) for a ``torch.cuda.get_device_name``;
    (None, the reason) for a device outside :data:`PEAK_BF16_TFLOPS` or no device name."""
    if not device_name:
        return None, "no device name"
    flat = device_name.replace(" ", "").replace("-", "").lower()
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key.replace(" ", "").replace("-", "").lower() in flat:
            return tflops, f"datasheet value for {key}"
    return None, f"no dense bf16 peak known for {device_name!r} (add it to PEAK_BF16_TFLOPS)"


@dataclass(frozen=True)
class Flops:
    """FLOPs of one forward: ``linear`` (every matmul and convolution with weights), ``attention``
    (4 L L' d per attention call); ``total`` their sum."""

    linear: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.attention


def image_tokens(class_name: str, config: dict, resolution: int, frames: int = 1, vae_factor: int = 8,
                 temporal_factor: int = 4) -> int:
    """Image (video) tokens the transformer sees for a ``resolution`` x ``resolution`` sample:
    SD3 ``(res / 8 / p)^2``; FLUX (2x2 packing) ``(res / 16)^2``; Wan ``((frames - 1) / 4 + 1) x
    (res / 8 / p_h) x (res / 8 / p_w)``."""
    side = resolution // vae_factor
    if class_name == "SD3Transformer2DModel":
        return (side // config["patch_size"]) ** 2
    if class_name == "FluxTransformer2DModel":
        return (side // 2) ** 2
    if class_name == "WanTransformer3DModel":
        pt, ph, pw = config["patch_size"]
        return ((frames - 1) // temporal_factor + 1) // pt * (side // ph) * (side // pw)
    raise ValueError(f"no FLOP count for {class_name}; known: SD3Transformer2DModel, FluxTransformer2DModel, "
                     "WanTransformer3DModel")


def forward_flops(class_name: str, config: dict, n: int, s: int, batch: int = 1) -> Flops:
    """FLOPs of one forward of ``batch`` samples of ``n`` image tokens and ``s`` text tokens.

    With d the inner width (heads x head dim), per sample:

    * **SD3** (``SD3Transformer2DModel``, MMDiT): each of the L joint blocks runs q, k, v, out and a
      4x MLP on both streams (12 d^2 weights: ``2 x 12 d^2 x (n + s)``; the last block's text stream
      only q, k, v: 3 d^2) and joint attention over n + s tokens (``4 (n + s)^2 d``); a dual-attention
      block (SD3.5) adds an image self-attention (4 d^2 weights, ``4 n^2 d``); adaLN linears
      d -> 6d per stream (9d with dual attention, 2d for the last text norm) on one token; plus the
      patch embedding (c p^2 -> d on n), the caption projection (T5 width -> d on s), proj_out and
      the time / pooled embedders.
    * **FLUX.1** (``FluxTransformer2DModel``): num_layers double-stream blocks as SD3's (12 d^2 per
      stream, attention over n + s), num_single_layers single-stream blocks on n + s tokens (q, k, v
      3 d^2, MLP in 4 d^2, fused out 5 d^2: 12 d^2; attention ``4 (n + s)^2 d``); adaLN 6d / 3d;
      x_embedder (64 -> d on n), context_embedder, proj_out, time / guidance / pooled embedders.
    * **Wan 2.1** (``WanTransformer3DModel``): each block runs self-attention (4 d^2 on n,
      ``4 n^2 d``), cross-attention (q and out on n, k and v on the s text tokens, ``4 n s d``) and an
      FFN d -> ffn_dim -> d on n; plus the 3D patch embedding, the text embedder (text_dim -> d -> d
      on s), the time embedder and projection (d -> 6d), proj_out.

    All of it times ``batch``. Returns :class:`Flops`.
    """
    c = config
    if class_name == "SD3Transformer2DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        p, L = c["patch_size"], c["num_layers"]
        dual = set(c.get("dual_attention_layers") or ())
        lin = 2 * n * c["in_channels"] * p * p * d + 2 * s * c["joint_attention_dim"] * c["caption_projection_dim"]
        lin += 2 * n * d * p * p * c["out_channels"] + 2 * (256 * d + d * d) + 2 * (c["pooled_projection_dim"] * d + d * d)
        lin += 2 * d * 2 * d  # norm_out
        att = 0
        for i in range(L):
            last = i == L - 1
            lin += 2 * 12 * d * d * n + 2 * (3 if last else 12) * d * d * s
            lin += 2 * d * (9 if i in dual else 6) * d + 2 * d * (2 if last else 6) * d
            att += 4 * (n + s) ** 2 * d
            if i in dual:
                lin += 2 * 4 * d * d * n
                att += 4 * n * n * d
    elif class_name == "FluxTransformer2DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        double, single = c["num_layers"], c["num_single_layers"]
        lin = 2 * n * c["in_channels"] * d + 2 * s * c["joint_attention_dim"] * d + 2 * n * d * c["in_channels"]
        lin += 2 * (256 * d + d * d) * (2 if c.get("guidance_embeds") else 1) + 2 * (c["pooled_projection_dim"] * d + d * d)
        lin += 2 * d * 2 * d  # norm_out
        lin += double * (2 * 12 * d * d * (n + s) + 2 * 2 * 6 * d * d) + single * (2 * 12 * d * d * (n + s) + 2 * 3 * d * d)
        att = (double + single) * 4 * (n + s) ** 2 * d
    elif class_name == "WanTransformer3DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        pt, ph, pw = c["patch_size"]
        patch = pt * ph * pw
        lin = 2 * n * c["in_channels"] * patch * d + 2 * n * d * patch * c["out_channels"]
        lin += 2 * s * (c["text_dim"] * d + d * d) + 2 * (c["freq_dim"] * d + d * d) + 2 * d * 6 * d
        per_block = 2 * 4 * d * d * n + 2 * 2 * d * d * n + 2 * 2 * d * d * s + 2 * 2 * d * c["ffn_dim"] * n
        lin += c["num_layers"] * per_block
        att = c["num_layers"] * (4 * n * n * d + 4 * n * s * d)
    else:
        image_tokens(class_name, c, 8)  # raises the ValueError naming the known classes
        raise AssertionError  # pragma: no cover
    return Flops(float(lin) * batch, float(att) * batch)


def iteration_flops(one: Flops, *, samples: int, num_steps: int, cfg: bool, kl: bool) -> dict[str, float]:
    """Model FLOPs of one iteration's rollout and update, from ``one``: the forward of ONE sample.

    Rollout: ``num_steps`` forwards of ``samples`` samples, doubled with classifier-free guidance.
    Update (LoRA: the frozen weights get no weight gradient): per step and sample a forward with
    gradients and its backward to the inputs, 2 forwards' worth, plus the unconditional half with
    CFG (no gradient, 1) and the base model's forward for the KL term (1, or 2 with CFG).
    Returns {"rollout", "update", "iteration"} in FLOPs."""
    f = one.total * samples * num_steps
    rollout = f * (2 if cfg else 1)
    update = f * (2 + (1 if cfg else 0) + ((2 if cfg else 1) if kl else 0))
    return {"rollout": rollout, "update": update, "iteration": rollout + update}


def mfu(flops: float, seconds: float | None, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops / seconds`` over the peak (a fraction; None without either)."""
    if not seconds or not peak_tflops:
        return None
    return flops / seconds / (peak_tflops * 1e12)


def point_flops(cls: str, config: dict, *, resolution: int, frames: int, text_tokens: int, samples: int,
                num_steps: int, cfg: bool, kl: bool, seconds: dict, peak_tflops: float | None) -> dict:
    """One bench point's FLOP figures for a transformer of class ``cls`` and ``config``: the forward of
    one sample (GFLOPs), rollout / update TFLOPs, achieved TFLOP/s and MFU of each from ``seconds``
    ({"rollout_s", "update_s", "iteration_s"})."""
    n = image_tokens(cls, config, resolution, frames)
    one = forward_flops(cls, config, n, text_tokens)
    it = iteration_flops(one, samples=samples, num_steps=num_steps, cfg=cfg, kl=kl)
    out = {"image_tokens": n, "text_tokens": text_tokens, "forward_gflops_per_sample": one.total / 1e9,
           "attention_share": one.attention / one.total}
    for k, v in it.items():
        s = seconds.get(f"{k}_s")
        out[f"{k}_tflops"] = v / 1e12
        out[f"{k}_tflops_per_s"] = v / s / 1e12 if s else None
        out[f"{k}_mfu"] = mfu(v, s, peak_tflops)
    return out
