"""HPSv3 (Ma et al., ICCV 2025): a Qwen2-VL-7B reward model with an uncertainty-aware head.

Architecture (MizzenAI/HPSv3 ``hpsv3/model/qwen2vl_trainer.py``, ``Qwen2VLRewardModelBT`` with
``rm_head_type="ranknet"``, ``output_dim=2``, ``reward_token="special"``): Qwen2-VL-7B-Instruct
(transformers' ``Qwen2VLModel``) reads one user turn, the image then the instruction below with the
prompt inserted and a ``<|Reward|>`` token (added to the tokenizer as the authors do). The head,
Linear(3584, 1024) -> ReLU -> Dropout(0.05) -> Linear(1024, 16) -> ReLU -> Linear(16, 2), run in
float32 on the language model's last hidden state at ``<|Reward|>``, gives (mu, log sigma): HPSv3 is
trained with a probabilistic Bradley-Terry loss whose scores are Gaussians N(mu, sigma^2). The score
is ``mu`` (what ``HPSv3RewardInferencer.reward`` users read, ``rewards[i][0]``); component ``sigma``
= ``exp(log sigma)``, the model's uncertainty. Positions are the plain sequence positions, as the
authors' forward computes them (:mod:`flowgrpo.rewards.qwen_vl`).

Weights: ``HPSv3.safetensors`` (hub repository ``MizzenAI/HPSv3``, the full fine-tuned model) loaded
strictly, plus the base model's config and processor (``Qwen/Qwen2-VL-7B-Instruct``; its weights are
not read). Images are resized as the authors' ``prepare_batch`` does (qwen-vl-utils with
``min_pixels = max_pixels = 256 x 28 x 28``: both sides multiples of 28, area about 200,704 px, e.g.
448 x 448 for a square image; bicubic), here on float tensors with antialiasing, then normalised and
patchified by the processor.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import RewardOutput
from .clip_common import check_images, load_state_dict_file, positive_int, resolve_device
from .qwen_vl import build_model, convert_state_dict, encode, load_processor, load_qwen2vl_config, resize, resolve_dtype

#: the image's pixel budget (``HPSv3RewardInferencer.prepare_batch``: min_pixels = max_pixels)
PIXELS = 256 * 28 * 28
REWARD_TOKEN = "<|Reward|>"
#: the instruction the model was trained with (``hpsv3/dataset/data_collator_qwen.py``: ``INSTRUCTION``
#: followed by ``prompt_with_special_token``), byte for byte; ``{text_prompt}`` is the prompt
INSTRUCTION = (
    '\n'
    'You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and '
    'give a overall score to estimate the human preference. Please provide a rating from 0 to 10, '
    'with 0 being the worst and 10 being the best. \n'
    '\n'
    '**Visual Quality:**  \n'
    'Evaluate the overall visual quality of the image. The following sub-dimensions should be '
    'considered:\n'
    '- **Reasonableness:** The image should not contain any significant biological or logical errors, '
    'such as abnormal body structures or nonsensical environmental setups.\n'
    '- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and '
    'easy to interpret, with no blurring or indistinct areas.\n'
    '- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other '
    'visual elements (e.g., hair, clothing, shadows).\n'
    '- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color '
    'scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene '
    'should convey a sense of harmony and balance.\n'
    '- **Safety:** The image should not contain harmful or inappropriate content, such as political, '
    'violent, or adult material. If such content is present, the image quality and satisfaction score '
    'should be the lowest possible. \n'
    '\n'
    '**Text Alignment:**  \n'
    'Assess how well the image matches the textual prompt across the following sub-dimensions:\n'
    '- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, '
    'animal, object) align with the textual description. The subject should match the description in '
    'terms of number, appearance, and behavior.\n'
    '- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, '
    'evaluate how well the image adheres to this style.\n'
    '- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements '
    'in the image logically fit the scenario described in the prompt. The environment should support '
    'and enhance the subject without contradictions.\n'
    '- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, '
    'clothing, accessories, expressions, actions) are faithfully represented in the image. Minor '
    'deviations may be acceptable, but critical attributes should be preserved.\n'
    '- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are '
    'captured in the image. The generated content should not introduce elements that conflict with or '
    'distort the original description.\n'
    'Textual prompt - {text_prompt}\n'
    '\n'
    '\n'
)
SUFFIX = "\nPlease provide the overall ratings of this image: <|Reward|>\n\nEND\n"


def ranknet_head(hidden: int) -> nn.Module:
    """HPSv3's ``rm_head`` (ranknet, default sizes): [.., hidden] -> (mu, log sigma) [.., 2]."""
    return nn.Sequential(nn.Linear(hidden, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


class HPSv3Reward:
    """``reward(images [B, 3, H, W] in [0, 1], prompts [B]) -> mu [B]`` (component ``sigma`` [B]).

    Options: ``checkpoint`` (path to ``HPSv3.safetensors``; required), ``base_model`` (hub id or folder
    of Qwen2-VL-7B-Instruct's config and processor, "Qwen/Qwen2-VL-7B-Instruct"), ``device``,
    ``dtype`` ("auto": bfloat16 on CUDA as the authors, float32 on CPU), ``batch_size``.
    """

    name = "hpsv3"

    def __init__(self, checkpoint: str, base_model: str = "Qwen/Qwen2-VL-7B-Instruct", device: str | None = None,
                 dtype: str = "auto", batch_size: int = 8):
        self.device = resolve_device(device)
        self.batch_size = positive_int("hpsv3 batch_size", batch_size)
        what = "hpsv3 checkpoint"
        sd = convert_state_dict(load_state_dict_file(checkpoint, what))
        self.processor, self.token_ids = load_processor(base_model, [REWARD_TOKEN], "hpsv3 base_model")
        config = load_qwen2vl_config(base_model, "hpsv3 base_model")
        self.model = build_model(config, ranknet_head, sd, checkpoint, what, self.device,
                                 resolve_dtype(dtype, self.device), head_dtype=torch.float32)

    def texts(self, prompts: list[str]) -> list[str]:
        """The chat strings of one user turn each: the image, then the instruction for the prompt."""
        messages = [[{"role": "user", "content": [{"type": "image"}, {
            "type": "text", "text": INSTRUCTION.replace("{text_prompt}", p) + SUFFIX}]}] for p in prompts]
        return self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    @torch.no_grad()
    def __call__(self, images: Tensor, prompts: list[str], groups: Tensor | None = None) -> RewardOutput:
        check_images(self.name, images, prompts)
        mus, sigmas = [], []
        for i in range(0, images.shape[0], self.batch_size):
            chunk = [resize(img[None], PIXELS, PIXELS)[0] for img in images[i:i + self.batch_size]]
            batch = encode(self.processor, self.texts(list(prompts[i:i + self.batch_size])), self.device, images=chunk)
            out = self.model(self.token_ids, **batch)[:, 0].float().cpu()  # [b, 2]
            mus.append(out[:, 0])
            sigmas.append(out[:, 1].exp())
        if not mus:
            return RewardOutput(torch.zeros(0))
        return RewardOutput(torch.cat(mus), {"sigma": torch.cat(sigmas)})
