"""The MoonViT families: one :class:`~moonvit.families.Family` spec each, with its config keys,
how its folders name the tower's tensors and what its release writes.

Every family here builds the same tower (:class:`~moonvit.model.encoder.MoonViT`, configured by
:class:`~moonvit.model.config.MoonViTConfig`): no prefix tokens, a 2D position table resampled to
each grid (bicubic, or K3's ``pos_emb_interpolation_mode``), outputs ``last_hidden_state`` (L, D)
and ``merged`` (L / 4, 4, D). They differ in their ``config.json`` keys and tensor names:

- ``kimi-k3`` (Kimi K3, MoonViT-V2): ``vision_config`` with K2.5's ``vt_*`` keys and K3's switches,
  ``qkv_hidden_size``, ``norm_type``, ``attn_bias``, ``linear_bias``, ``patch_embed_proj_bias``,
  ``pos_emb_interpolation_mode`` (read under their own names; an RMSNorm tower without an eps key
  takes its dtype's epsilon). Marked by top-level ``model_type "kimi_k3"`` or any switch key.
- ``kimi-k25`` (Kimi-K2.5 / K2.6 releases): ``vision_config`` with ``vt_hidden_size``,
  ``vt_num_hidden_layers``, ``vt_num_attention_heads``, ``vt_intermediate_size``,
  ``init_pos_emb_height / width / time``, ``pos_emb_type``, ``merge_type``, ``video_attn_type``
  (read explicitly: transformers silently ignores the ``vt_`` names) and the projector's ``mm_*``
  fields. Marked by a ``vt_`` key.
- ``kimi-k25-transformers`` (transformers' native ``kimi_k25``): ``vision_config`` with
  ``model_type "kimi_k25_vision"`` (or top-level ``"kimi_k25"``), ``hidden_size``,
  ``pos_emb_height / width / time``, ``hidden_act`` and ``rope_parameters``; its tensors in
  transformers' native names or in the hybrid ones its ``save_pretrained`` writes.
- ``locateanything`` (NVIDIA LocateAnything-3B): top-level ``model_type "locateanything"``, a
  Kimi-VL ``vision_config``, the tower under ``vision_model.``. A Kimi-VL tower labelled
  LocateAnything, its tower labelled otherwise and its transformers-native layout (in review
  upstream: q / k rows permuted for a rotate-half RoPE, not settled) are refused by name.
- ``kimi-vl`` (Kimi-VL, catch-all): any other ``vision_config``, in :class:`MoonViTConfig`'s own
  field names (``model_type "moonvit"``).
- ``own`` (this package's folders, MoonViT-SO-400M's standalone layout; catch-all): no
  ``vision_config``, the :class:`MoonViTConfig` fields at the top level, unprefixed tensor names.

The Kimi families' tensors are told apart by their names (:func:`kimi_layout`), since transformers
writes all three with the same config; the layouts themselves (``own``, ``release``, ``hybrid``,
``native``) are :class:`~moonvit.weights.formats.TowerLayout`. Keys a family does not read are
named in one warning (:func:`~moonvit.weights.config_keys.warn_unread_keys`). The processor rules
named in each spec are :data:`moonvit.media.presets.FAMILY_RULES`'s; projectors and prompts are
read beside the tower (:mod:`moonvit.weights.projector`, :mod:`moonvit_projector.prompt`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..model.config import MoonViTConfig
from ..model.encoder import MoonViT
from ..weights.config_keys import warn_unread_keys
from ..weights.formats import LOCATEANYTHING, PROJECTOR_KEYS, TOWER_PREFIXES, TensorLayoutError, TowerLayout
from . import Family, families, register_family

__all__ = [
    "MOONVIT_FAMILIES",
    "MoonViTFamily",
    "kimi_layout",
    "locateanything_layout",
    "moonvit_family",
    "release_config_json",
    "release_families",
    "release_family",
    "release_tower_layout",
]


@dataclass(frozen=True)
class MoonViTFamily(Family):
    """A MoonViT family: a :class:`~moonvit.families.Family` and what its release layout writes.

    Attributes:
        tower_prefix: the prefix of the tower's tensors in its release (``vision_tower.``,
            LocateAnything's ``vision_model.``); ``""`` where it has no release layout.
        write_vision: ``write_vision(config)``: the release's ``vision_config``, the inverse of
            :attr:`read`'s keys (fields the release has no key for are left out: read back, they
            take the family's value); None where the family has no release layout.
        tower_name: ``MoonViT tower``, every MoonViT family's (their folders bring their processor files:
            ``default_rule`` None).
    """

    tower_prefix: str = ""
    write_vision: Callable[[MoonViTConfig], dict[str, Any]] | None = None
    tower_name: str = "MoonViT tower"


# ---- shared by the families -------------------------------------------------------------------

# The one value the K2.5 and K3 code accepts for each architecture switch.
K25_SWITCHES = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal",
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",
}
# Kimi-VL's vision_config (and LocateAnything's): MoonViTConfig's own field names.
KIMI_VL_KEYS = {
    name: name
    for name in (
        "patch_size", "init_pos_emb_height", "init_pos_emb_width", "num_attention_heads", "num_hidden_layers",
        "hidden_size", "intermediate_size", "merge_kernel_size",
    )
}  # fmt: skip


def _vision(values: dict[str, Any]) -> dict[str, Any] | None:
    """``vision_config`` where it is an object (anything else is no specific family's)."""
    vision = values.get("vision_config")
    return vision if isinstance(vision, dict) else None


def _has_release_keys(vision: dict[str, Any]) -> bool:
    return any(key.startswith("vt_") for key in vision)


def _mapped(values: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``config.json`` keys ``names`` (theirs -> ours) of ``values``, under MoonViTConfig's field names."""
    return {ours: values[theirs] for theirs, ours in names.items() if theirs in values}


def _unmapped(config: MoonViTConfig, names: dict[str, str]) -> dict[str, Any]:
    """The inverse of :func:`_mapped`: the checkpoint's keys ``names`` of ``config``'s fields, as JSON
    values (a None field left out: a missing key reads as None)."""
    values = {theirs: getattr(config, ours) for theirs, ours in names.items()}
    return {
        key: list(value) if isinstance(value, tuple) else value for key, value in values.items() if value is not None
    }


def kimi_layout(names: Collection[str], family: str, heads: int) -> TowerLayout:
    """The layout of a Kimi family's tower tensors, told apart by their names (transformers writes
    all three with the same config): ``native`` (``model.vision_tower.layers.N``), ``hybrid``
    (``vision_tower.encoder.patch_embed.proj``) or ``release`` (also for no names yet: a hub
    snapshot before its index is fetched).

    Raises:
        TensorLayoutError: the tower is under LocateAnything's ``vision_model.`` (a LocateAnything
            release whose config.json is read as ``family``).
    """
    locate = TOWER_PREFIXES[2]
    if any(name.startswith(locate) for name in names) and not any(
        name.startswith(TOWER_PREFIXES[:2]) for name in names
    ):
        raise TensorLayoutError(
            f"the folder's tower tensors are {locate}* (LocateAnything's names), but config.json is "
            f"read as {family}: a LocateAnything release's config.json has model_type {LOCATEANYTHING!r}"
        )
    if any(name.startswith("model.vision_tower.layers.") for name in names):
        return TowerLayout("native", "model.vision_tower.", heads)
    if "vision_tower.encoder.patch_embed.proj.weight" in names:
        return TowerLayout("hybrid", "vision_tower.")
    return TowerLayout("release", "vision_tower.")


# ---- Kimi K3 (MoonViT-V2) and Kimi-K2.5 / K2.6 releases: the vt_* keys ------------------------------

K25_RELEASE_KEYS = {
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
# The switches K2.5's release config carries (K3's carries all of K25_SWITCHES).
K25_RELEASE_SWITCHES = ("pos_emb_type", "merge_type", "video_attn_type")
# Kimi K3's switches, under the names of MoonViTConfig's fields (its __post_init__ names a bad value).
K3_KEYS = {
    name: name
    for name in (
        "qkv_hidden_size", "norm_type", "layer_norm_eps", "attn_bias", "linear_bias", "patch_embed_proj_bias",
        "pos_emb_interpolation_mode",
    )
}  # fmt: skip


def _is_k3(values: dict[str, Any], vision: dict[str, Any]) -> bool:
    return values.get("model_type") == "kimi_k3" or any(key in vision for key in K3_KEYS)


def _claims_k3(values: dict[str, Any]) -> bool:
    vision = _vision(values)
    return vision is not None and _has_release_keys(vision) and _is_k3(values, vision)


def _claims_k25(values: dict[str, Any]) -> bool:
    vision = _vision(values)
    return vision is not None and _has_release_keys(vision) and not _is_k3(values, vision)


def _config_from_release_keys(vision: dict[str, Any], where: str | Path) -> MoonViTConfig:
    """The tower of a K2.5 or K3 release's ``vision_config``: the ``vt_*`` sizes, K3's switches where
    present, each architecture switch checked against the one value the release's code accepts."""
    for key, supported in K25_SWITCHES.items():
        if key in vision and vision[key] != supported:
            raise ValueError(f"vision_config: {key} {vision[key]!r} is not supported (only {supported!r})")
    warn_unread_keys(where, vision, {*K25_RELEASE_KEYS, *K3_KEYS, *K25_SWITCHES, *PROJECTOR_KEYS})
    fields = {**_mapped(vision, K25_RELEASE_KEYS), **_mapped(vision, K3_KEYS)}
    fields.setdefault("init_pos_emb_time", 4)
    if fields.get("norm_type") == "rmsnorm":
        fields.setdefault("layer_norm_eps", None)  # built with no eps: the dtype's, as K3 does
    return MoonViTConfig(**fields)


def _read_k3(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[MoonViTConfig, TowerLayout]:
    config = _config_from_release_keys(values["vision_config"], where)
    return config, kimi_layout(names, "kimi-k3", config.num_attention_heads)


def _read_k25(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[MoonViTConfig, TowerLayout]:
    config = _config_from_release_keys(values["vision_config"], where)
    return config, kimi_layout(names, "kimi-k25", config.num_attention_heads)


def _write_k3(config: MoonViTConfig) -> dict[str, Any]:
    return {**_unmapped(config, K25_RELEASE_KEYS), **K25_SWITCHES, **_unmapped(config, K3_KEYS)}


def _write_k25(config: MoonViTConfig) -> dict[str, Any]:
    return {**_unmapped(config, K25_RELEASE_KEYS), **{key: K25_SWITCHES[key] for key in K25_RELEASE_SWITCHES}}


KIMI_K3 = MoonViTFamily(
    name="kimi-k3",
    config_type=MoonViTConfig,
    claims=_claims_k3,
    read=_read_k3,
    build=MoonViT,
    processors=("Kimi K3",),
    description="Kimi K3 (MoonViT-V2): K2.5's vt_* keys with K3's switches (no biases, RMSNorm, wider attention)",
    release=("kimi_k3", "KimiK3ForConditionalGeneration"),
    tower_prefix="vision_tower.",
    write_vision=_write_k3,
)
KIMI_K25 = MoonViTFamily(
    name="kimi-k25",
    config_type=MoonViTConfig,
    claims=_claims_k25,
    read=_read_k25,
    build=MoonViT,
    processors=("Kimi-K2.5",),
    description="Kimi-K2.5 / K2.6 releases (MoonViT3d): vt_* keys in vision_config, a 4-frame temporal table",
    release=("kimi_k25", "KimiK25ForConditionalGeneration"),
    tower_prefix="vision_tower.",
    write_vision=_write_k25,
)


# ---- transformers' kimi_k25 -----------------------------------------------------------------------

K25_NATIVE_KEYS = {
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


def _is_k25_transformers(values: dict[str, Any], vision: dict[str, Any]) -> bool:
    return vision.get("model_type") == "kimi_k25_vision" or values.get("model_type") == "kimi_k25"


def _claims_k25_transformers(values: dict[str, Any]) -> bool:
    vision = _vision(values)
    return vision is not None and not _has_release_keys(vision) and _is_k25_transformers(values, vision)


def _read_k25_transformers(
    values: dict[str, Any], where: Path, names: Collection[str]
) -> tuple[MoonViTConfig, TowerLayout]:
    vision = values["vision_config"]
    activation = vision.get("hidden_act", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise ValueError(f"vision_config: hidden_act {activation!r} is not supported (only 'gelu_pytorch_tanh')")
    rope = vision.get("rope_parameters") or {}
    warn_unread_keys(where, vision, {*K25_NATIVE_KEYS, "hidden_act", "rope_parameters"})
    fields = _mapped(vision, K25_NATIVE_KEYS)
    fields.setdefault("init_pos_emb_time", 4)
    if "rope_theta" in rope:
        fields["rope_theta"] = float(rope["rope_theta"])
    config = MoonViTConfig(**fields)
    return config, kimi_layout(names, "kimi-k25-transformers", config.num_attention_heads)


KIMI_K25_TRANSFORMERS = MoonViTFamily(
    name="kimi-k25-transformers",
    config_type=MoonViTConfig,
    claims=_claims_k25_transformers,
    read=_read_k25_transformers,
    build=MoonViT,
    processors=("Kimi-K2.5",),
    description="transformers' kimi_k25 (model_type kimi_k25_vision): its native or save_pretrained tensor names",
)


# ---- NVIDIA LocateAnything-3B -------------------------------------------------------------------


def _claims_locateanything(values: dict[str, Any]) -> bool:
    vision = _vision(values)
    return (
        vision is not None
        and not _has_release_keys(vision)
        and not _is_k25_transformers(values, vision)
        and values.get("model_type") == LOCATEANYTHING
    )


def locateanything_layout(names: Collection[str]) -> TowerLayout:
    """LocateAnything's release layout (``vision_model.`` + this package's names), also for no names yet.

    Raises:
        TensorLayoutError: its transformers-native layout (refused: its RoPE permutation is not
            settled), or tensors of another family (a Kimi-VL tower mislabelled), named.
    """
    prefix = TOWER_PREFIXES[2]
    # No names yet: a hub snapshot before its index is fetched.
    if not names or any(name.startswith(prefix) for name in names):
        return TowerLayout("release", prefix)
    if any(name.startswith("model.vision_tower.") for name in names):
        raise TensorLayoutError(
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
    raise TensorLayoutError(
        f"config.json says LocateAnything (model_type {LOCATEANYTHING!r}), whose tower tensors are "
        f"{prefix}*, but the folder has none (its tensors start with {', '.join(found)}{hint})"
    )


def _read_locateanything(
    values: dict[str, Any], where: Path, names: Collection[str]
) -> tuple[MoonViTConfig, TowerLayout]:
    vision = values["vision_config"]
    if vision.get("model_type", "moonvit") != "moonvit":
        raise ValueError(f"vision_config: model_type {vision['model_type']!r} is not LocateAnything's 'moonvit'")
    warn_unread_keys(where, vision, KIMI_VL_KEYS)
    return MoonViTConfig(**_mapped(vision, KIMI_VL_KEYS)), locateanything_layout(names)


def _write_kimi_vl(config: MoonViTConfig) -> dict[str, Any]:
    return {"model_type": "moonvit", **_unmapped(config, KIMI_VL_KEYS)}


LOCATEANYTHING_FAMILY = MoonViTFamily(
    name=LOCATEANYTHING,
    config_type=MoonViTConfig,
    claims=_claims_locateanything,
    read=_read_locateanything,
    build=MoonViT,
    processors=("LocateAnything-3B",),
    description="NVIDIA LocateAnything-3B: model_type locateanything, Kimi-VL's tower under vision_model.",
    release=(LOCATEANYTHING, "LocateAnythingForConditionalGeneration"),
    tower_prefix=TOWER_PREFIXES[2],
    write_vision=_write_kimi_vl,
)


# ---- Kimi-VL: any other vision_config (a catch-all) ----------------------------------------------


def _claims_kimi_vl(values: dict[str, Any]) -> bool:
    return values.get("vision_config") is not None


def _read_kimi_vl(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[MoonViTConfig, TowerLayout]:
    vision = values["vision_config"]
    if not isinstance(vision, dict):
        raise ValueError(f"vision_config is a {type(vision).__name__}, not an object")
    warn_unread_keys(where, vision, {*KIMI_VL_KEYS, *PROJECTOR_KEYS})
    config = MoonViTConfig(**_mapped(vision, KIMI_VL_KEYS))
    return config, kimi_layout(names, "kimi-vl", config.num_attention_heads)


KIMI_VL = MoonViTFamily(
    name="kimi-vl",
    config_type=MoonViTConfig,
    claims=_claims_kimi_vl,
    read=_read_kimi_vl,
    build=MoonViT,
    processors=("Kimi-VL",),
    description="Kimi-VL (MoonViT-SO-400M): any other vision_config, in MoonViTConfig's field names",
    release=("kimi_vl", "KimiVLForConditionalGeneration"),
    tower_prefix="vision_tower.",
    write_vision=_write_kimi_vl,
    catch_all=True,
)


# ---- this package's own folders: no vision_config (a catch-all) -----------------------------------


def _claims_own(values: dict[str, Any]) -> bool:
    return values.get("vision_config") is None


def _read_own(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[MoonViTConfig, TowerLayout]:
    warn_unread_keys(where, values, set(MoonViTConfig.__dataclass_fields__))
    return MoonViTConfig.from_dict(values), TowerLayout("own", "")  # the names are never read


OWN = MoonViTFamily(
    name="own",
    config_type=MoonViTConfig,
    claims=_claims_own,
    read=_read_own,
    build=MoonViT,
    processors=("Kimi-VL", "Kimi-K2.5", "Kimi K3", "LocateAnything-3B"),
    description="this package's folders: MoonViTConfig's fields at the top level, unprefixed tensor names",
    catch_all=True,
)


# ---- the registry's view ------------------------------------------------------------------------

MOONVIT_FAMILIES: tuple[MoonViTFamily, ...] = (
    KIMI_K3,
    KIMI_K25,
    KIMI_K25_TRANSFORMERS,
    LOCATEANYTHING_FAMILY,
    KIMI_VL,
    OWN,
)
"""The MoonViT families in the order they are registered (the specific ones before the catch-alls)."""

for _family in MOONVIT_FAMILIES:
    register_family(_family)


def moonvit_family(values: dict[str, Any]) -> MoonViTFamily:
    """The MoonViT family of a ``config.json`` dict, asked in the registry's order with the other towers'
    families left out (for callers that hold a MoonViT tower's config, such as the release writer).

    Raises:
        ValueError: no MoonViT family claims it (only if the catch-alls were replaced).
    """
    found = (family for family in _registered() if family.claims(values))
    family = next(found, None)
    if family is None:
        raise ValueError("no MoonViT family reads this config.json")
    return family


def release_families() -> tuple[str, ...]:
    """The names of the MoonViT families this package writes a release layout of, in the registry's order
    (``kimi-k3``, ``kimi-k25``, ``locateanything``, ``kimi-vl``)."""
    return tuple(family.name for family in _registered() if family.release is not None)


def _registered() -> list[MoonViTFamily]:
    return [family for family in families() if isinstance(family, MoonViTFamily)]


def _release_of(name: str) -> MoonViTFamily:
    """The MoonViT family called ``name`` that has a release layout."""
    for family in _registered():
        if family.name == name and family.release is not None:
            return family
    raise ValueError(f"no release layout for the family {name!r} (expected one of {', '.join(release_families())})")


def release_config_json(config: MoonViTConfig, name: str) -> dict[str, Any]:
    """The tower's part of a ``name`` release's ``config.json``: the top-level ``model_type`` and
    ``architectures`` (the spec's :attr:`~moonvit.families.Family.release`), and ``vision_config`` as
    the release nests it.

    Raises:
        ValueError: a family without a release layout.
    """
    family = _release_of(name)
    assert family.release is not None and family.write_vision is not None  # what _release_of returns
    model_type, architecture = family.release
    return {"model_type": model_type, "architectures": [architecture], "vision_config": family.write_vision(config)}


def release_tower_layout(name: str) -> TowerLayout:
    """The layout a ``name`` release keeps its tower in: its prefix + this package's names.

    Raises:
        ValueError: a family without a release layout.
    """
    return TowerLayout("release", _release_of(name).tower_prefix)


def release_family(encoder: MoonViTConfig, projector_type: str | None = None) -> str:
    """The release a tower (and a projector of ``projector_type``) is saved as: ``kimi-k3`` for a tower
    with K3's switches, ``kimi-k25`` for one with a temporal table, else ``kimi-vl``, or
    ``locateanything`` for that tower with LocateAnything's ``mlp1`` projector."""
    if set(encoder.switches()) - {"layer_norm_eps"}:
        return KIMI_K3.name
    if encoder.init_pos_emb_time:
        return KIMI_K25.name
    return LOCATEANYTHING_FAMILY.name if projector_type == "mlp1" else KIMI_VL.name
