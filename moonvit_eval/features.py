"""Frozen features of a split: the resize policy, the feature views, pack-wise extraction and the cache.

Encoder views, all from one forward over packs of whole images:
    ``mean``: each image's patch tokens after the final norm, averaged: (N, D) (a classic ViT's
        patch rows alone, its CLS row left out).
    ``merged-mean``: each image's merged tokens (MoonViT's 2x2 groups: 4 patch tokens concatenated
        in the merger's order, as the projector sees them), averaged: (N, 4D); for the classic ViT,
        which has no merger, the same as ``mean``.
    ``last4``: the per-image means of the last 4 blocks' outputs (before the final norm),
        concatenated: (N, 4D); needs at least 4 blocks.
    ``cls``: the CLS row after the final norm, the image representation of the ViT paper:
        (N, D); only for a tower with a class token (ViT, DeiT, DINOv2; MoonViT and SigLIP have none).
    ``both``: ``cls`` and ``mean`` concatenated, in that order: (N, 2D); as ``cls``.
    ``pooled``: the tower's own ``pooled`` output: (N, D); the CLS row after the final norm (ViT,
        DeiT, DINOv2), the MAP head's output (SigLIP), the patch mean (a GAP ViT); MoonViT gives none.
``cls`` and ``both`` over the last N blocks (:func:`view_name`: ``cls-lastN``, ``both-lastN``): the
CLS rows of the last N blocks, each after the final norm, concatenated, (N * D); ``both`` then adds the
mean of the last block's patch rows after it, ((N + 1) * D): DINOv2's linear-evaluation features at
N = 4 (``n_last_blocks=4, avgpool=True``), read with :func:`moonvit.model.features.read_intermediates`.
``pixels`` is the no-encoder baseline: an image's raw pixels scaled to [0, 1], flattened.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from tqdm import tqdm

from moonvit import (
    DEFAULT_MAX_PATCHES_PER_PACK,
    ImageProcessor,
    MoonViTOutput,
    PackedGrid,
    VisionEncoder,
    load_image,
    pack_images,
    pool_features,
)
from moonvit.encode import class_token_features, encode_processed, processed_packs
from moonvit.files import save_safetensors_atomic, write_text_atomic
from moonvit.media.image import ImageInput
from moonvit.model.attention import resolve_attn_implementation
from moonvit.model.features import Intermediates, read_intermediates
from moonvit.model.interface import gives_hidden_states, has_class_token, pooled_kind, tower_name
from moonvit.runs import compute_facts

from .datasets import Split
from .encoder import FrozenEncoder

__all__ = [
    "CLASS_TOKEN_VIEWS",
    "ENCODER_VIEWS",
    "FEATURE_VIEWS",
    "FeatureCache",
    "ForwardTiming",
    "ResizePolicy",
    "encoder_views",
    "extract_features",
    "missing_view_reason",
    "parse_view",
    "pixel_features",
    "split_features",
    "view_name",
]

ENCODER_VIEWS = ("mean", "merged-mean", "last4", "cls", "both", "pooled")
LAST4 = (-4, -3, -2, -1)
"""The hidden states the ``last4`` view reads: the last four blocks' outputs."""
CLASS_TOKEN_VIEWS = ("cls", "both")
"""The views that read the CLS row: only a tower with a class token gives them; they take the CLS
rows of the last N blocks with :func:`view_name`'s N."""
FEATURE_VIEWS = (*ENCODER_VIEWS, "pixels")
CACHE_FORMAT = 1
PIXEL_SIDE = 32
"""Side the ``pixels`` view resizes images to when a split's images differ in size (ImageFolder)."""
_LAST = "-last"


def view_name(view: str, last_blocks: int = 1) -> str:
    """The name of ``view`` over the last ``last_blocks`` blocks' CLS rows: the view itself for 1,
    ``cls-lastN`` / ``both-lastN`` for N > 1 (only the :data:`CLASS_TOKEN_VIEWS` take N)."""
    if last_blocks == 1:
        return view
    if view not in CLASS_TOKEN_VIEWS:
        raise ValueError(
            f"--last-blocks {last_blocks} reads the CLS rows of the last blocks: it goes with --features "
            f"{' or '.join(CLASS_TOKEN_VIEWS)}, not {view}"
        )
    if last_blocks < 1:
        raise ValueError(f"last_blocks must be >= 1, got {last_blocks}")
    return f"{view}{_LAST}{last_blocks}"


