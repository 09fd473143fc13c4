"""The tensor layouts of the MoonViT tower, and the compatibility readers of the MoonViT families.

The families themselves (their ``config.json`` keys, how each is recognised, which layout its
tensors are in, what its release writes) are specs in :mod:`moonvit.families.moonvit`; the functions
here that read or write a family's config (:func:`encoder_config_from_json`,
:func:`encoder_config_to_json`, :func:`detect_tower_layout`, :func:`release_tower_layout`) ask them.

Tensor layouts of the tower (the same weights under four sets of names):

- ``own``: this project's names (``encoder.blocks.N.wqkv``, ...), no prefix;
- ``release``: Kimi-VL's and Kimi-K2.5's, ``vision_tower.`` + the same names; LocateAnything's,
  ``vision_model.`` + the same names;
- ``hybrid``: what transformers 5.x's ``save_pretrained`` writes for a
  ``kimi_k25`` model: the release names, except
  ``vision_tower.encoder.patch_embed.proj.*``;
- ``native``: transformers' in-memory names (``model.vision_tower.layers.N.attn.q_proj``,
  ``norm1 / norm2``, ``mlp.fc1 / fc2``, ``attn.proj``,
  ``patch_embed.pos_emb.position_embeddings``) with q / k rows permuted per
  head from interleaved RoPE pairs to halves; they are permuted back here.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..model.config import MoonViTConfig

__all__ = [
    "BLOCK_RENAMES",
    "LOCATEANYTHING",
    "PROJECTOR_KEYS",
    "TOWER_PREFIXES",
    "TensorLayoutError",
    "TensorSource",
    "TowerLayout",
    "detect_tower_layout",
    "encoder_config_from_json",
    "encoder_config_to_json",
    "permute_rope_rows",
    "release_tower_layout",
    "unpermute_rope_rows",
]

# Every layout's tower tensors start with one of these (own folders: no prefix).
TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.", "vision_model.")

LOCATEANYTHING = "locateanything"
"""The top-level ``model_type`` of NVIDIA's LocateAnything-3B, and its family's name here."""
# Block submodules: ours (Kimi-VL's names) -> transformers' native names.
BLOCK_RENAMES = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}

# The projector's settings, which K2.5 releases keep inside vision_config (read by the projector).
PROJECTOR_KEYS = frozenset(
    {"mm_projector_type", "mm_hidden_size", "text_hidden_size", "projector_hidden_act", "projector_ln_eps"}
)


# ---- tensor layouts --------------------------------------------------------------------------


Transform = Callable[[torch.Tensor], torch.Tensor]


class TensorLayoutError(ValueError):
    """A folder's tensor names that do not fit its ``config.json`` (another family's tower, a layout
    this package refuses): the loader names the folder, not the file."""


@dataclass(frozen=True)
class TensorSource:
    """Where one of the model's tensors comes from: one checkpoint tensor, or several
    concatenated along dim 0, each part first passed through its ``transforms`` entry
    (a function, or None); ``inverses`` undo them, for writing (:meth:`split`).

    The parts split dim 0 equally unless ``shares`` gives their relative sizes (timm's MAP head:
    ``q`` and ``kv``, 1 : 2). A checkpoint that stores a part in another shape than the model's
    (SigLIP's (N, D) table for the tower's (1, N, D), SigLIP2's flattened patch weight) says so with
    ``stored_shape``: the stored shape of a part of the given model shape, which the loader checks;
    the part's transform then turns the stored tensor into the model's shape and its inverse back.
    """

    names: tuple[str, ...]
    transforms: tuple[Transform | None, ...] = ()
    inverses: tuple[Transform | None, ...] = ()
    shares: tuple[int, ...] = ()
    stored_shape: Callable[[tuple[int, ...]], tuple[int, ...]] | None = None

    def part_rows(self, rows: int) -> list[int]:
        """Each part's rows of a model tensor with ``rows`` rows along dim 0, in :attr:`names` order."""
        shares = self.shares or (1,) * len(self.names)
        if len(shares) != len(self.names):
            raise ValueError(f"{self.names}: {len(shares)} shares for {len(self.names)} parts")
        return [rows * share // sum(shares) for share in shares]

    def part_shape(self, wanted: Sequence[int], index: int = 0) -> tuple[int, ...]:
        """Part ``index``'s expected shape in the checkpoint, for a model tensor of shape ``wanted``."""
        shape = (self.part_rows(wanted[0])[index], *wanted[1:]) if len(self.names) > 1 else tuple(wanted)
        return shape if self.stored_shape is None else self.stored_shape(shape)

    def combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        transforms = self.transforms or (None,) * len(parts)
        done = [part if fn is None else fn(part) for part, fn in zip(parts, transforms)]
        return done[0] if len(done) == 1 else torch.cat(done)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`combine`: the checkpoint's parts of the model tensor ``tensor``
        (each its :meth:`part_rows` where there are several), in :attr:`names` order."""
        if len(self.transforms) != len(self.inverses):
            raise ValueError(f"{self.names}: a transform without its inverse cannot be written")
        parts = list(tensor.split(self.part_rows(tensor.shape[0]))) if len(self.names) > 1 else [tensor]
        inverses = self.inverses or (None,) * len(parts)
        return [part if fn is None else fn(part) for part, fn in zip(parts, inverses)]


def unpermute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo transformers' ``PermuteForRope`` on q or k rows (weight or bias): per head, rows laid
    out as [36 real parts | 36 imaginary parts] go back to 36 interleaved (real, imaginary) pairs."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    return tensor.reshape(heads, 2, half, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


def permute_rope_rows(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of :func:`unpermute_rope_rows` (transformers' ``PermuteForRope``): per head, interleaved
    (real, imaginary) row pairs to [real parts | imaginary parts]."""
    rows = tensor.shape[0]
    half = rows // heads // 2
    return tensor.reshape(heads, half, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)


class TensorLayout:
    """A folder's naming of a tower's tensors: where each of the model's state-dict entries comes from
    (:meth:`source`), and so the folder's tensors of a state dict (:meth:`checkpoint_tensors`)."""

    def source(self, model_name: str) -> TensorSource:
        raise NotImplementedError

    def checkpoint_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, by name, of a model state dict: the exact inverse of
        :meth:`source` (parts split, permutations undone), so that loading them gives ``state`` back."""
        tensors: dict[str, torch.Tensor] = {}
        for model_name, tensor in state.items():
            source = self.source(model_name)
            tensors.update(zip(source.names, source.split(tensor)))
        return tensors


@dataclass(frozen=True)
class TowerLayout(TensorLayout):
    """How a checkpoint names the tower's tensors.

    Attributes:
        name: ``own``, ``release``, ``hybrid`` or ``native`` (see the module docstring).
        prefix: every tower tensor's name starts with it (used to find the shards).
        heads: attention heads, for the native layout's q / k un-permutation.
    """

    name: str
    prefix: str
    heads: int = 1

    def source(self, model_name: str) -> TensorSource:
        """Where the model's state-dict entry ``model_name`` comes from."""
        if self.name in ("own", "release"):
            return TensorSource((self.prefix + model_name,))
        if self.name == "hybrid":
            if model_name.startswith("patch_embed.proj."):
                return TensorSource(("vision_tower.encoder." + model_name,))
            return TensorSource((self.prefix + model_name,))
        return self._native(model_name)

    def _native(self, model_name: str) -> TensorSource:
        root = "model.vision_tower."
        if model_name == "patch_embed.pos_emb.weight":
            return TensorSource((root + "patch_embed.pos_emb.position_embeddings",))
        if model_name.startswith("encoder.final_layernorm."):
            return TensorSource((root + model_name.removeprefix("encoder."),))
        if not model_name.startswith("encoder.blocks."):
            return TensorSource((root + model_name,))
        index, rest = model_name.removeprefix("encoder.blocks.").split(".", 1)
        module, kind = rest.rsplit(".", 1)
        layer = f"{root}layers.{index}."
        if module == "wqkv":

            def unpermute(t: torch.Tensor) -> torch.Tensor:
                return unpermute_rope_rows(t, self.heads)

            def permute(t: torch.Tensor) -> torch.Tensor:
                return permute_rope_rows(t, self.heads)

            names = tuple(f"{layer}attn.{p}_proj.{kind}" for p in "qkv")
            return TensorSource(names, (unpermute, unpermute, None), (permute, permute, None))
        return TensorSource((f"{layer}{BLOCK_RENAMES[module]}.{kind}",))


# ---- the MoonViT families: compatibility functions that ask their specs ------------------------


def __getattr__(name: str) -> Any:
    # RELEASE_FAMILIES (the names of the families with a release layout) is the registry's now: a family
    # registered later with one is in it.
    if name == "RELEASE_FAMILIES":
        from ..families.moonvit import release_families

        return release_families()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def encoder_config_from_json(values: dict[str, Any], where: str | Path) -> tuple[MoonViTConfig, str]:
    """The encoder config of a MoonViT family's ``config.json`` dict, and the name of the family it was
    read as (:func:`moonvit.families.moonvit.moonvit_family`: ``"own"``, ``"kimi-vl"``, ``"kimi-k25"``,
    ``"kimi-k3"``, ``"kimi-k25-transformers"`` or ``"locateanything"``). Keys the family does not read
    are named in one warning; ``where`` names the file.

    Raises:
        ValueError: an architecture switch this package does not implement, or values
            MoonViTConfig refuses (see each family's reader).
    """
    from ..families.moonvit import moonvit_family  # the families build on this module

    family = moonvit_family(values)
    config, _ = family.read(values, Path(where), ())
    return config, family.name


def encoder_config_to_json(config: MoonViTConfig, family: str) -> dict[str, Any]:
    """The tower's part of a ``family`` release's ``config.json`` (see
    :func:`moonvit.families.moonvit.release_config_json`): the top-level ``model_type`` and
    ``architectures``, and ``vision_config`` as the release nests it, its keys the inverse of those
    :func:`encoder_config_from_json` reads for that family.

    Fields the release has no key for (``rope_theta``, a K2.5 tower's ``layer_norm_eps``, ...) are not
    written: read back, they take the family's value (:func:`moonvit.weights.release.save_release`
    refuses a tower whose config does not read back as it is).

    Raises:
        ValueError: a family without a release layout.
    """
    from ..families.moonvit import release_config_json

    return release_config_json(config, family)


def release_tower_layout(family: str) -> TowerLayout:
    """The layout a ``family`` release keeps its tower in (see
    :func:`moonvit.families.moonvit.release_tower_layout`): ``vision_tower.`` + this package's names,
    ``vision_model.`` for LocateAnything.

    Raises:
        ValueError: a family without a release layout.
    """
    from ..families.moonvit import release_tower_layout as layout

    return layout(family)


def detect_tower_layout(names: Collection[str], family: str, heads: int) -> TowerLayout:
    """The layout of a folder's tower tensors from their names (``names``: every tensor of the folder),
    for a config read as ``family`` (a MoonViT family's name).

    The own family is always ``own``; the Kimi families are told apart by the names themselves
    (:func:`moonvit.families.moonvit.kimi_layout`). LocateAnything's release is ``release`` under
    ``vision_model.`` (:func:`moonvit.families.moonvit.locateanything_layout`).

    Raises:
        TensorLayoutError: a LocateAnything config over tensors that are not its release's (a Kimi-VL
            tower mislabelled, or the transformers-native layout this package refuses), or
            LocateAnything's tensors under another family's config, named.
    """
    from ..families.moonvit import kimi_layout, locateanything_layout

    if family == "own":
        return TowerLayout("own", "")
    if family == LOCATEANYTHING:
        return locateanything_layout(names)
    return kimi_layout(names, family, heads)
