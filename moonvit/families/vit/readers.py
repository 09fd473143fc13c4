"""What the ViT-tower families' folder readers share (the classic ViT's, SigLIP's, DINOv2's): square sizes
from transformers' and timm's ``config.json`` values, and how timm sizes a ``VisionTransformer`` from its
``architecture``, ``model_args`` and ``pretrained_cfg``."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from ...weights.config_keys import warn_unread_keys

TIMM_SIZE_ARGS = ("embed_dim", "depth", "num_heads")
"""The model_args that size a tower whose architecture names no standard size."""
TIMM_HARMLESS = frozenset({
    "dynamic_img_size", "drop_rate", "pos_drop_rate", "patch_drop_rate", "proj_drop_rate", "attn_drop_rate",
    "drop_path_rate", "weight_init",
})  # fmt: skip
"""timm ``VisionTransformer`` arguments that change nothing in an evaluated tower's outputs: dropouts, the
initialisation, and timm's resampling of the table at each forward (the towers here always resample it)."""


def square_int(value: Any, key: str) -> int:
    """An int size; transformers and timm allow a pair for image_size and patch_size, the towers are square."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{key} {value!r}: only square sizes are supported")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an int, got {value!r}")
    return value


def timm_input_size(value: Any) -> tuple[int, int]:
    """timm's ``pretrained_cfg`` ``input_size`` (C, H, W): the channels and the (square) side."""
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ValueError(f"pretrained_cfg input_size {value!r} is not [channels, height, width]")
    channels, height, width = value
    if height != width:
        raise ValueError(f"pretrained_cfg input_size {value!r}: only square sizes are supported")
    return square_int(channels, "pretrained_cfg input_size channels"), square_int(height, "pretrained_cfg input_size")


def timm_arguments(
    values: dict[str, Any], where: Path, architecture: re.Pattern[str], keys: set[str]
) -> tuple[re.Match[str], dict[str, Any]]:
    """A timm ``config.json``'s ``architecture`` matched by the family's pattern (its claims matched it)
    and its ``model_args`` (``{}`` where none); its keys other than ``keys`` warned of as unread.

    Raises:
        ValueError: ``model_args`` that is not an object.
    """
    match = architecture.match(values["architecture"])
    assert match is not None  # the family's claims matched it
    warn_unread_keys(where, values, keys)
    args = values.get("model_args") or {}
    if not isinstance(args, dict):
        raise ValueError(f"model_args is a {type(args).__name__}, not an object")
    return match, args


def refuse_timm_args(args: Mapping[str, Any], tower: str, read: Collection[str], unbuilt: Mapping[str, Any]) -> None:
    """Refuse, by key, the ``model_args`` a family's timm reader does not build: an argument neither ``read`` nor
    harmless (:data:`TIMM_HARMLESS`) nor in ``unbuilt``, and one of ``unbuilt`` (timm arguments the ``tower``
    builds at that one value) at another value.

    Raises:
        ValueError: the arguments named.
    """
    unknown = sorted(set(args) - set(read) - TIMM_HARMLESS - set(unbuilt))
    if unknown:
        raise ValueError(f"model_args {', '.join(unknown)}: not read by the {tower} (timm arguments it does not build)")
    for key, value in unbuilt.items():
        if key in args and args[key] != value:
            raise ValueError(f"model_args {key}={args[key]!r} is not supported by the {tower} (only {value!r})")


def check_timm_size(architecture: str, size: str, sizes: Mapping[str, Any], args: Mapping[str, Any]) -> None:
    """Refuse an architecture of a size not in ``sizes`` whose model_args do not give the size themselves."""
    if size not in sizes and not set(TIMM_SIZE_ARGS) <= set(args):
        raise ValueError(
            f"architecture {architecture!r}: the size {size!r} is not one of {', '.join(sizes)}; "
            "give embed_dim, depth and num_heads in model_args"
        )


def timm_fields(
    fields: dict[str, Any], input_size: Any, args: Mapping[str, Any], arg_fields: Mapping[str, str]
) -> dict[str, Any]:
    """``fields`` (the tower's config fields from its architecture name) as timm builds them over: the
    channels and side of ``pretrained_cfg``'s ``input_size`` (None: none), then the ``model_args`` of
    ``arg_fields`` (timm's argument -> the field); ``image_size`` and ``patch_size`` square ints."""
    if input_size is not None:  # timm builds img_size and in_chans from it where model_args do not give them
        fields["num_channels"], fields["image_size"] = timm_input_size(input_size)
    fields.update({ours: args[theirs] for theirs, ours in arg_fields.items() if theirs in args})
    fields["image_size"] = square_int(fields["image_size"], "img_size")
    fields["patch_size"] = square_int(fields["patch_size"], "patch_size")
    return fields


def table_pixels(image_size: int, patch_size: int) -> int:
    """The table's side in pixels: transformers and timm build (image_size // patch_size)² rows, so a
    /14 tower at 384 px has a 27 x 27 table (378 px; their convolution drops the last 6 pixels)."""
    if image_size < patch_size:
        raise ValueError(f"image_size {image_size} is smaller than patch_size {patch_size}")
    return image_size // patch_size * patch_size
