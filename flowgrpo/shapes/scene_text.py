"""Structured prompt conditioning of the shapes model: one token per object group and one for the relation.

The shapes grammar is closed and every prompt parses back into its :class:`SceneSpec`
(:func:`~flowgrpo.shapes.prompts.parse_prompt`). The word-level encoder that came before it was a bag
of words in practice (position embeddings 1/15 of the word embeddings' scale, a mean-pooled vector), so
"A left of B" and "B left of A", or "red circle and blue square" and "blue circle and red square",
conditioned the model identically and no RL could steer order or binding (issue 29). This encoder
builds the conditioning from the parse instead:

* **Slot tokens.** Token 0 is the *subject* group (the first one named), token 1 the *object* group
  (the second, or an empty slot), token 2 the relation ("left of" ... or none). A group token is the
  sum of field embeddings: its role, its count, its colour ("any" when the prompt leaves it free) and
  its shape. Colour and shape meet in one token, so binding is explicit; the count is its own field,
  shared by every noun, so "four yellow triangles" is an interpolation of what "four" and "yellow
  triangle" mean elsewhere even when that combination was never a caption.
* **Field embeddings at one scale.** Every table is an ``nn.Embedding`` (unit-variance init), the
  role included, so the role is as loud as the words (the old position embeddings were at 0.02).
* **Contextualised, order-keeping.** A small Transformer encoder lets the relation token read the two
  groups; ``pooled`` is a linear map of the *concatenated* slot states, so swapping the groups changes
  it (a mean would not).
* **Each group knows its side of the relation.** A group token's relation field holds the relation
  as seen from that group: the subject of "A left of B" carries "left of", the object carries "right
  of". Without it the image side has to combine three things at once (a cell's position, the
  relation token, which group is the subject), and the MMDiT did not learn it: trained on perfect
  position captions, its x0 prediction at sigma = 0.98 stayed the same in every column after 500
  steps, the relation held in 0.35-0.40 of samples (chance 0.40), and random, near-orthogonal patch
  position codes changed nothing. With the side in the group token, "which cells does this group
  go to" is one query-key match, and the same probe showed the left/right column skew after 500
  steps (docs/shapes_world.md). ``group_relation=False`` reads prompts as the first scene weights did.
* **Count tokens (``count_tokens=True``).** Two more slots, one per group, hold that group's count
  alone (role "subject count" / "object count" + the count field), and the group tokens leave their
  count field null. The frozen encoder keeps the count a direction of its own either way, but the
  MMDiT runs every text token through its own MLP block after block, where a count summed into the
  colour-shape token comes out entangled with them (measured:
  ``benchmarks/experiments/counting/count_directions.py``); in a token of its own only attention
  can combine it with the glyph. Weights without the key load with False.
* The empty prompt (classifier-free guidance's unconditional branch) is the all-null slot layout.

``SceneTokenizer(prompts)`` -> ``ids [B, S, 5]`` long (per slot: role, count, colour, shape,
relation; 0 = null; S = 3, or 5 with count tokens); ``SceneTextEncoder(ids)`` -> ``(hidden [B, S,
text_dim], pooled [B, text_dim])``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import UserError
from .prompts import parse_prompt
from .world import COLORS, FLIPPED, NUMBERS, RELATIONS, SHAPES, VOCAB

#: slot roles (index 0 = the null slot of an empty prompt); the last two only with count tokens, so
#: that weights without them keep their 5-row role table
ROLES = ("<null>", "subject", "object", "relation", "<none>", "subject count", "object count")
COUNT_ROLES = 2
COUNTS = ("<none>", "1", *map(str, NUMBERS))
COLOUR_FIELD = ("<none>", "any", *COLORS)
SHAPE_FIELD = ("<none>", *SHAPES)
RELATION_FIELD = ("<none>", "<no relation>", *RELATIONS)
FIELDS = (ROLES, COUNTS, COLOUR_FIELD, SHAPE_FIELD, RELATION_FIELD)
NUM_SLOTS = 3  # without count tokens


def num_slots(count_tokens: bool) -> int:
    """Tokens per prompt: two groups and the relation, plus a count token per group when asked."""
    return NUM_SLOTS + (2 if count_tokens else 0)


class VocabularyError(UserError, ValueError):
    """A prompt the shapes-world model cannot represent (one line on the command line)."""


def prompt_words(prompt: str) -> list[str]:
    """The words of ``prompt`` (lower case, commas as spaces); :class:`VocabularyError` naming the
    words outside the closed vocabulary, with the valid ones."""
    words = prompt.lower().replace(",", " ").split()
    bad = [w for w in words if w not in VOCAB[3:]]
    if bad:
        raise VocabularyError(f"prompt {prompt!r} uses words outside the shapes-world vocabulary: {bad}; "
                              f"valid words: {', '.join(VOCAB[3:])}")
    return words


class SceneVocabularyError(VocabularyError):
    """A prompt in the vocabulary that the shapes grammar cannot parse."""


class SceneTokenizer:
    """Prompts -> slot field ids ``[B, S, 5]`` long (role, count, colour, shape, relation; 0 = null).

    ``count_tokens``: a count token per group after the relation (S = 5), the group tokens' count
    field left null; False: S = 3, the count in the group token. ``group_relation``: the group slots
    carry the relation from their own side (the subject the prompt's relation, the object its
    opposite); False leaves their relation field null, as the first scene weights were trained.
    ``""`` (the unconditional prompt) gives the all-null layout. A prompt outside the grammar raises
    :class:`SceneVocabularyError` with the parser's reason and the vocabulary."""

    def __init__(self, group_relation: bool = True, count_tokens: bool = False):
        self.group_relation = group_relation
        self.count_tokens = count_tokens

    def __call__(self, prompts: list[str]) -> Tensor:
        return torch.tensor([self.slots(p, self.group_relation, self.count_tokens) for p in prompts],
                            dtype=torch.long).view(len(prompts), num_slots(self.count_tokens), len(FIELDS))

    @staticmethod
    def slots(prompt: str, group_relation: bool = True, count_tokens: bool = False) -> list[list[int]]:
        """The [S][5] field ids of one prompt (S = :func:`num_slots`)."""
        if not prompt.strip():
            return [[0] * len(FIELDS) for _ in range(num_slots(count_tokens))]
        try:
            spec = parse_prompt(" ".join(prompt_words(prompt)))
        except VocabularyError:
            raise
        except ValueError as exc:
            raise SceneVocabularyError(f"{exc}; the scene encoder reads prompts of the shapes grammar only "
                                       "(docs/shapes_world.md)") from None
        # the relation from each group's side: A is "left of" B exactly when B is "right of" A
        sides = (spec.relation, FLIPPED[spec.relation]) if (spec.relation and group_relation) else (None, None)
        rows, counts = [], []
        for i in range(2):
            if i < len(spec.objects):
                o = spec.objects[i]
                count = COUNTS.index(str(o.count))
                rows.append([ROLES.index("subject" if i == 0 else "object"), 0 if count_tokens else count,
                             COLOUR_FIELD.index(o.color or "any"), SHAPE_FIELD.index(o.shape),
                             RELATION_FIELD.index(sides[i]) if sides[i] else 0])
                counts.append([ROLES.index("subject count" if i == 0 else "object count"), count, 0, 0, 0])
            else:
                rows.append([ROLES.index("<none>"), 0, 0, 0, 0])
                counts.append([ROLES.index("<none>"), 0, 0, 0, 0])
        rel = RELATION_FIELD.index(spec.relation) if spec.relation else RELATION_FIELD.index("<no relation>")
        rows.append([ROLES.index("relation"), 0, 0, 0, rel])
        return rows + counts if count_tokens else rows

    @staticmethod
    def labels(prompt: str, count_tokens: bool = False) -> list[str]:
        """The kind of each slot ("<group>", "<none>", "<relation>", "<count>"): the probe
        (:func:`flowgrpo.shapes.probe.pair_sensitivity`) matches tokens within a kind, so two group
        tokens count as the same only if they match in either order (the MMDiT's joint attention gives
        text tokens no position: a permutation of them is invisible to it)."""
        if not prompt.strip():
            return ["<null>"] * num_slots(count_tokens)
        n = len(parse_prompt(prompt.replace(",", " ")).objects)
        groups = ["<group>"] * n + ["<none>"] * (2 - n)
        return groups + ["<relation>"] + ([g.replace("group", "count") for g in groups] if count_tokens else [])


class SceneTextEncoder(nn.Module):
    """Field embeddings -> per-slot MLP -> ``layers`` Transformer layers; pooled = Linear(concat(slots)).

    ``forward(ids [B, S, 5])`` -> ``(hidden [B, S, dim], pooled [B, dim])``; S = ``num_slots(count_tokens)``."""

    def __init__(self, dim: int, layers: int = 2, heads: int = 4, count_tokens: bool = False):
        super().__init__()
        roles = len(ROLES) - (0 if count_tokens else COUNT_ROLES)
        self.fields = nn.ModuleList(nn.Embedding(n, dim) for n in (roles, *map(len, FIELDS[1:])))
        self.mix = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=heads, dim_feedforward=2 * dim, batch_first=True,
                                           norm_first=True, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.pool = nn.Linear(num_slots(count_tokens) * dim, dim)

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        h = sum(emb(ids[..., k]) for k, emb in enumerate(self.fields))  # [B, S, dim]
        h = h + self.mix(h)  # nonlinear within a slot: colour x shape x count, before slots exchange anything
        h = self.norm(self.encoder(h))
        return h, self.pool(h.flatten(1))

    @property
    def device(self) -> torch.device:
        return self.pool.weight.device
