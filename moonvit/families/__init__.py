"""Every checkpoint family the one loader reads, each described in one place.

A family is a small :class:`Family` spec: how to recognise its ``config.json``, how to read it
into the tower's config and its tensors' layout (given the folder's tensor names), and which
module builds the tower. :func:`moonvit.weights.checkpoint.read_config` asks :func:`find_family`
first, so ``MoonViT.from_pretrained`` (which every command uses) loads any registered family;
a folder no spec claims is read as one of the MoonViT families (Kimi-VL, Kimi-K2.5 / K2.6,
Kimi K3, LocateAnything-3B and this package's own), whose config keys and key maps live in
:mod:`moonvit.weights.formats`.

The families of other towers live in their own packages (``moonvit/families/vit/``: the classic
ViT and DeiT): config, key maps, the tower module, its processor rules. They share the packed
grid, the attention backends, packing, export and the probes through the encoder interface
(:class:`~moonvit.model.interface.VisionEncoder`) and its one output contract
(:class:`~moonvit.model.encoder.MoonViTOutput`: ``last_hidden_state`` (L, D) patch rows aligned
with ``pixel_values``, ``merged``, and, for towers with prefix tokens, ``prefix_tokens``,
``pooled`` and ``logits``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn

__all__ = ["Family", "find_family", "families", "register_family"]


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    Attributes:
        name: what the family is called in messages and docs (``classic-vit``).
        config_type: the class of its towers' configs (the loader builds ``build(config)`` for one).
        claims: ``claims(values)``: whether a ``config.json`` dict is this family's.
        read: ``read(values, where, names)``: the tower's config and the layout of its tensors
            (an object with ``name``, ``prefix`` and ``source(model_name)``, as
            :class:`~moonvit.weights.formats.TowerLayout`), from the ``config.json`` dict read from
            ``where`` and the folder's tensor names (empty before a hub snapshot has them).
            Raises ValueError naming what it cannot read.
        build: ``build(config)``: the tower module (built on the meta device by the loader).
        processors: the names of the processor rules the family's checkpoints take
            (:func:`moonvit.media.processor_for` reads them).
    """

    name: str
    config_type: type
    claims: Callable[[dict[str, Any]], bool]
    read: Callable[[dict[str, Any], Path, Collection[str]], tuple[Any, Any]]
    build: Callable[[Any], nn.Module]
    processors: tuple[str, ...] = ()


_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> None:
    """Add (or replace) a family; the loader asks every registered one before the MoonViT families."""
    _FAMILIES[family.name] = family


def families() -> tuple[Family, ...]:
    """The registered families, in registration order."""
    _load_builtin()
    return tuple(_FAMILIES.values())


def find_family(values: dict[str, Any]) -> Family | None:
    """The registered family whose ``config.json`` this is, or None (a MoonViT family's)."""
    for family in families():
        if family.claims(values):
            return family
    return None


def _load_builtin() -> None:
    # Each built-in family registers itself on import; imported here, lazily, so that the
    # weights package (which asks the registry) and the families (which use its layouts) do
    # not import each other at module level.
    from . import vit  # noqa: F401
