"""The text around visual tokens in Kimi-K2.5 / K2.6 prompts.

Each image or video chunk enters the prompt as its media markers around one
``<|media_pad|>``, which the processor side expands to the item's h * w / 4
visual tokens (see :func:`expand_media_pads`); a video chunk is preceded by its
timestamp, ``HH:MM:SS.fff``, the time of its first sampled frame.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moonvit.media.video import format_timestamp
from moonvit.model.grid import GridInput, tokens_per_image

__all__ = ["MEDIA_PAD", "expand_media_pads", "media_prompt", "video_prompt"]

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