def parse_view(name: str) -> tuple[str, int]:
    """(view, N) of a :func:`view_name`: ``cls-last4`` -> (``cls``, 4), ``mean`` -> (``mean``, 1)."""
    view, _, count = name.partition(_LAST)
    if count and view in CLASS_TOKEN_VIEWS and count.isdigit() and int(count) > 1:
        return view, int(count)
    return name, 1


@dataclass(frozen=True)
class ResizePolicy:
    """How images are resized before the processor (which never upscales).

    Attributes:
        short_side: the RGB image is resized with Pillow bicubic, aspect ratio kept, so that its
            short side is this many pixels (both sides rounded); 0 keeps the native size. The
            default 112 turns a 28x28 image into 8x8 patches (4x4 merged tokens).
    """

    short_side: int = 112

    def __post_init__(self) -> None:
        if self.short_side < 0:
            raise ValueError(f"short_side must be >= 0 (0 = native size), got {self.short_side}")

    def __call__(self, image: Image.Image) -> Image.Image:
        if self.short_side == 0 or min(image.size) == self.short_side:
            return image
        scale = self.short_side / min(image.size)
        size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
        return image.resize(size, Image.Resampling.BICUBIC)


@dataclass
class ForwardTiming:
    """Wall-clock seconds of the encoder's forward, pack by pack (filled by :func:`extract_features`).

    Only the forward is timed (from the pixels on the device to the output, CUDA synchronised),
    not image loading, resizing, the processor's patchify or the feature views. The first forward
    of a process is slower (allocations, kernel choice): warm the encoder up before timing it.

    Attributes:
        images, seconds: per pack, its image count and its forward's seconds.
    """

    images: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def images_per_s(self) -> float | None:
        """Images per second of forward over every timed pack; None when nothing was timed."""
        seconds = sum(self.seconds)
        return sum(self.images) / seconds if seconds > 0 else None

    def summary(self) -> dict[str, Any]:
        """The figures results.json records."""
        return {
            "images_per_s": self.images_per_s(),
            "images_timed": sum(self.images),
            "packs_timed": len(self.seconds),
            "forward_s": sum(self.seconds),
        }


@contextmanager
def _forward_seconds(model: VisionEncoder) -> Iterator[list[float] | None]:
    """Seconds of each ``model(...)`` call while open, by hooks on the top module only (so no
    layer's fused path is turned off); None for an encoder that is not a torch module (no hooks)."""
    if not isinstance(model, torch.nn.Module):
        yield None
        return
    durations: list[float] = []
    started: list[float] = []
    device = model.device

    def synchronize() -> None:
        if device.type == "cuda":  # CUDA runs asynchronously: wait for the work queued before / by the forward
            torch.cuda.synchronize(device)

    def before(*_: Any) -> None:
        synchronize()
        started.append(time.perf_counter())

    def after(*_: Any) -> None:
        synchronize()
        durations.append(time.perf_counter() - started.pop())

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        yield durations
    finally:
        for handle in handles:
            handle.remove()


def encoder_views(
    output: MoonViTOutput,
    grid: PackedGrid | torch.Tensor,
    views: Iterable[str],
    normed: Intermediates | None = None,
) -> dict[str, torch.Tensor]:
    """Per-image feature views of one pack's forward.

    Args:
        output: the encoder's output for a pack of N images, with the last 4 blocks' hidden
            states when ``last4`` is asked (``hidden_state_indices=LAST4``).
        grid: the pack's grid, or its (N, 2) ``grid_hws``.
        views: names from :data:`ENCODER_VIEWS`, or :func:`view_name`'s ``cls-lastN`` / ``both-lastN``.
        normed: for those, the forward's intermediates through the final norm
            (:func:`~moonvit.model.features.read_intermediates` with ``norm=True``), the last N
            blocks last.

    Returns:
        {view: (N, F) float32}: F = D for ``mean``, ``cls`` and ``pooled``, 4D for ``merged-mean``
        (D for a tower without a merger) and ``last4``, 2D for ``both``; N * D for ``cls-lastN``,
        (N + 1) * D for ``both-lastN``.

    Raises:
        ValueError: an unknown view, ``last4`` without the hidden states, ``cls`` / ``both`` on an
            output without a CLS row, ``pooled`` on one without a pooled row, the last N blocks' views
            without ``normed`` of them.
    """
    result = {}
    for name in views:
        view, blocks = parse_view(name)
        if view == "mean":
            result[name] = pool_features(output, grid)
        elif view == "merged-mean":
            result[name] = pool_features(output, grid, "merged")
        elif view == "last4":
            if output.hidden_states is None or len(output.hidden_states) < 4:
                raise ValueError("the last4 view needs the last 4 blocks' hidden states of an encoder with 4 blocks")
            result[name] = torch.cat([pool_features(h, grid) for h in output.hidden_states[-4:]], dim=1)
        elif view in CLASS_TOKEN_VIEWS:
            cls = class_token_features(output) if blocks == 1 else _last_cls_rows(output, normed, blocks)
            result[name] = cls if view == "cls" else torch.cat([cls, pool_features(output, grid)], dim=1)
        elif view == "pooled":
            if output.pooled is None:
                raise ValueError("this encoder's outputs have no pooled row (a MoonViT tower): use the mean view")
            result[name] = output.pooled.float()
        else:
            raise ValueError(f"unknown encoder view {name!r}; choose from {ENCODER_VIEWS}")
    return result


