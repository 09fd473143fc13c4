"""Every checkpoint family the one loader reads, each described in one place.

A family is a small :class:`Family` spec: how to recognise its ``config.json``, how to read it
into the tower's config and its tensors' layout (given the folder's tensor names), which module
builds the tower, which processor rules its checkpoints take and which release, if any, this
package writes it as. :func:`moonvit.weights.checkpoint.read_config` asks :func:`find_family` for
every folder, so ``MoonViT.from_pretrained`` (which every command uses) loads any registered family.

The built-in families, each in its own module or package:

- :mod:`.moonvit`: the MoonViT families (Kimi-VL, Kimi-K2.5 / K2.6 in its release's keys and in
  transformers' ``kimi_k25``, Kimi K3, NVIDIA LocateAnything-3B, and this package's own folders);
- :mod:`.vit`: the classic ViT and DeiT (config, key maps, the tower module, its processor rules);
- :mod:`.dinov2`: DINOv2 and DINOv2 with registers (configs of the classic-ViT tower; transformers'
  and timm's folders);
- :mod:`.openvla`: OpenVLA's (Prismatic's) fused DINOv2 + SigLIP backbone and its projector.

A family that recognises a ``config.json`` by a mark of its own (a ``model_type``, a key only it
has) is *specific*; a family that takes whatever has a shape (any ``vision_config``: Kimi-VL's; no
``vision_config``: this package's own) is a *catch-all*, asked only after every specific family,
whenever it was registered. The towers share the packed grid, the attention backends, packing,
export and the probes through the encoder interface
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

__all__ = ["Family", "families", "family_named", "family_of", "find_family", "register_family"]


@dataclass(frozen=True)
class Family:
    """One checkpoint family.

    Attributes:
        name: what the family is called in messages and docs (``classic-vit``).
        config_type: the class of its towers' configs (the loader builds ``build(config)`` for one).
        claims: ``claims(values)``: whether a ``config.json`` dict is this family's.
        read: ``read(values, where, names)``: the tower's config and the layout of its tensors
            (an object with ``name``, ``prefix`` (a str, or a tuple of them) and ``source(model_name)``, as
            :class:`~moonvit.weights.formats.TowerLayout`, and optionally ``unused(name)``: tensors
            under ``prefix`` the tower knows and does not read, as DINOv2's mask token), from the
            ``config.json`` dict read from ``where`` and the folder's tensor names (read from the
            folder on first use; empty before a hub snapshot has them). Raises ValueError naming what it cannot read (a
            :class:`~moonvit.weights.formats.TensorLayoutError` where the tensors, not the
            ``config.json``, are at fault).
        build: ``build(config)``: the tower module (built on the meta device by the loader).
        processors: the names of the processor rules the family's checkpoints take
            (:func:`moonvit.media.processor_for` reads them; a MoonViT family's are the keys of
            :data:`moonvit.media.presets.FAMILY_RULES`).
        description: one line on what the family is (its releases, its ``config.json``'s mark).
        release: the ``(model_type, architecture)`` of the ``config.json`` its release layout is
            written with (``save_pretrained(..., layout="release")``); None where this package
            writes no release of the family (it reads them only, or writes its own layout).
        catch_all: whether :attr:`claims` takes configs by their shape alone (any ``vision_config``,
            none); a catch-all is asked only after every specific family (see :func:`find_family`).
        default_rule: the processor rule (one of :attr:`processors`) the commands read the family's
            folders by when none is named (``--image-rule``); None: the folder's own processor files
            (a MoonViT folder's ``preprocessor_config.json``), and no rule may be named
            (:func:`moonvit.encode.checkpoint_processors`).
        tower_name: what messages call the family's tower (``classic ViT / DeiT tower``); empty: the
            family's name and ``tower`` (:func:`moonvit.model.interface.tower_name`).

    The programs ask a tower's family (:func:`family_of`) for these two, never its class or ``model_type``.
    """

    name: str
    config_type: type
    claims: Callable[[dict[str, Any]], bool]
    read: Callable[[dict[str, Any], Path, Collection[str]], tuple[Any, Any]]
    build: Callable[[Any], nn.Module]
    processors: tuple[str, ...] = ()
    description: str = ""
    release: tuple[str, str] | None = None
    catch_all: bool = False
    default_rule: str | None = None
    tower_name: str = ""

    def __post_init__(self) -> None:
        if self.default_rule is not None and self.default_rule not in self.processors:
            raise ValueError(
                f"family {self.name!r}: default_rule {self.default_rule!r} is not one of its processor rules "
                f"({', '.join(self.processors) or 'none'})"
            )


_FAMILIES: dict[str, Family] = {}
_BUILTIN_STARTED = False


def register_family(family: Family) -> None:
    """Add (or replace, by name) a family; a specific one is asked before every catch-all."""
    _load_builtin()  # the built-in families first, so that a later one replaces them, not the reverse
    _FAMILIES[family.name] = family


def families() -> tuple[Family, ...]:
    """The registered families in the order the loader asks them: the specific ones, then the
    catch-alls, each in registration order."""
    _load_builtin()
    ordered = list(_FAMILIES.values())
    return tuple(sorted(ordered, key=lambda family: family.catch_all))  # stable: registration order kept


def find_family(values: dict[str, Any]) -> Family | None:
    """The family whose ``config.json`` this is: the first of :func:`families` that claims it (None
    only if no catch-all is registered)."""
    return next((family for family in families() if family.claims(values)), None)


def family_named(name: str) -> Family:
    """The registered family called ``name``.

    Raises:
        ValueError: no such family (the registered ones named).
    """
    for family in families():
        if family.name == name:
            return family
    raise ValueError(f"no checkpoint family {name!r} (registered: {', '.join(f.name for f in families())})")


def family_of(config: Any) -> Family | None:
    """The family a tower's config belongs to: the one its ``family`` attribute names, where it has one
    (a config class that several families build, each setting it); else the first registered family whose
    :attr:`Family.config_type` is the config's class, then one it is an instance of (the MoonViT families
    share :class:`~moonvit.model.config.MoonViTConfig`, and their hooks agree). None where no family
    builds that config (a caller's own encoder).

    Raises:
        ValueError: a ``family`` attribute naming no registered family.
    """
    name = getattr(config, "family", None)
    if isinstance(name, str) and name:
        return family_named(name)
    registered = families()
    exact = next((family for family in registered if type(config) is family.config_type), None)
    return exact or next((family for family in registered if isinstance(config, family.config_type)), None)


def _load_builtin() -> None:
    # Each built-in family registers itself on import; imported here, lazily, so that the
    # weights package (which asks the registry) and the families (which use its layouts) do
    # not import each other at module level. The guard keeps a re-entrant call (a family module
    # registering itself while this import runs) from importing again.
    global _BUILTIN_STARTED
    if _BUILTIN_STARTED:
        return
    _BUILTIN_STARTED = True
    # The specific families' claims do not overlap (tests/test_family_registry.py), so the order they
    # register in (which of them a program imports first) does not change what the loader reads.
    from . import dinov2, moonvit, openvla, siglip, vit  # noqa: F401
