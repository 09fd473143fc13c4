"""Placing visual tokens into a language model's input embeddings.

An image enters the token sequence through a placeholder token id, and the
projector's output rows take the placeholders' places. Two conventions exist:

- **One placeholder per visual token** (Kimi-VL's): the processor has already
  repeated each image's ``<|media_pad|>`` (id 163605) ``h * w // 4`` times, so
  the sequence keeps its length and the visual rows simply overwrite the
  placeholders' embeddings. Use :func:`splice_visual_tokens`.
- **One placeholder per image** (LLaVA's ``<image>``): each placeholder stands
  for a whole image and is replaced by that image's n tokens, which lengthens
  the sequence. Use :func:`expand_visual_tokens`, which also returns the new
  attention mask, position ids and labels (``-100`` on visual tokens).

In both, images are taken in reading order: sequence 0's placeholders first,
left to right, then sequence 1's, and so on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from moonvit.model.grid import tokens_per_image

MEDIA_PAD_TOKEN_ID = 163605
IGNORE_INDEX = -100


# LLM tokens of each image: :func:`moonvit.tokens_per_image` under the projector's name.
visual_token_counts = tokens_per_image


def splice_visual_tokens(
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor,
    image_features: torch.Tensor | Sequence[torch.Tensor],
    placeholder_token_id: int = MEDIA_PAD_TOKEN_ID,
) -> torch.Tensor:
    """Overwrite the embeddings of placeholder tokens with visual tokens, one for one.

    For input ids that hold one placeholder per visual token (Kimi-VL's processor
    output). The sequence length, attention mask and position ids are unchanged;
    for a loss on text only, set the placeholders' labels to -100
    (``labels.masked_fill(input_ids == placeholder_token_id, IGNORE_INDEX)``).
    Differentiable with respect to ``inputs_embeds`` and the features.

    Args:
        input_ids: (B, T) integer token ids.
        inputs_embeds: (B, T, H) floating, the LLM's embeddings of ``input_ids``.
        image_features: (N_tokens, H) all images' visual tokens, packed in order,
            or a sequence of (n_i, H) per image; with a sequence, every image must
            fall within one sequence of the batch.
        placeholder_token_id: the id that marks a visual token.

    Returns:
        (B, T, H) in ``inputs_embeds``' dtype: the placeholders' rows replaced by
        the features (cast to that dtype), every other row unchanged.

    Raises:
        ValueError: the placeholder count differs from the number of visual
            tokens, or an image would straddle two sequences (counts named).
    """
    _check_ids_and_embeds(input_ids, inputs_embeds)
    if isinstance(image_features, torch.Tensor):
        per_image = None
        _check_features(image_features, "image_features", inputs_embeds)
        features = image_features
    else:
        per_image = list(image_features)
        for i, f in enumerate(per_image):
            _check_features(f, f"image_features[{i}]", inputs_embeds)
        features = _concat(per_image, inputs_embeds)

    is_visual = input_ids == placeholder_token_id
    per_sequence = is_visual.sum(dim=1).tolist()
    if sum(per_sequence) != features.shape[0]:
        raise ValueError(
            f"input_ids hold {sum(per_sequence)} placeholder tokens {placeholder_token_id} "
            f"(per sequence: {per_sequence}) but the images give {features.shape[0]} visual tokens"
            + ("" if per_image is None else f" (per image: {[f.shape[0] for f in per_image]})")
        )
    if per_image is not None:
        _check_images_fit_sequences(per_sequence, [f.shape[0] for f in per_image])
    return inputs_embeds.masked_scatter(is_visual.unsqueeze(-1), features.to(inputs_embeds.dtype))


@dataclass(frozen=True)
class ExpandedInputs:
    """A batch with every image placeholder expanded into its visual tokens.

    Attributes:
        inputs_embeds: (B, T', H) the LLM's input embeddings; padding rows are zero.
        attention_mask: (B, T') int64, 1 on text and visual tokens, 0 on padding.
        position_ids: (B, T') int64, 0, 1, 2, ... over each sequence's tokens,
            0 on padding (so left padding does not shift the positions).
        labels: (B, T') int64, the given labels on text tokens and -100 on visual
            tokens and padding; None when no labels were given.
    """

    inputs_embeds: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor | None = None

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The keyword arguments of a transformers causal LM's forward (labels only when set)."""
        out = {
            "inputs_embeds": self.inputs_embeds,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }
        if self.labels is not None:
            out["labels"] = self.labels
        return out


def expand_visual_tokens(
    input_ids: torch.Tensor,
    inputs_embeds: torch.Tensor,
    image_features: Sequence[torch.Tensor],
    placeholder_token_id: int,
    *,
    attention_mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
    padding_side: str = "right",
) -> ExpandedInputs:
    """Replace each image's single placeholder by all of that image's visual tokens.

    For input ids that hold one placeholder per image. Sequences grow by
    n_i - 1 tokens per image, so the batch is re-padded: the tokens under
    ``attention_mask`` (all, when it is None) are kept in order, expanded, and
    padded to the longest result on ``padding_side``. Differentiable with
    respect to ``inputs_embeds`` and the features.

    Args:
        input_ids: (B, T) integer token ids.
        inputs_embeds: (B, T, H) floating, the LLM's embeddings of ``input_ids``.
        image_features: one (n_i, H) tensor per image, in reading order.
        placeholder_token_id: the id that marks an image.
        attention_mask: (B, T), nonzero on real tokens; placeholders under padding
            are dropped with it.
        labels: (B, T) integer targets, e.g. the caption's ids and -100 elsewhere.
        padding_side: ``"right"`` (training) or ``"left"`` (batched generation).

    Raises:
        ValueError: the number of placeholders differs from the number of images
            (counts per sequence named), or shapes do not match.
    """
    _check_ids_and_embeds(input_ids, inputs_embeds)
    features = list(image_features)
    for i, f in enumerate(features):
        _check_features(f, f"image_features[{i}]", inputs_embeds)
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    for name, tensor in (("attention_mask", attention_mask), ("labels", labels)):
        if tensor is not None and tensor.shape != input_ids.shape:
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got {tuple(tensor.shape)}")

    kept = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    is_visual = (input_ids == placeholder_token_id) & kept
    per_sequence = is_visual.sum(dim=1).tolist()
    if sum(per_sequence) != len(features):
        raise ValueError(
            f"input_ids hold {sum(per_sequence)} image placeholders {placeholder_token_id} "
            f"(per sequence: {per_sequence}) but {len(features)} images were given"
        )

    # Each kept token becomes `repeats` tokens: 1 for text, n_i for image i, 0 for padding.
    repeats = kept.long()
    repeats[is_visual] = torch.tensor([f.shape[0] for f in features], dtype=torch.long, device=input_ids.device)
    source, position, place = _expansion(repeats, padding_side)
    from_image = is_visual.flatten()[source]

    embeds = inputs_embeds.flatten(0, 1)[source]
    embeds = embeds.masked_scatter(from_image.unsqueeze(-1), _concat(features, inputs_embeds).to(embeds.dtype))
    new_labels = None
    if labels is not None:
        new_labels = place(labels.flatten()[source].masked_fill(from_image, IGNORE_INDEX), IGNORE_INDEX)
    return ExpandedInputs(
        inputs_embeds=place(embeds, 0),
        attention_mask=place(torch.ones_like(position), 0),
        position_ids=place(position, 0),
        labels=new_labels,
    )


def _expansion(
    repeats: torch.Tensor, padding_side: str
) -> tuple[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, int], torch.Tensor]]:
    """Index maps of a batch whose token (b, t) is repeated ``repeats[b, t]`` times.

    Args:
        repeats: (B, T) int64, copies of each token (0 drops it).
        padding_side: where the shorter results are padded.

    Returns:
        source: (M,) int64, the flat (b * T + t) index of each of the M new tokens,
            sequence after sequence.
        position: (M,) int64, each new token's position within its sequence.
        place: ``place(values, fill)`` scatters (M, ...) values into a padded
            (B, T', ...) tensor filled with ``fill``, T' the longest new sequence.
    """
    batch, length = repeats.shape
    lengths = repeats.sum(dim=1)  # (B,)
    source = torch.repeat_interleave(torch.arange(batch * length, device=repeats.device), repeats.flatten())
    row = source // length
    position = torch.arange(source.numel(), device=repeats.device) - (lengths.cumsum(0) - lengths)[row]
    new_length = int(lengths.max())
    column = position + (new_length - lengths)[row] if padding_side == "left" else position

    def place(values: torch.Tensor, fill: int) -> torch.Tensor:
        padded = values.new_full((batch, new_length, *values.shape[1:]), fill)
        return padded.index_put((row, column), values)

    return source, position, place


def _check_ids_and_embeds(input_ids: torch.Tensor, inputs_embeds: torch.Tensor) -> None:
    if input_ids.ndim != 2 or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be (B, T) integer, got {tuple(input_ids.shape)} {input_ids.dtype}")
    if inputs_embeds.ndim != 3 or inputs_embeds.shape[:2] != input_ids.shape:
        raise ValueError(
            f"inputs_embeds must be (B, T, H) with (B, T) = {tuple(input_ids.shape)}, got {tuple(inputs_embeds.shape)}"
        )
    if inputs_embeds.device != input_ids.device:
        raise ValueError(f"input_ids are on {input_ids.device}, inputs_embeds on {inputs_embeds.device}")


def _check_features(features: torch.Tensor, name: str, inputs_embeds: torch.Tensor) -> None:
    hidden = inputs_embeds.shape[-1]
    if features.ndim != 2 or features.shape[-1] != hidden or not features.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be floating (n, {hidden}) to match inputs_embeds, "
            f"got {tuple(features.shape)} {features.dtype}"
        )
    if features.device != inputs_embeds.device:
        raise ValueError(f"{name} is on {features.device}, inputs_embeds on {inputs_embeds.device}")


def _concat(features: Sequence[torch.Tensor], inputs_embeds: torch.Tensor) -> torch.Tensor:
    """(sum n_i, H): the features one after another (an empty (0, H) for no images)."""
    if not features:
        return inputs_embeds.new_empty(0, inputs_embeds.shape[-1])
    return torch.cat(list(features))


def _check_images_fit_sequences(per_sequence: list[int], per_image: list[int]) -> None:
    """Every sequence's placeholder count must be a sum of whole images' token counts, in order."""
    image_ends = set(accumulate(per_image))
    if not set(accumulate(per_sequence)) <= image_ends | {0}:
        raise ValueError(
            f"an image would straddle two sequences: placeholder tokens per sequence {per_sequence}, "
            f"visual tokens per image {per_image}"
        )
