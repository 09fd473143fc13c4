"""The checkpoint families the loader reads: their config keys and their tensor names.

Configs (``config.json``):

- this project's own: the :class:`MoonViTConfig` fields at the top level;
- Kimi-VL's: ``vision_config`` with ``model_type "moonvit"`` and the same field names;
- Kimi-K2.5 / K2.6 releases: ``vision_config`` with ``vt_hidden_size``,
  ``vt_num_hidden_layers``, ``vt_num_attention_heads``, ``vt_intermediate_size``,
  ``init_pos_emb_height / width / time``, ``pos_emb_type``, ``merge_type``,
  ``video_attn_type`` (read explicitly: transformers silently ignores the ``vt_``
  names) and the projector's ``mm_*`` fields;
- Kimi K3's (MoonViT-V2): the same ``vt_*`` keys and K3's switches,
  ``qkv_hidden_size``, ``norm_type``, ``attn_bias``, ``linear_bias``,
  ``patch_embed_proj_bias``, ``pos_emb_interpolation_mode`` (read under their
  own names; an RMSNorm tower without an eps key takes its dtype's epsilon);
- transformers' native ``kimi_k25``: ``vision_config`` with ``model_type
  "kimi_k25_vision"``, ``hidden_size``, ``pos_emb_height / width / time``,
  ``hidden_act`` and ``rope_parameters``;
- NVIDIA LocateAnything-3B's: top-level ``model_type "locateanything"``, a Kimi-VL
  ``vision_config`` (the tower is Kimi-VL's MoonViT with other weights).

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

LocateAnything's transformers-native layout (in review upstream: ``model.vision_tower.blocks.N.attn.wqkv``
with q / k rows permuted for a rotate-half RoPE, ``model.multi_modal_projector.*`` with a
post-merge norm) is refused by name: its permutation is not settled, and a tower loaded with
its rows in the wrong order runs without error and answers wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.config import MoonViTConfig
from .config_keys import warn_unread_keys

__all__ = [
    "BLOCK_RENAMES",
    "LOCATEANYTHING",
    "PROJECTOR_KEYS",
    "RELEASE_FAMILIES",
    "TOWER_PREFIXES",
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
_LOCATEANYTHING_PREFIX = "vision_model."

# Block submodules: ours (Kimi-VL's names) -> transformers' native names.
BLOCK_RENAMES = {"norm0": "norm1", "norm1": "norm2", "wo": "attn.proj", "mlp.fc0": "mlp.fc1", "mlp.fc1": "mlp.fc2"}

# The projector's settings, which K2.5 releases keep inside vision_config (read by the projector).
PROJECTOR_KEYS = frozenset(
    {"mm_projector_type", "mm_hidden_size", "text_hidden_size", "projector_hidden_act", "projector_ln_eps"}
)
_K25_RELEASE_KEYS = {
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_intermediate_size": "intermediate_size",
    "init_pos_emb_height": "init_pos_emb_height",
    "init_pos_emb_width": "init_pos_emb_width",
    "init_pos_emb_time": "init_pos_emb_time",
    "patch_size": "patch_size",
    "merge_kernel_size": "merge_kernel_size",
}
# Kimi K3's switches, under the names of MoonViTConfig's fields (its __post_init__ names a bad value).
_K3_KEYS = {
    name: name
    for name in (
        "qkv_hidden_size", "norm_type", "layer_norm_eps", "attn_bias", "linear_bias", "patch_embed_proj_bias",
        "pos_emb_interpolation_mode",
    )
}  # fmt: skip
# The one value the K2.5 and K3 code accepts for each architecture switch.
_K25_SWITCHES = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal",
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
}
_K25_NATIVE_KEYS = {
    "hidden_size": "hidden_size",
    "num_hidden_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size",
    "pos_emb_height": "init_pos_emb_height",
    "pos_emb_width": "init_pos_emb_width",
    "pos_emb_time": "init_pos_emb_time",
    "patch_size": "patch_size",
    "merge_kernel_size": "merge_kernel_size",
}
_KIMI_VL_KEYS = {
    name: name
    for name in (
        "patch_size", "init_pos_emb_height", "init_pos_emb_width", "num_attention_heads", "num_hidden_layers",
        "hidden_size", "intermediate_size", "merge_kernel_size",
    )
}  # fmt: skip
# The switches K2.5's release config carries (K3's carries all of _K25_SWITCHES).
_K25_RELEASE_SWITCHES = ("pos_emb_type", "merge_type", "video_attn_type")

RELEASE_FAMILIES = ("kimi-vl", "kimi-k25", "kimi-k3", LOCATEANYTHING)
"""The families whose release layout :func:`encoder_config_to_json` writes (names as
:func:`encoder_config_from_json` returns them)."""
# Each release's config.json: model_type and architectures at the top level.
_RELEASE_MODELS = {
    "kimi-vl": ("kimi_vl", "KimiVLForConditionalGeneration"),
    "kimi-k25": ("kimi_k25", "KimiK25ForConditionalGeneration"),
    "kimi-k3": ("kimi_k3", "KimiK3ForConditionalGeneration"),
    LOCATEANYTHING: (LOCATEANYTHING, "LocateAnythingForConditionalGeneration"),
}


def _mapped(values: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {ours: values[theirs] for theirs, ours in names.items() if theirs in values}


def _unmapped(config: MoonViTConfig, names: dict[str, str]) -> dict[str, Any]:
    """The inverse of :func:`_mapped`: the checkpoint's keys ``names`` of ``config``'s fields, as JSON
    values (a None field left out: a missing key reads as None)."""
    values = {theirs: getattr(config, ours) for theirs, ours in names.items()}
    return {
        key: list(value) if isinstance(value, tuple) else value for key, value in values.items() if value is not None
    }


def encoder_config_to_json(config: MoonViTConfig, family: str) -> dict[str, Any]:
    """The tower's part of a ``family`` release's ``config.json`` (a name of :data:`RELEASE_FAMILIES`): the
    top-level ``model_type`` and ``architectures``, and ``vision_config`` as the release nests it, its keys
    the inverse of those :func:`encoder_config_from_json` reads for that family.

    Fields the release has no key for (``rope_theta``, a K2.5 tower's ``layer_norm_eps``, ...) are not
    written: read back, they take the family's value (:func:`moonvit.weights.release.save_release`
    refuses a tower whose config does not read back as it is).
    """
    if family not in RELEASE_FAMILIES:
        raise ValueError(f"no release layout for the family {family!r} (expected one of {', '.join(RELEASE_FAMILIES)})")
    if family in ("kimi-vl", LOCATEANYTHING):
        vision = {"model_type": "moonvit", **_unmapped(config, _KIMI_VL_KEYS)}
    else:
        switches = _K25_SWITCHES if family == "kimi-k3" else {k: _K25_SWITCHES[k] for k in _K25_RELEASE_SWITCHES}
        vision = {**_unmapped(config, _K25_RELEASE_KEYS), **switches}
        if family == "kimi-k3":
            vision.update(_unmapped(config, _K3_KEYS))
    model_type, architecture = _RELEASE_MODELS[family]
    return {"model_type": model_type, "architectures": [architecture], "vision_config": vision}


def encoder_config_from_json(values: dict[str, Any], where: str | Path) -> tuple[MoonViTConfig, str]:
    """The encoder config of a ``config.json`` dict, and the family it was read as.

    Families: ``"own"``, ``"kimi-vl"``, ``"kimi-k25"`` (release keys), ``"kimi-k3"`` (release
    keys with K3's switches), ``"kimi-k25-transformers"`` and ``"locateanything"`` (Kimi-VL's keys).
    Keys the package does not read are named in one warning
    (:func:`~moonvit.weights.config_keys.warn_unread_keys`); ``where`` names the file.

    Raises:
        ValueError: an architecture switch this package does not implement
            (``pos_emb_type``, ``merge_type``, ``video_attn_type``, ``mlp_type``,
            ``activation_func``, ``hidden_act``), or values MoonViTConfig refuses (an unknown
            ``norm_type`` or ``pos_emb_interpolation_mode``, a bias switch that is not a bool).
    """
    vision = values.get("vision_config")
    if vision is not None and not isinstance(vision, dict):
        raise ValueError(f"vision_config is a {type(vision).__name__}, not an object")
    if vision is None:
        own = set(MoonViTConfig.__dataclass_fields__)
        warn_unread_keys(where, values, own)
        return MoonViTConfig.from_dict(values), "own"
    vision_where = where
    if any(key.startswith("vt_") for key in vision):
        for key, supported in _K25_SWITCHES.items():
            if key in vision and vision[key] != supported:
                raise ValueError(f"vision_config: {key} {vision[key]!r} is not supported (only {supported!r})")
        warn_unread_keys(vision_where, vision, {*_K25_RELEASE_KEYS, *_K3_KEYS, *_K25_SWITCHES, *PROJECTOR_KEYS})
        fields = {**_mapped(vision, _K25_RELEASE_KEYS), **_mapped(vision, _K3_KEYS)}
        fields.setdefault("init_pos_emb_time", 4)
        if fields.get("norm_type") == "rmsnorm":
            fields.setdefault("layer_norm_eps", None)  # built with no eps: the dtype's, as K3 does
        k3 = values.get("model_type") == "kimi_k3" or any(key in vision for key in _K3_KEYS)
        return MoonViTConfig(**fields), "kimi-k3" if k3 else "kimi-k25"
    if vision.get("model_type") == "kimi_k25_vision" or values.get("model_type") == "kimi_k25":
        activation = vision.get("hidden_act", "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config: hidden_act {activation!r} is not supported (only 'gelu_pytorch_tanh')")
        rope = vision.get("rope_parameters") or {}
        warn_unread_keys(vision_where, vision, {*_K25_NATIVE_KEYS, "hidden_act", "rope_parameters"})
        fields = _mapped(vision, _K25_NATIVE_KEYS)
        fields.setdefault("init_pos_emb_time", 4)
        if "rope_theta" in rope:
            fields["rope_theta"] = float(rope["rope_theta"])
        return MoonViTConfig(**fields), "kimi-k25-transformers"
    if values.get("model_type") == LOCATEANYTHING:
        if vision.get("model_type", "moonvit") != "moonvit":
            raise ValueError(f"vision_config: model_type {vision['model_type']!r} is not LocateAnything's 'moonvit'")
        warn_unread_keys(vision_where, vision, _KIMI_VL_KEYS)
        return MoonViTConfig(**_mapped(vision, _KIMI_VL_KEYS)), LOCATEANYTHING
    warn_unread_keys(vision_where, vision, {*_KIMI_VL_KEYS, *PROJECTOR_KEYS})
    return MoonViTConfig(**_mapped(vision, _KIMI_VL_KEYS)), "kimi-vl"


# ---- tensor layouts --------------------------------------------------------------------------


Transform = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorSource:
    """Where one of the model's tensors comes from: one checkpoint tensor, or several
    concatenated along dim 0, each part first passed through its ``transforms`` entry
    (a shape-preserving function, or None); ``inverses`` undo them, for writing
    (:meth:`split`)."""

    names: tuple[str, ...]
    transforms: tuple[Transform | None, ...] = ()
    inverses: tuple[Transform | None, ...] = ()

    def part_shape(self, wanted: Sequence[int]) -> tuple[int, ...]:
        """Each part's expected shape, for a model tensor of shape ``wanted``."""
        return (wanted[0] // len(self.names), *wanted[1:]) if len(self.names) > 1 else tuple(wanted)

    def combine(self, parts: list[torch.Tensor]) -> torch.Tensor:
        transforms = self.transforms or (None,) * len(parts)
        done = [part if fn is None else fn(part) for part, fn in zip(parts, transforms)]
        return done[0] if len(done) == 1 else torch.cat(done)

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of :meth:`combine`: the checkpoint's parts of the model tensor ``tensor``
        (each (rows / len(names), ...) where there are several), in :attr:`names` order."""
        if len(self.transforms) != len(self.inverses):
            raise ValueError(f"{self.names}: a transform without its inverse cannot be written")
        parts = list(tensor.chunk(len(self.names))) if len(self.names) > 1 else [tensor]
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


@dataclass(frozen=True)
class TowerLayout:
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

    def checkpoint_tensors(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors, by name, of a model state dict: the exact inverse of
        :meth:`source` (parts split, permutations undone), so that loading them gives ``state`` back."""
        tensors: dict[str, torch.Tensor] = {}
        for model_name, tensor in state.items():
            source = self.source(model_name)
            tensors.update(zip(source.names, source.split(tensor)))
        return tensors

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


def release_tower_layout(family: str) -> TowerLayout:
    """The layout a ``family`` release (a name of :data:`RELEASE_FAMILIES`) keeps its tower in:
    ``vision_tower.`` + this package's names, ``vision_model.`` for LocateAnything."""
    return TowerLayout("release", _LOCATEANYTHING_PREFIX if family == LOCATEANYTHING else TOWER_PREFIXES[0])


def detect_tower_layout(names: Collection[str], family: str, heads: int) -> TowerLayout:
    """The layout of a folder's tower tensors from their names (``names``: every tensor of the folder).

    The own family is always ``own``; the Kimi families are told apart by the names
    themselves, since transformers writes all three with the same config. LocateAnything's
    release is ``release`` under ``vision_model.``.

    Raises:
        ValueError: a LocateAnything config over tensors that are not its release's (a Kimi-VL
            tower mislabelled, or the transformers-native layout this package refuses), named.
    """
    if family == "own":
        return TowerLayout("own", "")
    if family == LOCATEANYTHING:
        return _locateanything_layout(names)
    if any(name.startswith(_LOCATEANYTHING_PREFIX) for name in names) and not any(
        name.startswith(TOWER_PREFIXES[:2]) for name in names
    ):
        raise ValueError(
            f"the folder's tower tensors are {_LOCATEANYTHING_PREFIX}* (LocateAnything's names), but config.json is "
            f"read as {family}: a LocateAnything release's config.json has model_type {LOCATEANYTHING!r}"
        )
    if any(name.startswith("model.vision_tower.layers.") for name in names):
        return TowerLayout("native", "model.vision_tower.", heads)
    if "vision_tower.encoder.patch_embed.proj.weight" in names:
        return TowerLayout("hybrid", "vision_tower.")
    return TowerLayout("release", "vision_tower.")


def _locateanything_layout(names: Collection[str]) -> TowerLayout:
    # No names yet: a hub snapshot before its index is fetched.
    if not names or any(name.startswith(_LOCATEANYTHING_PREFIX) for name in names):
        return TowerLayout("release", _LOCATEANYTHING_PREFIX)
    if any(name.startswith("model.vision_tower.") for name in names):
        raise ValueError(
            "this is LocateAnything's transformers-native layout (model.vision_tower.blocks.N.attn.wqkv, q / k rows "
            "permuted for a rotate-half RoPE, model.multi_modal_projector.*), which this package does not load: its "
            "RoPE permutation is not settled upstream, and a tower read with its rows in the wrong order answers "
            "wrong without an error. Load the release folder (tensors vision_model.* and mlp1.*)"
        )
    found = sorted({name.split(".", 1)[0] + "." for name in names})
    hint = (
        "; vision_tower.* is a Kimi-VL release's tower: is its config.json mislabelled?"
        if "vision_tower." in found
        else ""
    )
    raise ValueError(
        f"config.json says LocateAnything (model_type {LOCATEANYTHING!r}), whose tower tensors are "
        f"{_LOCATEANYTHING_PREFIX}*, but the folder has none (its tensors start with {', '.join(found)}{hint})"
    )
