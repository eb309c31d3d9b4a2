"""What ``flowgrpo bench gpu`` runs on: the device's description and the random-weight SD3 it trains.

Two model sizes share every line of construction (:func:`build_components`):

* ``sd35-medium``: the SD3.5-Medium transformer at its published configuration
  (:func:`flowgrpo.realsize.configs.build_transformer`, random weights, built on the device in the
  run's dtype), shrunk random text encoders with the real output widths (CLIP-L 768 and CLIP-G
  1280 wide: pooled 2048; a T5 4096 wide: the joint width; two layers each, tiny vocabularies) and
  the real SD3 VAE configuration (16 latent channels, 8x down-sampling) with random weights;
* ``tiny``: the same builder with the transformer's config keys overridden to the tiny SD3 of
  :mod:`flowgrpo.policies.tiny.sd3` and narrow encoders / VAE (the CPU form of the test suite).

:func:`registered_components` makes the components the ``model.name=bench-gpu-sd3`` policy of
flowgrpo's trainer (an :class:`~flowgrpo.policies.diffusers.sd3.SD3Policy` over them), so the flowgrpo side is
the trainer's own path; the Flow-GRPO side gets a deep copy (the same weights, its own modules).
"""

from __future__ import annotations

from contextlib import contextmanager

import shutil
import subprocess
from dataclasses import dataclass, field

import torch

#: the model name under which :func:`registered_components` hands components to the trainer
BENCH_MODEL = "bench-gpu-sd3"
_PENDING: dict = {}

#: SD3's VAE (``stabilityai/stable-diffusion-3.5-medium``'s ``vae/config.json``)
SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
               act_fn="silu", norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)
TINY_VAE = dict(SD3_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=4, sample_size=64)
#: the tiny SD3 of flowgrpo.policies.tiny.sd3 as overrides of SD3.5-Medium's transformer config
TINY_TRANSFORMER = dict(sample_size=8, num_layers=2, attention_head_dim=16, num_attention_heads=4,
                        caption_projection_dim=64, joint_attention_dim=96, pooled_projection_dim=80,
                        pos_embed_max_size=32, dual_attention_layers=(0,))


@dataclass(frozen=True)
class ModelSize:
    """One model size of the benchmark.

    Attributes:
        name: ``sd35-medium`` or ``tiny``.
        transformer_overrides: config keys replacing SD3.5-Medium's published ones (tiny: all widths).
        clip_widths: hidden = projection widths of the two CLIPs (pooled width = their sum).
        t5_width: T5 d_model (= the transformer's joint_attention_dim).
        encoder_layers, t5_ff: depth of every text encoder; T5's feed-forward width.
        clip_max_length: CLIP tokens (77 as SD3); max_sequence_length: T5 tokens.
        resolution: image side in pixels; vae: ``AutoencoderKL`` keyword arguments.
    """

    name: str
    transformer_overrides: dict = field(default_factory=dict)
    clip_widths: tuple[int, int] = (768, 1280)
    t5_width: int = 4096
    encoder_layers: int = 2
    t5_ff: int = 1024
    clip_max_length: int = 77
    max_sequence_length: int = 128
    resolution: int = 512
    vae: dict = field(default_factory=lambda: dict(SD3_VAE))


SIZES = {
    "sd35-medium": ModelSize("sd35-medium"),
    "tiny": ModelSize("tiny", TINY_TRANSFORMER, clip_widths=(32, 48), t5_width=96, t5_ff=128, clip_max_length=16,
                      max_sequence_length=32, resolution=64, vae=dict(TINY_VAE)),
}