def _last_cls_rows(output: MoonViTOutput, normed: Intermediates | None, blocks: int) -> torch.Tensor:
    """(N, blocks * D) float32: the CLS rows of the last ``blocks`` blocks, each after the final norm,
    in block order (DINOv2's linear evaluation)."""
    class_token_features(output)  # refuses a tower without a CLS row, by name
    if normed is None or normed.prefix_tokens is None or not normed.normed:
        raise ValueError(f"the CLS rows of the last {blocks} blocks need the forward's normed intermediates")
    last = normed.indices[-1]
    # the last block's normed rows are the forward's own prefix rows (read_intermediates takes them as they are)
    ends_last = normed.prefix_tokens[-1] is output.prefix_tokens
    if not ends_last or normed.indices[-blocks:] != tuple(range(last - blocks + 1, last + 1)):
        raise ValueError(f"the normed intermediates hold blocks {normed.indices}, not the last {blocks}")
    return torch.cat([rows[:, 0] for rows in normed.prefix_tokens[-blocks:]], dim=1).float()


def view_hidden_states(views: Iterable[str], num_blocks: int) -> tuple[int, ...]:
    """The hidden states (non-negative, ascending) a forward keeps for ``views``: ``last4``'s, and the
    last N blocks of a ``cls-lastN`` / ``both-lastN``; () when none needs any."""
    kept: set[int] = set()
    for name in views:
        view, blocks = parse_view(name)
        if view == "last4":
            kept.update(range(num_blocks - 3, num_blocks + 1))
        elif blocks > 1:
            kept.update(range(num_blocks - blocks + 1, num_blocks + 1))
    return tuple(sorted(kept))


def available_views(model: VisionEncoder, last_blocks: int = 1) -> tuple[str, ...]:
    """The encoder views ``model`` can give (their :func:`view_name` for ``last_blocks``): ``last4``
    needs 4 blocks whose hidden states the forward gives, ``cls`` and ``both`` a class token (and
    ``last_blocks`` blocks), ``pooled`` a tower that pools."""
    config = model.config
    return tuple(
        view_name(view, last_blocks if view in CLASS_TOKEN_VIEWS else 1)
        for view in ENCODER_VIEWS
        if (view != "last4" or (config.num_hidden_layers >= 4 and gives_hidden_states(config)))
        and (view not in CLASS_TOKEN_VIEWS or (has_class_token(config) and config.num_hidden_layers >= last_blocks))
        and (view != "pooled" or pooled_kind(config) is not None)
    )


def _what(config: Any) -> str:
    """The tower in a message: its family's name, and how it pools where that is why it lacks a view."""
    pooling = {"mean": " pooled by the mean of its patches", "map": " pooled by its MAP head"}
    return f"a {tower_name(config)}{pooling.get(pooled_kind(config) or '', '')}"


