"""Encoding planned packs: the one place where a pack is decoded, encoded and split per item.

:func:`encode_pack` decodes a :class:`~moonvit.media.packing.Pack`'s images, runs one
forward and returns an :class:`EncodedPack` that splits the outputs per image.
:func:`iter_encode_images` / :func:`encode_images` (the one-liners),
``moonvit_projector.export`` and the probe's feature extraction all go through it, for any tower
(:class:`~moonvit.model.interface.VisionEncoder`: MoonViT, or the classic ViT / DeiT, whose
per-image prefix rows, pooled row and logits come along). :func:`pool_features` averages each
image's tokens, :func:`class_token_features` takes a classic ViT's CLS rows, and
:func:`checkpoint_processors` gives the processors the commands run a checkpoint folder with.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .media.image import ImageChangedError, image_sources
from .media.packing import DEFAULT_MAX_PATCHES_PER_PACK, MediaInput, Pack, PackItem, pack_images
from .media.processor import ImageProcessor, MoonViTImageProcessor
from .media.selection import processor_for
from .media.video import MoonViTVideoProcessor, is_video
from .model.encoder import MoonViTOutput
from .model.grid import GridInput, PackedGrid, tokens_per_image
from .model.interface import EncoderConfig, VisionEncoder, tower_name
from .prefetch import prefetch
from .weights.storage import CheckpointError

__all__ = [
    "EncodedImage",
    "EncodedImages",
    "EncodedPack",
    "encode_images",
    "encode_pack",
    "iter_encode_images",
    "CheckpointProcessors",
    "checkpoint_processors",
    "class_token_features",
    "pool_features",
    "process_pack",
]


@dataclass(frozen=True)
class EncodedImage:
    """The encoder's output for one input image, or for one chunk of an input video.

    Attributes:
        index: position in the input (a video's chunks share it).
        tokens: (rows * cols / (kh * kw), kh * kw, D) merged tokens (a chunk's frames averaged),
            in the encoder's dtype, on the chosen output device: (n / 4, 4, D) for MoonViT's 2x2
            merger, (rows * cols, 1, D) for the classic ViT (each patch one token).
        grid_hw: (rows, cols) patch grid the image (each frame) was encoded at.
        rescaled: whether it was scaled below the processor's size to fit the pack budget.
        chunk: the chunk's position in its video, None for an image.
        frames: t, the chunk's frames (1 for an image).
        timestamp: seconds of the chunk's first frame, None for an image.
        frame_indices: the source frames the chunk took, None for an image.
        prefix_tokens: (n_prefix, D) the image's prefix rows after the final norm, CLS first (then
            DeiT's distillation token), for a tower with prefix tokens; None for MoonViT.
        pooled: (D,) the tower's one vector per image (the CLS row; a GAP ViT: the mean of its
            patch rows); None for MoonViT.
        logits: (classes,) the head's logits where the tower has a head, else None.
    """

    index: int
    tokens: torch.Tensor
    grid_hw: tuple[int, int]
    rescaled: bool
    chunk: int | None = None
    frames: int = 1
    timestamp: float | None = None
    frame_indices: tuple[int, ...] | None = None
    prefix_tokens: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """(frames, rows, cols) the item was encoded at."""
        return (self.frames, *self.grid_hw)


class EncodedImages(list[torch.Tensor]):
    """:func:`encode_images`' result: a list of one (n_i, kh * kw, D) tensor of merged tokens per image
    and per video chunk, in input order, with where each entry came from alongside.

    A video gives one entry per chunk, so entries map back to inputs through ``indices``.

    Attributes:
        results: the :class:`EncodedImage` of each entry (the tokens and all that follows).
        indices: the input each entry came from (a video's chunks share it).
        grid_hws: (rows, cols) each entry was encoded at.
        grid_thws: (frames, rows, cols) each entry was encoded at (1 frame for an image).
        rescaled: whether each entry was scaled below the processor's size to fit the pack
            budget (its tokens are then fewer than the processor alone would give).
        chunks, timestamps, frame_indices: each entry's chunk position in its video, the seconds
            of its first frame and the source frames it took; None for an image.
        prefix_tokens, pooled, logits: each entry's (n_prefix, D), (D,) and (classes,) from a tower
            with prefix tokens (the classic ViT / DeiT; see :class:`EncodedImage`); None for MoonViT.
    """

    def __init__(self, results: Iterable[EncodedImage] = ()) -> None:
        self.results: list[EncodedImage] = list(results)
        super().__init__(result.tokens for result in self.results)
        self.indices: list[int] = [result.index for result in self.results]
        self.grid_hws: list[tuple[int, int]] = [result.grid_hw for result in self.results]
        self.grid_thws: list[tuple[int, int, int]] = [result.grid_thw for result in self.results]
        self.rescaled: list[bool] = [result.rescaled for result in self.results]
        self.chunks: list[int | None] = [result.chunk for result in self.results]
        self.timestamps: list[float | None] = [result.timestamp for result in self.results]
        self.frame_indices: list[tuple[int, ...] | None] = [result.frame_indices for result in self.results]
        self.prefix_tokens: list[torch.Tensor | None] = [result.prefix_tokens for result in self.results]
        self.pooled: list[torch.Tensor | None] = [result.pooled for result in self.results]
        self.logits: list[torch.Tensor | None] = [result.logits for result in self.results]


@dataclass(frozen=True)
class EncodedPack:
    """One forward over the decodable images of a pack.

    Attributes:
        items: the pack's items that were encoded, in pack order (empty when none could be decoded).
        grid: their packed grid metadata (None when ``items`` is empty).
        output: the encoder's output for them (None when ``items`` is empty).
        merge_kernel_size: the encoder's (kh, kw).
        failures: item key (:attr:`PackItem.key`: input index, chunk) -> reason, for items that
            could not be decoded (only with ``skip_errors``); they are not in ``items``.
    """

    items: tuple[PackItem, ...]
    grid: PackedGrid | None
    output: MoonViTOutput | None
    merge_kernel_size: tuple[int, int] = (2, 2)
    failures: dict[tuple[int, int | None], str] = field(default_factory=dict)

    @property
    def tokens_per_item(self) -> list[int]:
        """Merged tokens of each item (h * w / (kh * kw)), whatever its frame count."""
        return [] if self.grid is None else tokens_per_image(self.grid.grid_thws, self.merge_kernel_size)

    @property
    def merged(self) -> torch.Tensor:
        """(S / (kh * kw), kh * kw, D) the merged tokens of all encoded items ((S, 1, D) for the classic ViT)."""
        if self.output is None or self.output.merged is None:
            raise ValueError("this pack has no merged tokens (no image decoded, or patches were dropped)")
        return self.output.merged

    def split_tokens(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Split a per-merged-token tensor (S / (kh * kw), ...) (``merged``, projected tokens) per item."""
        return tokens.split(self.tokens_per_item)


ProcessedPack = tuple[torch.Tensor, torch.Tensor, tuple[PackItem, ...], dict[tuple[int, int | None], str]]
"""What :func:`process_pack` returns: (pixel_values (L, 3, p, p) float32, grid_thws (N, 3) int64,
the decoded items, failures by item key)."""


def process_pack(
    processor: ImageProcessor,
    pack: Pack,
    *,
    skip_errors: bool = False,
    video_processor: MoonViTVideoProcessor | None = None,
) -> ProcessedPack:
    """Decode a pack's images and video chunks into one batch.

    Video chunks go through ``video_processor`` (default:
    :meth:`MoonViTVideoProcessor.for_images` of ``processor``). An image whose pixels give
    another grid than it was planned at from its header (a file replaced since) is an
    :class:`~moonvit.media.image.ImageChangedError`. With ``skip_errors``, an item that cannot
    be decoded (``ImageLoadError``, a bad size, an OS error) is left out and its reason recorded
    by :attr:`PackItem.key`; otherwise the error propagates.

    Returns:
        (pixel_values (L, 3, p, p) float32, grid_thws (N, 3) int64 of the decoded items,
        those items, failures).
    """
    videos = video_processor or MoonViTVideoProcessor.for_images(processor)
    pixels, grids, items = [], [], []
    failures: dict[tuple[int, int | None], str] = {}
    for item in pack.items:
        try:
            if item.chunk is not None:
                item_pixels, thw = videos.process_chunk(item.chunk, item.in_token_limit)
            else:
                batch = processor([item.source], in_token_limit=[item.in_token_limit])  # type: ignore[list-item]
                item_pixels, thw = batch.pixel_values, (1, *batch.grid_hws[0].tolist())
                if thw[1:] != tuple(item.plan.grid_hw):  # its header said otherwise when it was planned
                    raise ImageChangedError(
                        f"input image {item.index} ({_name(item.source)}) decodes to a {thw[1]}x{thw[2]} patch grid, "
                        f"planned at {item.plan.grid_hw[0]}x{item.plan.grid_hw[1]} from its header: it changed after "
                        "it was planned"
                    )
        except (ValueError, OSError) as error:  # ImageLoadError and VideoLoadError included
            if not skip_errors:
                raise
            failures[item.key] = str(error)
            continue
        pixels.append(item_pixels)
        grids.append(thw)
        items.append(item)
    p = processor.patch_size
    pixel_values = torch.cat(pixels) if pixels else torch.empty(0, 3, p, p)
    return pixel_values, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3), tuple(items), failures


def processed_packs(
    processor: ImageProcessor,
    packs: Iterable[Pack],
    *,
    workers: int = 0,
    skip_errors: bool = False,
    video_processor: MoonViTVideoProcessor | None = None,
) -> Iterator[tuple[Pack, ProcessedPack]]:
    """``(pack, process_pack(processor, pack, ...))`` for each pack, in order: inline, or with
    ``workers`` threads decoding the next packs while the caller encodes this one (the same
    results; see :func:`~moonvit.prefetch.prefetch`). Hand each to :func:`encode_processed`."""

    def decode(pack: Pack) -> ProcessedPack:
        return process_pack(processor, pack, skip_errors=skip_errors, video_processor=video_processor)

    return prefetch(packs, decode, workers)


def encode_pack(
    encoder: VisionEncoder,
    processor: ImageProcessor,
    pack: Pack,
    *,
    skip_errors: bool = False,
    hidden_state_indices: Sequence[int] | None = None,
    video_processor: MoonViTVideoProcessor | None = None,
) -> EncodedPack:
    """Decode and encode one pack without autograd, the encoder in whatever mode it is.

    Args:
        skip_errors: leave undecodable images out (see :func:`process_pack`).
        hidden_state_indices: hidden states to keep (see ``MoonViT.forward``).
        video_processor: for the pack's video chunks (see :func:`process_pack`).

    Returns:
        the :class:`EncodedPack` (with no items when no image of the pack could be decoded).
    """
    processed = process_pack(processor, pack, skip_errors=skip_errors, video_processor=video_processor)
    return encode_processed(encoder, processed, hidden_state_indices=hidden_state_indices)


def encode_processed(
    encoder: VisionEncoder, processed: ProcessedPack, *, hidden_state_indices: Sequence[int] | None = None
) -> EncodedPack:
    """The encoder's half of :func:`encode_pack`, on what :func:`process_pack` returned (which a
    :func:`~moonvit.prefetch.prefetch` worker may have computed ahead)."""
    pixel_values, grid_thws, items, failures = processed
    if not items:
        return EncodedPack((), None, None, encoder.config.merge_kernel_size, failures)
    grid = encoder.prepare_grid(grid_thws)
    with torch.no_grad():
        output = encoder(pixel_values.to(encoder.device), grid=grid, hidden_state_indices=hidden_state_indices)
    return EncodedPack(items, grid, output, encoder.config.merge_kernel_size, failures)


def iter_encode_images(
    encoder: VisionEncoder,
    processor: ImageProcessor,
    images: MediaInput | Iterable[MediaInput],
    *,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    output_device: torch.device | str = "cpu",
    video_processor: MoonViTVideoProcessor | None = None,
    workers: int = 0,
) -> Iterator[EncodedImage]:
    """Encode ``images`` pack by pack, yielding each image's (each video chunk's) result, in input order.

    Only the items of the pack being encoded are decoded; each pack's merged tokens are moved
    to ``output_device`` before the next pack starts. Runs without autograd, with the encoder in
    whatever mode it is (call ``.eval()`` first).

    Args:
        encoder: a MoonViT: ``encoder(pixel_values, grid_thws).merged`` is (S / 4, 4, D).
        processor: turns images into ``pixel_values`` and grids.
        images: one input or an iterable of them (see :data:`ImageInput`; videos: paths with a
            video ending or :class:`~moonvit.media.video.VideoFrames`, which need a tower with a
            temporal table), consumed lazily.
        max_patches_per_pack: patch budget per encoder forward (see :func:`pack_images`).
        output_device: where the results are put.
        video_processor: for videos (default: :meth:`MoonViTVideoProcessor.for_images` of ``processor``).
        workers: threads decoding the next packs while this one encodes (0: decode inline); the
            results are the same either way.

    Raises:
        VideoNotSupportedError: a video for a tower that takes images only, before it is read.
    """
    videos = video_processor or MoonViTVideoProcessor.for_images(processor)

    def checked() -> Iterator[MediaInput]:  # a video for an image-only tower, refused before it is read
        for index, source in enumerate(image_sources(images)):  # type: ignore[arg-type]
            if is_video(source):
                videos.check_tower(encoder.config.max_frames, f"input {index} ({_name(source)}) is a video: it")
            yield source

    packs = pack_images(checked(), processor, max_patches_per_pack, videos)
    for _, processed in processed_packs(processor, packs, workers=workers, video_processor=videos):
        encoded = encode_processed(encoder, processed)
        assert encoded.grid is not None and encoded.output is not None  # without skip_errors: decoded or raised
        tokens = encoded.split_tokens(encoded.merged.to(output_device))
        # the per-item outputs of a tower with prefix tokens: one row each per item, in pack order
        output = encoded.output
        prefix, pooled, logits = (
            None if value is None else value.to(output_device)
            for value in (output.prefix_tokens, output.pooled, output.logits)
        )
        for i, (item, (_, h, w), item_tokens) in enumerate(zip(encoded.items, encoded.grid.grid_thws.tolist(), tokens)):
            chunk = item.chunk
            yield EncodedImage(
                item.index, item_tokens, (h, w), item.rescaled,
                chunk=None if chunk is None else chunk.plan.chunk, frames=item.frames,
                timestamp=None if chunk is None else chunk.plan.timestamp,
                frame_indices=None if chunk is None else tuple(chunk.plan.frame_indices),
                prefix_tokens=None if prefix is None else prefix[i],
                pooled=None if pooled is None else pooled[i],
                logits=None if logits is None else logits[i],
            )  # fmt: skip


def _name(source: object) -> str:
    return str(source) if isinstance(source, (str, os.PathLike)) else getattr(source, "name", type(source).__name__)


def encode_images(
    encoder: VisionEncoder,
    processor: ImageProcessor,
    images: MediaInput | Iterable[MediaInput],
    *,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    output_device: torch.device | str = "cpu",
    video_processor: MoonViTVideoProcessor | None = None,
) -> EncodedImages:
    """Encode images of any sizes: one (rows_i * cols_i / 4, 4, D) tensor of merged tokens per image,
    and one per chunk of each video, in input order.

    Same arguments as :func:`iter_encode_images`, which this collects. An image that alone
    exceeds ``max_patches_per_pack`` is scaled down to fit: ``result.rescaled[i]`` flags it, and
    one ``UserWarning`` per call names such images.
    """
    results = EncodedImages(
        iter_encode_images(
            encoder,
            processor,
            images,
            max_patches_per_pack=max_patches_per_pack,
            output_device=output_device,
            video_processor=video_processor,
        )
    )
    rescaled = sorted({index for index, flag in zip(results.indices, results.rescaled) if flag})
    if rescaled:
        shown = ", ".join(map(str, rescaled[:10])) + (", ..." if len(rescaled) > 10 else "")
        warnings.warn(
            f"{len(rescaled)} of {len(set(results.indices))} images were scaled down to fit max_patches_per_pack="
            f"{max_patches_per_pack} (inputs {shown}), so they have fewer tokens than the processor alone "
            "gives; raise max_patches_per_pack to keep their size (result.rescaled flags them)",
            stacklevel=2,
        )
    return results


def segment_mean(rows: torch.Tensor, counts: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """(L, ...) rows of N consecutive segments of ``counts`` rows -> (N, F) float32 means, F the flattened rest."""
    counts = torch.as_tensor(counts, device=rows.device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=rows.device), counts)
    flat = rows.flatten(1).float()
    sums = flat.new_zeros(len(counts), flat.shape[1]).index_add_(0, owner, flat)
    return sums / counts.unsqueeze(1)


def class_token_features(output: MoonViTOutput) -> torch.Tensor:
    """Each item's CLS row after the final norm: (N, D) float32, from a tower with a class token
    (``output.prefix_tokens[:, 0]``; the classic ViT's ``pooled`` when it pools by its token).

    Raises:
        ValueError: the output has no CLS row (MoonViT, or a GAP ViT without a class token).
    """
    prefix = output.prefix_tokens
    if prefix is None or prefix.shape[1] == 0:
        raise ValueError(
            "this encoder's outputs have no CLS token (a MoonViT tower, or a classic ViT pooled by the mean of "
            "its patches): use the mean of its patch tokens instead"
        )
    return prefix[:, 0].float()


def pool_features(
    features: MoonViTOutput | torch.Tensor,
    grid: PackedGrid | GridInput,
    tokens: Literal["patches", "merged"] = "patches",
) -> torch.Tensor:
    """Each item's mean token, the usual global-average-pooled image feature (MoonViT has no CLS
    token; for a classic ViT's see :func:`class_token_features`: ``last_hidden_state`` holds its patch
    rows alone, so this is the mean of its patches, without the CLS row).

    Args:
        features: an encoder output, or a per-patch tensor (L, D) such as one of its hidden states.
        grid: the pack's :class:`PackedGrid` (required when patches were dropped), or its
            ``grid_hws`` (N, 2) / ``grid_thws`` (N, 3).
        tokens: ``"patches"``: the mean of ``last_hidden_state`` over each item's patches (all
            frames of a clip), (N, D); ``"merged"``: the mean of its merged groups, each
            flattened to kh * kw * D in the merger's order, (N, 4D) for MoonViT (only for an
            output; for the classic ViT, (N, D), the same as ``"patches"``).

    Returns:
        (N, D) or (N, kh * kw * D) float32.
    """
    thws = grid.grid_thws if isinstance(grid, PackedGrid) else torch.as_tensor(grid)
    if tokens == "patches":
        rows = features if isinstance(features, torch.Tensor) else features.last_hidden_state
        counts = list(grid.seqlens) if isinstance(grid, PackedGrid) else [int(n) for n in thws.prod(dim=1).tolist()]
        return segment_mean(rows, counts)
    if tokens != "merged":
        raise ValueError(f"tokens must be 'patches' or 'merged', got {tokens!r}")
    if isinstance(features, torch.Tensor):
        raise ValueError("a tensor is pooled over patches; pass the encoder output for merged tokens")
    if features.merged is None:
        raise ValueError("this output has no merged tokens (patches were dropped)")
    # Only the kernel's area matters for the count: (kh * kw, 1) stands for (kh, kw).
    return segment_mean(features.merged, tokens_per_image(thws, (features.merged.shape[1], 1)))


# ---- the processors of a checkpoint ----------------------------------------------------------


@dataclass(frozen=True)
class CheckpointProcessors:
    """A checkpoint's processors.

    Attributes:
        image: the image processor.
        video: the video processor (for an image-only tower: what videos would get, never used).
    """

    image: ImageProcessor
    video: MoonViTVideoProcessor


def checkpoint_processors(
    checkpoint: str | os.PathLike, config: EncoderConfig, *, rule: str | None = None, **image_overrides: Any
) -> CheckpointProcessors:
    """The image and video processors the commands run a checkpoint folder (or hub id) with, its
    tower having ``config``, by the rule its family names (:attr:`Family.default_rule
    <moonvit.families.Family.default_rule>`, found by :func:`~moonvit.families.family_of`).

    A folder of a family without a default rule is read by its own processor files, as its family
    reads them (``processor_for(checkpoint, None)``): a MoonViT folder's
    (:meth:`MoonViTImageProcessor.from_pretrained`, and :meth:`MoonViTVideoProcessor.from_pretrained`
    for its videos); no rule may be named. A folder of a family with a default rule is read by
    that rule unless ``rule`` names another of the family's (see :func:`moonvit.media.processor_for`):
    the classic ViT / DeiT at native resolution (``native``,
    :class:`~moonvit.families.vit.processor.NativeViTImageProcessor`: the tower's patch size, each
    image resized to whole patches within a patch budget, no merger, the folder's own
    normalisation), or by its checkpoint's fixed resize (``vit``, ``deit``). Such towers take images
    only: the video processor only says so.

    ``image_overrides`` replace image settings (``side_limit_mode``, say, for MoonViT).

    Raises:
        CheckpointError: the folder's processor files cannot be read, a rule named for a MoonViT folder,
            a setting its rule does not have (the ViT rules have no ``side_limit_mode``: they cap
            each side themselves), or a processor whose patches the tower does not take (another
            patch size or merge kernel: a family whose rules are not registered).
    """
    from .families import family_of  # the families build on this package's modules

    family = family_of(config)
    default = None if family is None else family.default_rule
    if default is None and rule is not None:
        raise CheckpointError(f"{checkpoint} holds a {tower_name(config)}, whose processor comes from its own files")
    if default is not None and "side_limit_mode" in image_overrides:
        raise CheckpointError(
            f"--side-limit-mode {image_overrides['side_limit_mode']}: a setting of MoonViT's processors; the "
            f"{tower_name(config)} of {checkpoint} is read by its {rule or default} rule, which caps each side by "
            "itself"
        )
    try:
        image = processor_for(checkpoint, rule or default, **image_overrides)  # default None: the folder's files
    except ValueError as error:  # a rule or setting the family does not have
        raise CheckpointError(str(error)) from error
    cuts = (image.patch_size, tuple(image.merge_kernel_size))
    takes = (config.patch_size, tuple(config.merge_kernel_size))
    if cuts != takes:  # a family whose processor rules are not registered would get another's: refused, not misread
        why = f" (the {family.name} family names no processor rule yet)" if family and not family.processors else ""
        raise CheckpointError(
            f"{checkpoint}: its processor ({type(image).__name__}) cuts {cuts[0]} px patches merged "
            f"{cuts[1][0]}x{cuts[1][1]}, its {tower_name(config)} takes {takes[0]} px patches merged "
            f"{takes[1][0]}x{takes[1][1]}{why}"
        )
    if isinstance(image, MoonViTImageProcessor):  # a MoonViT folder: its video rule too (K3: 8 fps, its budgets)
        return CheckpointProcessors(image, MoonViTVideoProcessor.from_pretrained(checkpoint))
    return CheckpointProcessors(image, MoonViTVideoProcessor.for_images(image))
