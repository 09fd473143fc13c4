"""The text around visual tokens in the prompts of the families the package loads.

Kimi-K2.5 / K2.6: each image or video chunk enters the prompt as its media markers
around one ``<|media_pad|>``, which the processor side expands to the item's
h * w / 4 visual tokens (see :func:`expand_media_pads`); a video chunk is preceded
by its timestamp, ``HH:MM:SS.fff``, the time of its first sampled frame.

Kimi K3: the same markers, an image's carrying its original size in pixels,
``<|media_begin|>image {w}x{h}<|media_content|><|media_pad|><|media_end|>``
(see :func:`k3_image_prompt`; :func:`k3_media_prompts` reads the sizes from an
export's manifest).

NVIDIA LocateAnything-3B: each image is the text label ``<image N>``, then ``<img>`` +
``<IMG_CONTEXT>`` x n + ``</img>`` (n its visual tokens; ids 151666, 151665, 151667), written
where the user's text says ``<image-N>`` (N counted from 1 within the prompt; see
:func:`locateanything_prompt`). That is the form of the release's own processor, which the model
was trained with; vLLM's port leaves the label out (``style="vllm"``). The label is plain text to
the tokenizer, so the ``<IMG_CONTEXT>`` rows are still replaced one for one by
:func:`~projector.splice.splice_visual_tokens` with ``placeholder_token_id=IMG_CONTEXT_TOKEN_ID``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import torch

from moonvit.media.video import format_timestamp
from moonvit.model.grid import GridInput, tokens_per_image

__all__ = [
    "IMG_CONTEXT",
    "IMG_CONTEXT_TOKEN_ID",
    "IMG_END",
    "IMG_END_TOKEN_ID",
    "IMG_START",
    "IMG_START_TOKEN_ID",
    "LOCATEANYTHING_STYLES",
    "MEDIA_PAD",
    "expand_media_pads",
    "k3_image_prompt",
    "k3_media_prompts",
    "locateanything_image_ids",
    "locateanything_prompt",
    "media_prompt",
    "video_prompt",
]

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_PAD, MEDIA_END = (
    "<|media_begin|>",
    "<|media_content|>",
    "<|media_pad|>",
    "<|media_end|>",
)


def media_prompt(kind: str = "image", timestamp: float | None = None) -> str:
    """One item's markers: ``<|media_begin|>{kind}<|media_content|><|media_pad|><|media_end|>``,
    preceded by ``HH:MM:SS.fff`` for a video chunk (give its ``timestamp`` in seconds)."""
    if kind not in ("image", "video"):
        raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
    stamp = "" if timestamp is None else format_timestamp(timestamp)
    return f"{stamp}{MEDIA_BEGIN}{kind}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def video_prompt(timestamps: Sequence[float]) -> str:
    """A video's chunks, one after the other, each with its timestamp (``VideoBatch.timestamps``)."""
    return "".join(media_prompt("video", t) for t in timestamps)


def expand_media_pads(text: str, grid: GridInput, merge_kernel_size: Sequence[int] = (2, 2)) -> str:
    """Repeat the i-th ``<|media_pad|>`` of ``text`` as many times as item i has visual tokens
    (h * w / 4 for an image or a chunk of any number of frames), as the processor side does
    before tokenising.

    Raises:
        ValueError: the text's placeholders and the grid's items differ in number.
    """
    counts = tokens_per_image(torch.as_tensor(grid), merge_kernel_size)
    pieces = text.split(MEDIA_PAD)
    if len(pieces) - 1 != len(counts):
        raise ValueError(f"the text holds {len(pieces) - 1} {MEDIA_PAD} placeholders for {len(counts)} items")
    out = [pieces[0]]
    for count, piece in zip(counts, pieces[1:]):
        out += [MEDIA_PAD * count, piece]
    return "".join(out)


# ---- Kimi K3 -------------------------------------------------------------------------------------


def k3_image_prompt(width: int, height: int) -> str:
    """Kimi K3's markers for one image: ``<|media_begin|>image {width}x{height}<|media_content|>
    <|media_pad|><|media_end|>`` (no spaces), where ``width`` x ``height`` is the image's original
    size in pixels as uploaded (after EXIF orientation), not its resized or padded size nor its grid.

    Raises:
        ValueError: a size that is not two positive ints.
    """
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"an image's {name} must be a positive int (pixels), got {value!r}")
    return f"{MEDIA_BEGIN}image {width}x{height}{MEDIA_CONTENT}{MEDIA_PAD}{MEDIA_END}"