def missing_view_reason(model: VisionEncoder, view: str) -> str:
    """Why ``model`` cannot give ``view`` (an encoder view name not in :func:`available_views`)."""
    config = model.config
    base, blocks = parse_view(view)
    given = ", ".join(available_views(model))
    if base in CLASS_TOKEN_VIEWS and not has_class_token(config):
        return (
            f"--features {base} reads the CLS token, and this encoder ({_what(config)}) has none: choose mean, "
            f"the mean of its patch tokens, or another of the views it gives ({given})"
        )
    if base in CLASS_TOKEN_VIEWS:
        return (
            f"--last-blocks {blocks} reads the CLS rows of the last {blocks} blocks; this encoder has "
            f"{config.num_hidden_layers}"
        )
    if base == "pooled":
        return (
            f"--features pooled reads the tower's pooled output, and this encoder ({_what(config)}) gives none: "
            f"choose mean, the mean of its patch tokens, or another of the views it gives ({given})"
        )
    if not gives_hidden_states(config):
        return (
            f"--features {view} reads the last 4 blocks' hidden states, and this encoder ({_what(config)}) gives "
            f"none (its features are its towers' second-to-last blocks'): choose mean, the mean of its patch "
            f"tokens, or another of the views it gives ({given})"
        )
    return (
        f"--features {view} needs an encoder of at least 4 blocks; this one has {config.num_hidden_layers} "
        f"(it gives {given})"
    )


def extract_features(
    model: VisionEncoder,
    processor: ImageProcessor,
    images: Iterable[ImageInput],
    views: Iterable[str],
    *,
    resize: ResizePolicy,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    total: int | None = None,
    description: str = "features",
    timing: ForwardTiming | None = None,
    workers: int = 0,
) -> dict[str, torch.Tensor]:
    """Run the frozen encoder over ``images`` in packs of at most ``max_patches_per_pack`` patches.

    Images are loaded to RGB, resized by ``resize``, then packed with :func:`moonvit.pack_images`
    and encoded pack by pack (:func:`moonvit.encode.encode_processed`) without autograd, with a tqdm bar over
    images. Only the hidden states a view needs are kept. ``timing``, when given, gains each
    pack's image count and forward seconds. ``workers`` threads run the processor on the next
    packs while one encodes (:func:`moonvit.encode.processed_packs`; the same features as 0). Loading
    and resizing stay on this thread: for small images that work is Python, held by the GIL, and
    threads only add their overhead (measured on Fashion-MNIST: 47.6 s inline, 62 s threaded).

    Returns:
        {view: (N, F) float32 on the CPU}, rows in input order.
    """
    views = tuple(views)
    chunks: dict[str, list[torch.Tensor]] = {view: [] for view in views}
    kept = view_hidden_states(views, model.config.num_hidden_layers)
    indices = kept or None
    over_blocks = any(parse_view(view)[1] > 1 for view in views)
    resized = (resize(processor.load_image(image)) for image in images)
    packs = processed_packs(processor, pack_images(resized, processor, max_patches_per_pack), workers=workers)
    with (
        tqdm(total=total, desc=description, unit="img") as bar,
        torch.inference_mode(),
        _forward_seconds(model) as durations,
    ):
        for pack, processed in packs:
            started = time.perf_counter()
            encoded = encode_processed(model, processed, hidden_state_indices=indices)
            assert encoded.output is not None and encoded.grid is not None
            if timing is not None:
                timing.images.append(len(pack.items))
                # without hooks (not a torch module), the whole encode_processed call is timed
                timing.seconds.append(durations[-1] if durations is not None else time.perf_counter() - started)
            normed = read_intermediates(model, encoded.output, kept, norm=True) if over_blocks else None
            for view, value in encoder_views(encoded.output, encoded.grid, views, normed).items():
                chunks[view].append(value.cpu())
            bar.update(len(pack.items))
    if not any(chunks.values()):
        raise ValueError("no images to extract features from")
    return {view: torch.cat(values) for view, values in chunks.items()}


def pixel_features(images: np.ndarray | Iterable[ImageInput], progress: str | None = None) -> torch.Tensor:
    """Raw pixels in [0, 1], flattened: (N, H * W) for an (N, H, W) uint8 array; for files,
    RGB images resized (Pillow bicubic) to :data:`PIXEL_SIDE` squares: (N, 3 * PIXEL_SIDE ** 2),
    read under a tqdm bar headed ``progress`` (None: no bar)."""
    if isinstance(images, np.ndarray):
        return torch.from_numpy(images.reshape(len(images), -1).astype(np.float32) / 255)
    side = (PIXEL_SIDE, PIXEL_SIDE)
    files = tqdm(images, desc=progress, unit="img", disable=progress is None)
    rows = [np.asarray(load_image(path).resize(side, Image.Resampling.BICUBIC)) for path in files]
    return torch.from_numpy(np.stack(rows).reshape(len(rows), -1).astype(np.float32) / 255)


