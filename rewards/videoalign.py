"""VideoAlign / VideoReward (Liu et al., 2025): a Qwen2-VL-2B video reward model with three outputs, VQ, MQ, TA.

Architecture (KwaiVGI/VideoAlign ``trainer.py``: ``Qwen2VLRewardModelBT``; ``inference.py``:
``VideoVLMRewardInference``): Qwen2-VL-2B-Instruct fine-tuned with LoRA (r 64, alpha 128 on every
linear layer of the language model) reads one user turn, the video then the "detailed_special"
instruction below, which holds three added tokens ``<|VQ_reward|>``, ``<|MQ_reward|>``,
``<|TA_reward|>``. A bias-free Linear(hidden, 1) on the last hidden state at each of them gives
visual quality (VQ), motion quality (MQ) and text-to-video alignment (TA); with ``normalize`` (the
authors' ``use_norm=True``) each is standardised by the checkpoint's ``inference_config`` means and
stds, and ``Overall = VQ + MQ + TA``. Positions are the plain sequence positions, as the authors'
forward computes them (:mod:`flowgrpo.rewards.qwen_vl`).

Weights: the released folder (hub repository ``KwaiVGI/VideoReward``): ``model_config.json`` (data,
model, LoRA and normalisation settings, read here) and ``checkpoint-N/model.pth`` (the PEFT-wrapped
state dict; the LoRA pairs are merged on load, in float32), plus the base model's config and processor
(``model_config.model_name_or_path``, Qwen/Qwen2-VL-2B-Instruct, unless ``base_model`` names one).

Video input: the frames this reward receives are sampled as the authors' ``fetch_video`` samples a
file (``sample_type: uniform``): ``fps`` from the config (2 frames per second of a video at
``video_fps``, at least 4, at most 768, a multiple of 2) or its ``num_frames``, taken at
``linspace(0, F - 1, n).round()``; each frame is resized to multiples of 28 px within
[128 x 28 x 28, max_frame_pixels] (qwen-vl-utils, bicubic; here antialiased on float pixels).
Set ``video_fps`` to the rate of the frames handed over (the generator's fps / ``reward.frame_stride``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor, nn

from flowgrpo.errors import ConfigError, UserError
from flowgrpo.text_inputs import loads_json

from .base import RewardOutput
from .clip_common import check_choice, first_line, load_state_dict_file, positive_int, resolve_device
from .qwen_vl import build_model, convert_state_dict, encode, load_processor, load_qwen2vl_config, resize, resolve_dtype

DIMENSIONS = ("VQ", "MQ", "TA")
CHOICES = (*DIMENSIONS, "Overall")
REWARD_TOKENS = ["<|VQ_reward|>", "<|MQ_reward|>", "<|TA_reward|>"]
#: qwen-vl-utils' video settings in VideoAlign's ``vision_process.py``
VIDEO_MIN_PIXELS = 128 * 28 * 28
FRAME_FACTOR, MIN_FRAMES, MAX_FRAMES, FPS = 2, 4, 768, 2.0
#: ``prompt_template.py``: ``DETAILED_PROMPT_WITH_SPECIAL_TOKEN`` (``prompt_template_type: detailed_special``),
#: byte for byte; ``{text_prompt}`` is the prompt
PROMPT = (
    '\n'
    'You are tasked with evaluating a generated video based on three distinct criteria: Visual '
    'Quality, Motion Quality, and Text Alignment. Please provide a rating from 0 to 10 for each of '
    'the three categories, with 0 being the worst and 10 being the best. Each evaluation should be '
    'independent of the others.\n'
    '\n'
    '**Visual Quality:**  \n'
    'Evaluate the overall visual quality of the video, with a focus on static factors. The following '
    'sub-dimensions should be considered:\n'
    '- **Reasonableness:** The video should not contain any significant biological or logical errors, '
    'such as abnormal body structures or nonsensical environmental setups.\n'
    '- **Clarity:** Evaluate the sharpness and visibility of the video. The image should be clear and '
    'easy to interpret, with no blurring or indistinct areas.\n'
    '- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other '
    'visual elements (e.g., hair, clothing, shadows).\n'
    '- **Aesthetic and Creativity:** Assess the artistic aspects of the video, including the color '
    'scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene '
    'should convey a sense of harmony and balance.\n'
    '- **Safety:** The video should not contain harmful or inappropriate content, such as political, '
    'violent, or adult material. If such content is present, the image quality and satisfaction score '
    'should be the lowest possible. \n'
    '\n'
    'Please provide the ratings of Visual Quality: <|VQ_reward|>\n'
    'END\n'
    '\n'
    '**Motion Quality:**  \n'
    'Assess the dynamic aspects of the video, with a focus on dynamic factors. Consider the following '
    'sub-dimensions:\n'
    '- **Stability:** Evaluate the continuity and stability between frames. There should be no '
    'sudden, unnatural jumps, and the video should maintain stable attributes (e.g., no fluctuating '
    'colors, textures, or missing body parts).\n'
    '- **Naturalness:** The movement should align with physical laws and be realistic. For example, '
    'clothing should flow naturally with motion, and facial expressions should change appropriately '
    '(e.g., blinking, mouth movements).\n'
    '- **Aesthetic Quality:** The movement should be smooth and fluid. The transitions between '
    'different motions or camera angles should be seamless, and the overall dynamic feel should be '
    'visually pleasing.\n'
    '- **Fusion:** Ensure that elements in motion (e.g., edges of the subject, hair, clothing) blend '
    'naturally with the background, without obvious artifacts or the feeling of cut-and-paste '
    'effects.\n'
    '- **Clarity of Motion:** The video should be clear and smooth in motion. Pay attention to any '
    'areas where the video might have blurry or unsteady sections that hinder visual continuity.\n'
    '- **Amplitude:** If the video is largely static or has little movement, assign a low score for '
    'motion quality.\n'
    '\n'
    'Please provide the ratings of Motion Quality: <|MQ_reward|>\n'
    'END\n'
    '\n'
    '**Text Alignment:**  \n'
    'Assess how well the video matches the textual prompt across the following sub-dimensions:\n'
    '- **Subject Relevance** Evaluate how accurately the subject(s) in the video (e.g., person, '
    'animal, object) align with the textual description. The subject should match the description in '
    'terms of number, appearance, and behavior.\n'
    '- **Motion Relevance:** Evaluate if the dynamic actions (e.g., gestures, posture, facial '
    'expressions like talking or blinking) align with the described prompt. The motion should match '
    'the prompt in terms of type, scale, and direction.\n'
    '- **Environment Relevance:** Assess whether the background and scene fit the prompt. This '
    'includes checking if real-world locations or scenes are accurately represented, though some '
    'stylistic adaptation is acceptable.  \n'
    '- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, '
    'evaluate how well the video adheres to this style.\n'
    '- **Camera Movement Relevance:** Check if the camera movements (e.g., following the subject, '
    'focus shifts) are consistent with the expected behavior from the prompt.\n'
    '\n'
    'Textual prompt - {text_prompt}\n'
    'Please provide the ratings of Text Alignment: <|TA_reward|>\n'
    'END\n'
)


def sample_frames(total: int, video_fps: float, fps: float | None, num_frames: int | None) -> list[int]:
    """Frame indices of a video of ``total`` frames at ``video_fps``, as VideoAlign's ``smart_nframes`` +
    uniform sampling: ``num_frames`` rounded to an even count, or ``total / video_fps * fps`` clamped to
    [4, min(768, total)] and rounded to an even count; never more than ``total``."""
    if num_frames is not None:
        n = round(num_frames / FRAME_FACTOR) * FRAME_FACTOR
    else:
        lo = math.ceil(MIN_FRAMES / FRAME_FACTOR) * FRAME_FACTOR
        hi = math.floor(min(MAX_FRAMES, total) / FRAME_FACTOR) * FRAME_FACTOR
        n = round(min(max(total / video_fps * (fps or FPS), lo), hi) / FRAME_FACTOR) * FRAME_FACTOR
    n = min(n, total)
    if n < FRAME_FACTOR:
        raise ValueError(f"videoalign needs videos of at least {FRAME_FACTOR} frames to sample; got {total} frame(s)")
    return torch.linspace(0, total - 1, n).round().long().tolist()


def read_model_config(folder: Path) -> dict:
    """``model_config.json`` of a VideoAlign checkpoint folder, checked for the released layout."""
    path = folder / "model_config.json"
    if not path.is_file():
        raise UserError(f"videoalign checkpoint: no model_config.json in {str(folder)!r}")
    try:
        cfg = loads_json(path.read_text())
        data, model = cfg["data_config"], cfg["model_config"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"videoalign checkpoint: cannot read {str(path)!r} ({first_line(exc)})") from None
    if data.get("prompt_template_type") != "detailed_special" or not model.get("use_special_tokens"):
        raise UserError(f"videoalign checkpoint: {str(path)!r} is not a detailed_special model with reward tokens "
                        f"(prompt_template_type={data.get('prompt_template_type')!r})")
    return cfg


def latest_weights(folder: Path) -> Path:
    """``checkpoint-N/model.pth`` with the largest N (the authors' default step)."""
    steps = sorted((d for d in folder.glob("checkpoint-*") if d.name.split("-")[-1].isdigit()),
                   key=lambda d: int(d.name.split("-")[-1]))
    if not steps:
        raise UserError(f"videoalign checkpoint: no checkpoint-N folder in {str(folder)!r}")
    path = steps[-1] / "model.pth"
    if not path.is_file():
        raise UserError(f"videoalign checkpoint: no model.pth in {str(steps[-1])!r} (only full-model checkpoints "
                        "are read, not adapter_model.safetensors + non_lora_state_dict.pth)")
    return path


def lora_scale(peft: dict) -> float | None:
    """PEFT's LoRA scaling of the checkpoint: alpha / r (alpha / sqrt(r) with rsLoRA); None without LoRA."""
    if not peft.get("lora_enable"):
        return None
    r, alpha = float(peft["lora_r"]), float(peft["lora_alpha"])
    return alpha / math.sqrt(r) if peft.get("use_rslora") else alpha / r


class VideoAlignReward:
    """``reward(videos [B, F, 3, H, W] (or B tensors [F, 3, H, W]) in [0, 1], prompts [B]) -> [B]``.

    The score is the ``dimension`` option ("VQ", "MQ", "TA" or their sum "Overall", the default);
    components ``VQ``, ``MQ``, ``TA`` always. Options: ``checkpoint`` (the VideoReward folder; required),
    ``base_model`` (hub id or folder of Qwen2-VL's config and processor; default the checkpoint's
    ``model_name_or_path``), ``normalize`` (the checkpoint's mean / std standardisation, true),
    ``video_fps`` (frames per second of the videos handed over, 16), ``device``, ``dtype`` ("auto":
    bfloat16 on CUDA as the authors, float32 on CPU), ``batch_size`` (videos per forward).
    """

    name = "videoalign"
    takes_videos = True

    def __init__(self, checkpoint: str, dimension: str = "Overall", base_model: str | None = None,
                 normalize: bool = True, video_fps: float = 16.0, device: str | None = None, dtype: str = "auto",
                 batch_size: int = 2):
        self.dimension = check_choice("videoalign dimension", dimension, CHOICES)
        if not video_fps > 0:
            raise ConfigError(f"videoalign video_fps must be > 0; got {video_fps!r}")
        self.video_fps, self.normalize = float(video_fps), bool(normalize)
        self.device = resolve_device(device)
        self.batch_size = positive_int("videoalign batch_size", batch_size)
        folder = Path(checkpoint).expanduser()
        if not folder.is_dir():
            raise UserError(f"videoalign checkpoint: no such folder {str(folder)!r}")
        cfg = read_model_config(folder)
        self.data, self.stats = cfg["data_config"], cfg.get("inference_config") or {}
        what = "videoalign checkpoint"
        weights = latest_weights(folder)
        sd = convert_state_dict(load_state_dict_file(weights, what), lora_scale(cfg.get("peft_lora_config") or {}))
        base = base_model or cfg["model_config"].get("model_name_or_path") or "Qwen/Qwen2-VL-2B-Instruct"
        self.processor, self.token_ids = load_processor(base, REWARD_TOKENS, "videoalign base_model")
        out_dim = int(cfg["model_config"].get("output_dim", 1))
        model_dtype = resolve_dtype(dtype, self.device)
        self.model = build_model(load_qwen2vl_config(base, "videoalign base_model"),
                                 lambda hidden: nn.Linear(hidden, out_dim, bias=False), sd, weights, what,
                                 self.device, model_dtype)

    def texts(self, prompts: list[str]) -> list[str]:
        """The chat strings of one user turn each: the video, then the instruction for the prompt."""
        messages = [[{"role": "user", "content": [{"type": "video"}, {
            "type": "text", "text": PROMPT.replace("{text_prompt}", p)}]}] for p in prompts]
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def frames(self, video: Tensor) -> Tensor:
        """One video [F, 3, H, W] in [0, 1] -> the sampled, resized frames [n, 3, H', W']."""
        idx = sample_frames(video.shape[0], self.video_fps, self.data.get("fps"), self.data.get("num_frames"))
        return resize(video[idx], VIDEO_MIN_PIXELS, int(self.data["max_frame_pixels"]))

    def scores(self, logits: Tensor) -> dict[str, Tensor]:
        """Head outputs [b, 3, out] -> {"VQ", "MQ", "TA"} [b] (normalised when asked) and "Overall"."""
        per = logits.diagonal(dim1=1, dim2=2) if logits.shape[-1] == 3 else logits[..., 0]
        out = {}
        for j, dim in enumerate(DIMENSIONS):
            value = per[:, j].float()
            if self.normalize and self.stats:
                value = (value - float(self.stats[f"{dim}_mean"])) / float(self.stats[f"{dim}_std"])
            out[dim] = value
        out["Overall"] = out["VQ"] + out["MQ"] + out["TA"]
        return out

    @torch.no_grad()
    def __call__(self, videos, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        if isinstance(videos, Tensor) and videos.ndim != 5:
            raise ValueError(f"videoalign scores videos [B, F, 3, H, W]; got a tensor of shape {tuple(videos.shape)}")
        videos = list(videos)
        if any(v.ndim != 4 or v.shape[1] != 3 for v in videos):
            raise ValueError(f"videoalign scores videos [F, 3, H, W]; got {[tuple(v.shape) for v in videos]}")
        if len(prompts) != len(videos):
            raise ValueError(f"videoalign: {len(videos)} videos but {len(prompts)} prompts")
        parts: list[dict[str, Tensor]] = []
        for i in range(0, len(videos), self.batch_size):
            clips = [self.frames(v) for v in videos[i:i + self.batch_size]]
            batch = encode(self.processor, self.texts(list(prompts[i:i + self.batch_size])), self.device, videos=clips)
            parts.append({k: v.cpu() for k, v in self.scores(self.model(self.token_ids, **batch)).items()})
        if not parts:
            return RewardOutput(torch.zeros(0))
        merged = {k: torch.cat([p[k] for p in parts]) for k in CHOICES}
        return RewardOutput(merged[self.dimension], {k: merged[k] for k in DIMENSIONS})