def k3_media_prompts(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Each item's markers in Kimi K3's prompt, from ``moonvit_projector.export``'s ``manifest.jsonl`` records
    (``VisualTokenDataset(folder).records``), in their order.

    An image's are :func:`k3_image_prompt` of its ``size`` (the export records the size the
    processor read, before any resize). A video chunk's (a record with ``video_id``) are K2.5's,
    its timestamp first (:func:`media_prompt`): K3's release describes video but publishes no
    other form for it. Each ``<|media_pad|>`` then expands to the item's ``num_tokens`` rows
    (:func:`expand_media_pads` with the records' grids).

    Raises:
        ValueError: an image record without a ``size`` (the record's id named).
    """
    prompts = []
    for record in records:
        if "video_id" in record:
            prompts.append(media_prompt("video", record["timestamp"]))
            continue
        size = record.get("size")
        if not isinstance(size, Sequence) or len(size) != 2:
            raise ValueError(f"manifest record {record.get('id')!r} has no size [width, height]: {size!r}")
        prompts.append(k3_image_prompt(*size))
    return prompts


# ---- LocateAnything-3B --------------------------------------------------------------------------

IMG_START, IMG_CONTEXT, IMG_END = "<img>", "<IMG_CONTEXT>", "</img>"
IMG_START_TOKEN_ID, IMG_CONTEXT_TOKEN_ID, IMG_END_TOKEN_ID = 151666, 151665, 151667
"""LocateAnything-3B's image markers in its Qwen2.5 vocabulary (``image_token_index`` is 151665)."""
_IMAGE_REF = re.compile(r"<image-(\d+)>")

LocateAnythingStyle = Literal["release", "vllm"]
LOCATEANYTHING_STYLES: tuple[LocateAnythingStyle, ...] = ("release", "vllm")
"""The forms of an image in a LocateAnything-3B prompt, by the upstream each follows:

- ``"release"``: NVIDIA's own ``LocateAnythingProcessor.replace_media_placeholder`` (the release's
  ``processing_locateanything.py``), ``<image N><img><IMG_CONTEXT>...</img>``: the form the model
  was trained with, and the default.
- ``"vllm"``: vLLM's port (``locate_anything.py``), ``<img><IMG_CONTEXT>...</img>`` without the label.
"""


def _locateanything_image(number: int, num_tokens: int, style: LocateAnythingStyle) -> str:
    """Image ``number``'s text (1-based within its prompt) with ``num_tokens`` context tokens."""
    markers = IMG_START + IMG_CONTEXT * num_tokens + IMG_END
    # The release labels each image with the number the user's text gave it (``idx_in_list + 1``).
    return f"<image {number}>{markers}" if style == "release" else markers


def locateanything_prompt(
    text: str,
    grid: GridInput,
    merge_kernel_size: Sequence[int] = (2, 2),
    *,
    style: LocateAnythingStyle = "release",
) -> str:
    """Replace each ``<image-N>`` of ``text`` with image N's text: by default (``style="release"``, the
    form of NVIDIA's processor, which the model was trained with) the label ``<image N>``, then
    ``<img>``, ``<IMG_CONTEXT>`` once per visual token (h * w / 4, see :func:`~moonvit.tokens_per_image`),
    ``</img>``; ``style="vllm"`` (vLLM's port) leaves the label out (see :data:`LOCATEANYTHING_STYLES`).

    Images are numbered per prompt: ``grid`` holds this prompt's images, and ``<image-1>`` is its
    first row whatever other prompts of a batch hold.

    Args:
        text: the user's text; images are referred to as ``<image-1>``, ``<image-2>``, ... in any order.
        grid: (N, 2) or (N, 3) rows of the N images' patch grids (the processor's ``grid_hws``).
        style: ``"release"`` or ``"vllm"``.

    Raises:
        ValueError: an unknown style, an ``<image-N>`` with no image N, or an image referred to other
            than exactly once.
    """
    if style not in LOCATEANYTHING_STYLES:
        raise ValueError(f"style must be one of {LOCATEANYTHING_STYLES}, got {style!r}")
    counts = tokens_per_image(torch.as_tensor(grid), merge_kernel_size)
    refs = [int(match) for match in _IMAGE_REF.findall(text)]
    for number in refs:
        if not 1 <= number <= len(counts):
            raise ValueError(f"the text refers to <image-{number}>, but there are {len(counts)} images")
    for number in range(1, len(counts) + 1):
        if refs.count(number) != 1:
            raise ValueError(f"image {number} is referred to {refs.count(number)} times in the text, not once")

    def image(match: re.Match[str]) -> str:
        number = int(match.group(1))
        return _locateanything_image(number, counts[number - 1], style)

    return _IMAGE_REF.sub(image, text)


def locateanything_image_ids(num_tokens: int) -> list[int]:
    """One image's marker ids: ``<img>``, ``<IMG_CONTEXT>`` x ``num_tokens``, ``</img>``.

    In the release's form these follow the label ``<image N>``, which is ordinary text: its ids
    are the tokenizer's, none of them ``IMG_CONTEXT_TOKEN_ID``.
    """
    if num_tokens < 1:
        raise ValueError(f"an image has at least one visual token, got {num_tokens}")
    return [IMG_START_TOKEN_ID, *[IMG_CONTEXT_TOKEN_ID] * num_tokens, IMG_END_TOKEN_ID]