class FeatureCache:
    """Feature matrices on disk, one safetensors file per key, the key stored in its metadata; and
    JSON records (a probe's figures), one file per key, the key stored beside the record.

    A key is a JSON-able dict (checkpoint hash, dataset and split fingerprint, preprocessing, view);
    its sha256 names the file, so any change to it misses.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, key: dict[str, Any], suffix: str = ".safetensors") -> Path:
        text = json.dumps({"format": CACHE_FORMAT, **key}, sort_keys=True)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}{suffix}"

    def load_record(self, key: dict[str, Any]) -> Any:
        """The record saved under ``key``; None when there is none, or when its file cannot be read
        back or holds another key."""
        try:
            stored = json.loads(self.path(key, ".json").read_text())
        except (OSError, ValueError):
            return None
        same = isinstance(stored, dict) and stored.get("key") == json.loads(json.dumps(key))
        return stored.get("record") if same else None

    def save_record(self, key: dict[str, Any], record: Any) -> None:
        """Save the JSON-able ``record`` under ``key`` (atomically)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path(key, ".json"), json.dumps({"key": key, "record": record}, sort_keys=True))

    def load(self, key: dict[str, Any]) -> torch.Tensor | None:
        path = self.path(key)
        return load_file(path)["features"] if path.is_file() else None

    def save(self, key: dict[str, Any], features: torch.Tensor) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        save_safetensors_atomic({"features": features}, self.path(key), {"key": json.dumps(key, sort_keys=True)})


def split_features(
    encoder: FrozenEncoder | None,
    split: Split,
    view: str,
    *,
    dataset: str,
    split_name: str,
    resize: ResizePolicy,
    cache: FeatureCache,
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK,
    timing: ForwardTiming | None = None,
    workers: int = 0,
) -> tuple[torch.Tensor, bool]:
    """One view's (N, F) features of ``split``, from the cache or by running the encoder once.

    ``encoder`` may be None for the ``pixels`` view only. On a miss every view the encoder can
    give is extracted from the same forward and cached, so probing another view later does not
    re-run the encoder; ``timing`` then gains the forwards' seconds (a hit leaves it as it is).
    ``pixels`` of image files (decoding and resizing every file takes minutes on a large folder)
    are cached like the encoder's views; those of an in-memory array are a reshape, faster than
    reading them back, and are not. ``workers``: see :func:`extract_features`.

    Returns:
        (features, cache_hit).
    """
    if view == "pixels":
        return _pixel_split(split, dataset, split_name, cache)
    if encoder is None:
        raise ValueError(f"view {view!r} needs an encoder")
    views = available_views(encoder.model, parse_view(view)[1])
    if view not in views:
        raise ValueError(missing_view_reason(encoder.model, view))
    model = encoder.model
    base = {
        "checkpoint": encoder.hash,
        # the weights' hash alone does not tell a head count or a norm's eps; nor does it tell the
        # host, threads and attention backend the features' bits depend on (moonvit.runs)
        "config": json.loads(json.dumps(model.config.to_dict())),
        "compute": {
            **compute_facts(model.device),
            "attention": resolve_attn_implementation(model.config.attn_implementation, model.device, model.dtype),
        },
        "dtype": str(encoder.model.dtype),
        "dataset": dataset,
        "split": split_name,
        "split_fingerprint": split.fingerprint(),
        "processor": encoder.processor.to_dict(),
        "resize": asdict(resize),
        "max_patches_per_pack": max_patches_per_pack,
    }
    cached = cache.load({**base, "view": view})
    if cached is not None:
        return cached, True
    extracted = extract_features(
        encoder.model,
        encoder.processor,
        split.images,
        views,
        resize=resize,
        max_patches_per_pack=max_patches_per_pack,
        total=len(split),
        description=f"{dataset} {split_name}",
        timing=timing,
        workers=workers,
    )
    for name, features in extracted.items():
        cache.save({**base, "view": name}, features)
    return extracted[view], False


def _pixel_split(split: Split, dataset: str, split_name: str, cache: FeatureCache) -> tuple[torch.Tensor, bool]:
    """The ``pixels`` view of ``split`` and whether it came from the cache (files only, see :func:`split_features`)."""
    if isinstance(split.images, np.ndarray):
        return pixel_features(split.images), False
    key = {
        "dataset": dataset,
        "split": split_name,
        "split_fingerprint": split.fingerprint(),
        "pixel_side": PIXEL_SIDE,
        "view": "pixels",
    }
    cached = cache.load(key)
    if cached is not None:
        return cached, True
    pixels = pixel_features(split.images, progress=f"{dataset} {split_name} pixels")
    cache.save(key, pixels)
    return pixels, False
