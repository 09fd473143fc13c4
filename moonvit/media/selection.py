"""Which image processor a checkpoint takes: :func:`processor_for`, the one function the commands call.

A MoonViT folder (Kimi-VL, Kimi-K2.5 / K2.6, Kimi K3, LocateAnything-3B, this package's own) brings
its :class:`~moonvit.media.processor.MoonViTImageProcessor`; the MoonViT families' rules
(:data:`~moonvit.media.presets.FAMILY_RULES`: ``"Kimi-VL"``, ``"Kimi K3"``, ...) can be named
instead. A folder of another registered family (:mod:`moonvit.families`: the classic ViT and DeiT)
is read by the loader that family registers here (:func:`register_processor_loader`), which also
builds the rules the family names (``Family.processors``: ``vit``, ``deit``, ``native`` for the
classic ViT). A family that registers no loader is read as a MoonViT one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..weights.hub import HubSnapshot, resolve_pretrained
from ..weights.storage import CheckpointError, read_json
from .presets import FAMILY_RULES, family_rule
from .processor import CONFIG_NAME, ImageProcessor, MoonViTImageProcessor

__all__ = ["ProcessorLoader", "processor_for", "register_processor_loader"]

ProcessorLoader = Callable[..., ImageProcessor]
"""``loader(folder, rule, **overrides)``: a family's processor for a checkpoint folder (``rule``
None: the folder's own rule; else one of the family's rule names)."""

_LOADERS: dict[str, ProcessorLoader] = {}


def register_processor_loader(family: str, loader: ProcessorLoader) -> None:
    """Make ``loader`` read the processors of the registered family named ``family``."""
    _LOADERS[family] = loader


def processor_for(checkpoint: str | os.PathLike, rule: str | None = None, **overrides: Any) -> ImageProcessor:
    """The image processor of a checkpoint folder or hub id.

    Args:
        checkpoint: a checkpoint folder (or hub id); a MoonViT folder may also be given as its
            ``preprocessor_config.json``.
        rule: None for the checkpoint's own rule, as its files say; else a rule its family names
            (the classic ViT / DeiT: ``"vit"`` transformers' ViT resize, ``"deit"`` resize and
            centre crop, ``"native"`` each image at its own size within a patch budget, all with
            the checkpoint's normalisation; see :mod:`moonvit.families.vit.processor`. A MoonViT
            folder: a MoonViT family's rule, ``"Kimi K3"`` say, see
            :func:`~moonvit.media.presets.family_rule`).
        overrides: settings that replace the rule's (``in_token_limit``, ``image_mean``, ...).

    Raises:
        CheckpointError: the path does not exist, a file cannot be read, or the folder does not say
            its processor and no rule was named (the folder and file named).
        ValueError: ``rule`` is not one of the family's (the choices named), or an invalid override.
    """
    path = resolve_pretrained(checkpoint, _fetch_files)
    if not path.exists():
        raise CheckpointError(f"processor config path {path} does not exist")
    family = _family_of(path) if path.is_dir() else None
    # A MoonViT folder (a family with no loader of its own): its rules are the MoonViT families'
    name, rules = family if family is not None and family[0] in _LOADERS else ("MoonViT", tuple(FAMILY_RULES))
    if rule is not None and rule not in rules:
        raise ValueError(f"unknown processor rule {rule!r} for {path} ({name}); choose one of {', '.join(rules)}")
    loader = _LOADERS.get(name, _moonvit_processor)
    return loader(path, rule, **overrides)


def _moonvit_processor(path: Path, rule: str | None, **overrides: Any) -> MoonViTImageProcessor:
    """A MoonViT checkpoint's processor: its own files' (``rule`` None), or a MoonViT family's rule."""
    if rule is None:
        return MoonViTImageProcessor.from_pretrained(path, **overrides)
    return family_rule(rule, **overrides).image


def _family_of(folder: Path) -> tuple[str, tuple[str, ...]] | None:
    """(name, rule names) of the registered family whose ``config.json`` the folder holds; None
    when none claims it, or the folder has no ``config.json``. A tower saved in its config class's own
    format names the family it was read as (``family``: a SigLIP2 or DINOv2 tower saved as a
    ``classic_vit`` folder), and that family's rules are its rules."""
    from ..families import family_named, find_family  # the families build on the media and weights packages

    file = folder / "config.json"
    if not file.is_file():
        return None
    values = read_json(file)
    family = find_family(values)
    if family is None:
        return None
    recorded = values.get("family")
    if isinstance(recorded, str) and recorded and "family" in getattr(family.config_type, "__dataclass_fields__", {}):
        family = family_named(recorded)
    return family.name, family.processors


def _fetch_files(snapshot: HubSnapshot) -> None:
    """From a hub repository: config.json (which family) and preprocessor_config.json where it has one."""
    snapshot.file("config.json")
    snapshot.optional_file(CONFIG_NAME)
