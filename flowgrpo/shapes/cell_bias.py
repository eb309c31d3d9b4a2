"""A learned attention bias between grid cells by their offset (row and column difference).

Why: the shapes world's position prompts need the second object placed *given* the first (B in a
column right of A's, never in it). With only an additive position code, a head that wants "the cells
in my column" or "the cells left of me" has to build that comparison out of content-mixed queries
and keys; the shipped 6-block model never quite does, and draws A and B in one column about 1 time
in 10 even when trained on clean position scenes alone (docs/shapes_world.md). A bias per head and
per offset (Swin's relative position bias, T5's relative attention) makes each of those a single
learned number. It is zero at initialisation, so a model built with it starts as the model without.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def cell_offsets(grid: int) -> Tensor:
    """Index [grid^2, grid^2] (row-major cells) of each query/key cell pair's offset into a
    (2 grid - 1) x (2 grid - 1) table: (row_q - row_k + grid - 1) * (2 grid - 1) + (col_q - col_k + grid - 1)."""
    rows = torch.arange(grid).repeat_interleave(grid)
    cols = torch.arange(grid).repeat(grid)
    span = 2 * grid - 1
    return (rows[:, None] - rows[None, :] + grid - 1) * span + (cols[:, None] - cols[None, :] + grid - 1)


class CellOffsetAttnProcessor(nn.Module):
    """SD3 joint attention (image tokens first, then text tokens) with a learned bias [heads, (2g-1)^2]
    added to the logits of every image-to-image pair by its cell offset; pairs involving text get none.

    A drop-in for diffusers' joint processor on one :class:`~diffusers.models.attention_processor.Attention`
    (same projections, norms and output layers, so LoRA on ``to_q`` ... ``to_add_out`` applies unchanged).
    As an ``nn.Module`` it is a child of its attention layer: the table is saved, loaded and trained with
    the transformer (``transformer_blocks.i.attn.processor.offset_bias``)."""

    def __init__(self, heads: int, grid: int):
        super().__init__()
        self.grid = grid
        self.offset_bias = nn.Parameter(torch.zeros(heads, (2 * grid - 1) ** 2))
        self.register_buffer("offsets", cell_offsets(grid), persistent=False)

    def image_bias(self) -> Tensor:
        """The bias [heads, grid^2, grid^2] between image tokens (query cell, key cell)."""
        return self.offset_bias[:, self.offsets]

    def __call__(self, attn, hidden_states: Tensor, encoder_hidden_states: Tensor | None = None,
                 attention_mask: Tensor | None = None, *args, **kwargs):
        b, n_img, _ = hidden_states.shape
        if n_img != self.grid * self.grid:
            raise ValueError(f"CellOffsetAttnProcessor was built for {self.grid}x{self.grid} = {self.grid ** 2} "
                             f"image tokens, got {n_img}")

        def heads(x: Tensor) -> Tensor:  # [B, N, H*D] -> [B, H, N, D]
            return x.view(b, x.shape[1], attn.heads, -1).transpose(1, 2)

        q, k, v = heads(attn.to_q(hidden_states)), heads(attn.to_k(hidden_states)), heads(attn.to_v(hidden_states))
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        n_txt = 0
        if encoder_hidden_states is not None:
            n_txt = encoder_hidden_states.shape[1]
            cq = heads(attn.add_q_proj(encoder_hidden_states))
            ck = heads(attn.add_k_proj(encoder_hidden_states))
            cv = heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                cq = attn.norm_added_q(cq)
            if attn.norm_added_k is not None:
                ck = attn.norm_added_k(ck)
            q, k, v = torch.cat([q, cq], 2), torch.cat([k, ck], 2), torch.cat([v, cv], 2)
        bias = F.pad(self.image_bias(), (0, n_txt, 0, n_txt)).to(q.dtype)  # text rows and columns: 0
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None], dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(b, -1, attn.heads * out.shape[-1]).to(q.dtype)
        img = attn.to_out[1](attn.to_out[0](out[:, :n_img]))
        if encoder_hidden_states is None:
            return img
        ctx = out[:, n_img:]
        if not attn.context_pre_only:
            ctx = attn.to_add_out(ctx)
        return img, ctx


def install_cell_offset_bias(transformer: nn.Module, grid: int) -> int:
    """Give every joint attention layer of an SD3 ``transformer`` a :class:`CellOffsetAttnProcessor`
    (zero bias). Returns how many layers got one."""
    from diffusers.models.attention_processor import Attention

    n = 0
    for block in transformer.transformer_blocks:
        attn = block.attn
        if isinstance(attn, Attention):
            attn.set_processor(CellOffsetAttnProcessor(attn.heads, grid))
            n += 1
    return n