def build_components(size: ModelSize, device: torch.device, dtype: torch.dtype, seed: int = 0) -> dict:
    """``StableDiffusion3Pipeline``-keyed random components of ``size`` on ``device``: the transformer
    and text encoders in ``dtype``, the VAE in float32 (as both trainers run it), SD3's scheduler.
    Deterministic in ``seed``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from flowgrpo.policies.tiny.sd3 import tiny_clip_tokenizer, tiny_t5_tokenizer
    from flowgrpo.realsize.configs import build_transformer

    tok = tiny_clip_tokenizer(max_length=size.clip_max_length)
    tok_2 = tiny_clip_tokenizer(max_length=size.clip_max_length)
    tok_3 = tiny_t5_tokenizer()

    def clip(width: int):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tok), hidden_size=width, intermediate_size=2 * width, projection_dim=width,
            num_hidden_layers=size.encoder_layers, num_attention_heads=max(4, width // 64),
            max_position_embeddings=size.clip_max_length, hidden_act="quick_gelu", bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))

    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        encoders = [clip(size.clip_widths[0]), clip(size.clip_widths[1]), T5EncoderModel(T5Config(
            vocab_size=len(tok_3), d_model=size.t5_width, d_kv=max(24, size.t5_width // 64), d_ff=size.t5_ff,
            num_layers=size.encoder_layers, num_heads=min(8, max(4, size.t5_width // 512)),
            relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
            feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False,
            pad_token_id=tok_3.pad_token_id, eos_token_id=tok_3.eos_token_id))]
        vae = AutoencoderKL(**size.vae)
        overrides = dict(size.transformer_overrides, pooled_projection_dim=sum(size.clip_widths),
                         joint_attention_dim=size.t5_width)
        transformer = build_transformer("sd35-medium", device=device, dtype=dtype, **overrides)
    encoders = [e.to(device=device, dtype=dtype).eval().requires_grad_(False) for e in encoders]
    return {"scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
            "transformer": transformer.eval(), "vae": vae.to(device).eval().requires_grad_(False),
            "text_encoder": encoders[0], "tokenizer": tok, "text_encoder_2": encoders[1], "tokenizer_2": tok_2,
            "text_encoder_3": encoders[2], "tokenizer_3": tok_3}


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


#: the adapters :func:`registered_components` can build a bench policy with: name -> (module, class, model
#: fields passed where set)
BENCH_POLICIES = {"sd3": ("flowgrpo.policies.diffusers.sd3", "SD3Policy", ("resolution", "max_sequence_length")),
                  "flux": ("flowgrpo.policies.diffusers.flux", "FluxPolicy", ("resolution", "max_sequence_length")),
                  "wan": ("flowgrpo.policies.diffusers.wan", "WanPolicy",
                          ("resolution", "max_sequence_length", "num_frames"))}


def _build_bench_policy(cfg):
    """The ``model.name=bench-gpu-sd3`` factory: a policy of the registered adapter over the components
    last registered."""
    import importlib

    from flowgrpo.policies.diffusers.common import set_model_options
    from flowgrpo.policies.diffusers.switches import runtime_options, torch_dtype

    if "components" not in _PENDING:
        raise RuntimeError(f"model.name={BENCH_MODEL} is built by `flowgrpo bench gpu` only (no components registered)")
    module, cls, fields = BENCH_POLICIES[_PENDING.get("policy", "sd3")]
    return getattr(importlib.import_module(module), cls).from_components(
        _PENDING.pop("components"), guidance_scale=cfg.guidance_scale, train_mode=cfg.train_mode,
        lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha, dtype=torch_dtype(cfg.dtype),
        **set_model_options(cfg, fields), **runtime_options(cfg))


@contextmanager
def registered_components(components: dict, policy: str = "sd3"):
    """Within the block, ``model.name=bench-gpu-sd3`` builds a policy of ``components`` with the adapter
    ``policy`` (a :data:`BENCH_POLICIES` key; yields that model name). The registry entry is removed
    on leaving, so the process's ``POLICIES`` is as it was (the test suite runs this in-process: a
    lasting entry changed other tests' lists of adapters)."""
    from flowgrpo.policies import POLICIES

    if policy not in BENCH_POLICIES:
        raise ValueError(f"unknown bench adapter {policy!r}; valid: {', '.join(BENCH_POLICIES)}")
    POLICIES.register(BENCH_MODEL)(_build_bench_policy)
    _PENDING.update(components=components, policy=policy)
    try:
        yield BENCH_MODEL
    finally:
        POLICIES.unregister(BENCH_MODEL)
        _PENDING.pop("components", None)
        _PENDING.pop("policy", None)


# ---------------------------------------------------------------------------------------------- device

#: HBM bandwidth (GB/s) by device name, used where the driver does not report clock and bus width
PEAK_GBPS = {"H100 SXM": 3350.0, "H100 NVL": 3900.0, "H100 PCIe": 2000.0, "H100": 3350.0, "H200": 4800.0,
             "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "A100-PCIE-40GB": 1555.0, "A100 80GB PCIe": 1935.0}


def peak_bandwidth_gbps(device: torch.device) -> tuple[float | None, str]:
    """(the device memory's peak GB/s, how it was found). CUDA: 2 x memory clock x bus width (DDR)
    from the device properties where torch exposes them, else by name (:data:`PEAK_GBPS`); CPU: None."""
    if device.type != "cuda":
        return None, "no peak for the CPU (the copy bandwidth is measured instead)"
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, f"2 x {clock_khz / 1e3:.0f} MHz x {bus_bits} bit"
    name = torch.cuda.get_device_name(device)
    flat = name.replace(" ", "").replace("-", "").lower()
    for key, gbps in PEAK_GBPS.items():  # most specific names first
        if key.replace(" ", "").replace("-", "").lower() in flat:
            return gbps, f"datasheet value for {key}"
    return None, f"unknown for {name!r}"


def device_info(device: torch.device) -> dict:
    """Name, torch / CUDA versions, driver (nvidia-smi), memory and peak bandwidth of ``device``."""
    import platform
    import sys

    info = {"device": str(device), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "python": sys.version.split()[0], "machine": platform.machine(), "cpu_threads": torch.get_num_threads()}
    for mod in ("diffusers", "transformers", "peft", "accelerate"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:  # pragma: no cover - reported, not fatal
            info[mod] = f"unavailable ({type(exc).__name__})"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    total_memory_gib=props.total_memory / 2**30, multiprocessors=props.multi_processor_count)
    else:
        info["name"] = platform.processor() or platform.machine()
    info["peak_gbps"], info["peak_gbps_source"] = peak_bandwidth_gbps(device)
    from .gpu_flops import peak_bf16_tflops

    info["peak_bf16_tflops"], info["peak_bf16_tflops_source"] = (
        peak_bf16_tflops(info["name"]) if device.type == "cuda" else (None, "no dense bf16 peak for the CPU: no MFU"))
    info["driver"] = nvidia_smi_driver()
    return info


def nvidia_smi_driver() -> str | None:
    """The driver version nvidia-smi reports, or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
