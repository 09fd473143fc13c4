"""The folders SigLIP and SigLIP2 come in: their ``config.json`` and their tensor names.

- **transformers SigLIP**: ``SiglipVisionModel`` (``model_type "siglip_vision_model"``) and
  ``SiglipModel`` (``"siglip"``, the tower's keys in ``vision_config``; SigLIP2's fixed-resolution
  releases are these too). Tensors ``embeddings.patch_embedding`` (a Conv2d), ``embeddings.
  position_embedding.weight`` ((N, D): the tower's (1, N, D) table), ``encoder.layers.N.{layer_norm1,
  self_attn.{q,k,v,out}_proj, layer_norm2, mlp.fc1, mlp.fc2}``, ``post_layernorm`` and the MAP head
  ``head.{probe, attention.in_proj_{weight,bias}, attention.out_proj, layernorm, mlp.fc1, mlp.fc2}``.
  A ``SiglipModel`` keeps them under ``vision_model.`` and only those are read (never the text tower,
  ``logit_scale`` or ``logit_bias``); a ``SiglipVisionModel`` under ``vision_model.`` as the hub and
  transformers 4 store it, or unprefixed as transformers 5's ``save_pretrained`` writes it. The table
  follows transformers' rule (bicubic, the native square grid unchanged).
- **transformers SigLIP2 NaFlex**: ``Siglip2VisionModel`` (``"siglip2_vision_model"``) and
  ``Siglip2Model`` (``"siglip2"``): the same names, but the patch embedding is a Linear over patches
  flattened as (row, column, channel), (D, p * p * C), turned into the tower's (D, C, p, p) here (and back
  when written); ``num_patches`` rows of table (16 x 16 for 256), resampled by NaFlex's rule (bilinear
  with antialias, in float32, at every grid).
- **timm** (``architecture`` ``vit_<size>_patch<p>_siglip[_gap]_<px>``, with ``model_args``,
  ``pretrained_cfg``): the tower's own names, but for the MAP head's ``attn_pool.q`` and
  ``attn_pool.kv``, concatenated into its ``qkv``; ``head`` where ``num_classes`` > 0. Sizes
  (``base``, ``large``, ``so400m``, ``giantopt``) from the name, ``model_args`` overriding; each
  architecture's GELU as timm builds it (tanh for some, exact for the others); the table resampled by
  timm's rule.

- **SigLIP towers inside VLM / VLA folders**: transformers' ``paligemma`` (PaliGemma 1 and 2) and
  ``gemma3`` (Gemma 3), whose ``vision_config`` is a ``siglip_vision_model``'s; transformers' ``pi0``
  (``PI0ForConditionalGeneration``: its ``vlm_config`` is PaliGemma's); and LeRobot's π0 / π0.5 / π0-FAST
  policy folders (``"type"`` ``pi0`` / ``pi05`` / ``pi0_fast``, no ``model_type``), whose tower is
  PaliGemma's so400m/14 without the head, built in code from ``image_resolution`` (π0-FAST: 224 px); an
  optional ``vision_config`` there (this package's key, not LeRobot's) gives other sizes. Only the vision
  tower's tensors are read, found by their names: ``vision_tower.vision_model.*`` as the hub and
  transformers 4 store them, ``vision_tower.*`` as transformers 5's ``save_pretrained`` writes them (and
  either under ``model.``, or under LeRobot's ``[model.]paligemma_with_expert.paligemma.[model.]``). The
  language model, the action expert and the multimodal projector (PaliGemma's ``multi_modal_projector.
  linear``; Gemma 3's ``mm_soft_emb_norm`` and ``mm_input_projection_weight`` after its 4 x 4 average
  pool) are never read.

``vision_use_head: false`` (PaliGemma's tower) builds no head: ``pooled`` is then the mean of the patch
rows (``pool "avg"``), as for timm's ``_gap`` towers. This package's own folders of these towers are
classic-ViT folders (``model_type "classic_vit"``), read by that family.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...weights.config_keys import warn_unread_keys
from ...weights.formats import TensorLayout, TensorLayoutError, TensorSource
from ..vit.config import ClassicViTConfig
from ..vit.readers import check_timm_size, refuse_timm_args, square_int, table_pixels, timm_arguments, timm_fields
from .config import SIGLIP_FIELDS, SIZES, sized

SIGLIP_TYPES = ("siglip", "siglip_vision_model")
SIGLIP2_TYPES = ("siglip2", "siglip2_vision_model")
VLM_TYPES = ("paligemma", "gemma3", "pi0")
"""transformers' model types whose vision tower is a ``SiglipVisionModel`` (``pi0``: inside its PaliGemma
``vlm_config``); SmolVLM / Idefics3 name their tower otherwise and are not read."""
LEROBOT_TYPES = ("pi0", "pi05", "pi0_fast")
"""LeRobot's policy types (its ``"type"`` key) whose tower is PaliGemma's."""

# Keys of a transformers SigLIP / SigLIP2 vision config this package reads, and those that change nothing here.
_TRANSFORMERS_KEYS = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels", "patch_size",
    "hidden_act", "layer_norm_eps", "vision_use_head",
}  # fmt: skip
_TRANSFORMERS_IGNORED = {"attention_dropout", "initializer_range", "initializer_factor"}
# Keys a VLM's vision_config carries for the model around the tower (its projector's width, its image tokens)
_VLM_VISION_IGNORED = {"projection_dim", "projector_hidden_act", "num_image_tokens", "vocab_size"}
# transformers' activation names -> the tower's (gelu_new is the same tanh approximation, written out)
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}
# transformers' SiglipVisionConfig defaults where they differ from ClassicViTConfig's
_DEFAULTS = dict(sized("base"), patch_size=16, image_size=224, num_channels=3, layer_norm_eps=1e-6)

_TIMM_ARCH = re.compile(r"^vit_(?P<size>[a-z0-9]+)_patch(?P<patch>\d+)_siglip(?P<gap>_gap)?_(?P<img>\d+)")
_TIMM_KEYS = {
    "architecture",
    "num_classes",
    "num_features",
    "global_pool",
    "model_args",
    "pretrained_cfg",
    "label_names",
}
# timm VisionTransformer arguments this package reads, and those whose other values it does not build
_TIMM_ARGS = {
    "embed_dim": "hidden_size", "depth": "num_hidden_layers", "num_heads": "num_attention_heads",
    "img_size": "image_size", "patch_size": "patch_size", "in_chans": "num_channels", "qkv_bias": "qkv_bias",
}  # fmt: skip
_TIMM_FIXED = {
    "class_token": False, "init_values": None, "reg_tokens": 0, "no_embed_class": False, "pre_norm": False,
    "fc_norm": False, "qk_norm": False, "dynamic_img_pad": False, "pos_embed": "learn", "final_norm": True,
}  # fmt: skip
_TIMM_OTHER_ARGS = {"mlp_ratio", "act_layer", "global_pool", "num_classes", "dynamic_img_size"}
_TIMM_MLP_RATIO = {"so400m": 3.7362}  # the others: 4


def claims_siglip(values: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is a SigLIP tower's: transformers' ``siglip`` / ``siglip_vision_model``,
    a VLM of :data:`VLM_TYPES` (whatever its ``vision_config``: one that is not SigLIP's is refused by
    name when read), a LeRobot π0 policy, or a timm SigLIP architecture."""
    if values.get("model_type") in SIGLIP_TYPES + VLM_TYPES or _is_lerobot(values):
        return True
    architecture = values.get("architecture")
    return "vision_config" not in values and isinstance(architecture, str) and bool(_TIMM_ARCH.match(architecture))


def claims_siglip2(values: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is transformers' SigLIP2 NaFlex (``siglip2`` / ``siglip2_vision_model``)."""
    return values.get("model_type") in SIGLIP2_TYPES


def read_siglip(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, SiglipLayout]:
    """The tower's config and tensor layout of a SigLIP folder: transformers', a VLM's or VLA's, or timm's."""
    if values.get("model_type") in VLM_TYPES or _is_lerobot(values):
        return _read_vlm(values, where, names)
    if values.get("model_type") not in SIGLIP_TYPES:
        return _read_timm(values, where)
    return _read_transformers(values, where, names, naflex=False)


def read_siglip2(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, SiglipLayout]:
    """The tower's config and tensor layout of a SigLIP2 NaFlex folder."""
    return _read_transformers(values, where, names, naflex=True)


def _read_transformers(
    values: dict[str, Any], where: Path, names: Collection[str], naflex: bool
) -> tuple[ClassicViTConfig, SiglipLayout]:
    full = values["model_type"] in ("siglip", "siglip2")
    vision = values.get("vision_config", {}) if full else values
    if not isinstance(vision, dict):
        raise ValueError(f"vision_config is a {type(vision).__name__}, not an object")
    config = _transformers_config(vision, where, naflex)
    # A full model's vision half, and the hub's SiglipVisionModel, sit under vision_model.; transformers 5
    # writes a SiglipVisionModel unprefixed. Only a full model's tensors are filtered by the prefix.
    base = "vision_model." if full or any(name.startswith("vision_model.") for name in names) else ""
    kind = "naflex" if naflex else "transformers"
    return config, SiglipLayout(kind, base if full else "", base, config.patch_size, config.num_channels)


def _transformers_config(
    vision: dict[str, Any], where: Path, naflex: bool, also_ignored: Collection[str] = ()
) -> ClassicViTConfig:
    """The tower config of a transformers SigLIP (``naflex``: SigLIP2) vision config's keys."""
    warn_unread_keys(
        where,
        vision,
        _TRANSFORMERS_KEYS | _TRANSFORMERS_IGNORED | {"num_patches" if naflex else "image_size", *also_ignored},
    )
    fields: dict[str, Any] = {key: vision.get(key, default) for key, default in _DEFAULTS.items()}
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_channels"):
        fields[key] = square_int(fields[key], key)
    fields["patch_size"] = square_int(fields["patch_size"], "patch_size")
    fields["layer_norm_eps"] = float(fields["layer_norm_eps"])
    if naflex:
        patches = vision.get("num_patches", 256)
        side = math.isqrt(patches) if isinstance(patches, int) and patches > 0 else 0
        if side * side != patches:
            raise ValueError(f"num_patches {patches!r} is not a square number (the table is side x side)")
        fields["image_size"] = side * fields["patch_size"]
    else:  # the table's whole patches, and the size the release resizes to (SigLIP's rule reads it)
        fields["input_size"] = square_int(fields["image_size"], "image_size")
        fields["image_size"] = table_pixels(fields["input_size"], fields["patch_size"])
    activation = vision.get("hidden_act", "gelu_pytorch_tanh")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {activation!r} is not supported (one of {', '.join(_ACTIVATIONS)})")
    head = vision.get("vision_use_head", True)
    if not isinstance(head, bool):
        raise ValueError(f"vision_use_head must be true or false, got {head!r}")
    return ClassicViTConfig(
        **{
            **SIGLIP_FIELDS,
            **fields,
            "hidden_act": _ACTIVATIONS[activation],
            "pool": "map" if head else "avg",
            "pos_emb_rule": "naflex" if naflex else "transformers",
            "family": "siglip2" if naflex else "siglip",
        }
    )


# ---- SigLIP towers inside VLM / VLA folders ------------------------------------------------------

# PaliGemma's tower as LeRobot's π0 policies build it in code (PaliGemmaConfig's vision defaults, with
# intermediate_size 4304 set by the policy): so400m/14 without the MAP head.
_LEROBOT_VISION: dict[str, Any] = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16, patch_size=14,
    image_size=224, vision_use_head=False,
)  # fmt: skip
# A vision tower's tensor root: whatever stands before vision_tower. (nothing, model., model.vlm., LeRobot's
# paligemma_with_expert.paligemma.[model.]), then vision_model. where the hub and transformers 4 keep it.
_TOWER_ROOT = re.compile(
    r"^((?:[\w.]*?\.)?vision_tower\.(?:vision_model\.)?)(?:embeddings|encoder|post_layernorm|head)\."
)
# The root a folder whose tensor names are not known yet is fetched by (the hub's names start with it)
_DEFAULT_ROOT = {"vlm": "vision_tower.", "pi0": "paligemma_with_expert.paligemma.model.vision_tower."}


def _is_lerobot(values: dict[str, Any]) -> bool:
    """A LeRobot π0 / π0.5 / π0-FAST policy's ``config.json`` (draccus writes the policy's ``"type"``)."""
    return "model_type" not in values and values.get("type") in LEROBOT_TYPES


def _read_vlm(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, SiglipLayout]:
    """The SigLIP tower of a PaliGemma, Gemma 3 or π0 folder (transformers' or LeRobot's); only its tensors read."""
    model_type = values.get("model_type")
    if model_type is None:  # LeRobot's policy: the tower is built in code, not described in config.json
        vision = _lerobot_vision(values)
        label, default = f"LeRobot {values['type']} policy", _DEFAULT_ROOT["pi0"]
    else:
        vision = _vlm_vision(values, model_type)
        label, default = f"model_type {model_type!r}", _DEFAULT_ROOT["pi0" if model_type == "pi0" else "vlm"]
    tower = vision.get("model_type", "siglip_vision_model")
    if tower != "siglip_vision_model":
        raise ValueError(
            f"{label}: vision_config model_type {tower!r} is not a SigLIP vision model's ('siglip_vision_model'); "
            "only SigLIP towers are read from these folders"
        )
    config = _transformers_config(vision, where, naflex=False, also_ignored=_VLM_VISION_IGNORED)
    root = _tower_root(names, default, label)
    return config, SiglipLayout("transformers", root, root, config.patch_size, config.num_channels)


def _vlm_vision(values: dict[str, Any], model_type: str) -> dict[str, Any]:
    """A transformers VLM's ``vision_config`` (π0's inside its PaliGemma ``vlm_config``)."""
    holder: Any = values
    if model_type == "pi0":
        holder = values.get("vlm_config")
        if not isinstance(holder, dict):
            raise ValueError(f"model_type 'pi0': vlm_config (its PaliGemma config) is {holder!r}, not an object")
    vision = holder.get("vision_config")
    if not isinstance(vision, dict):
        found = "missing" if vision is None else f"a {type(vision).__name__}, not an object"
        raise ValueError(f"model_type {model_type!r}: vision_config (the SigLIP tower's keys) is {found}")
    return vision


def _lerobot_vision(values: dict[str, Any]) -> dict[str, Any]:
    """A LeRobot π0 policy's tower keys: PaliGemma's so400m/14 at ``image_resolution[0]`` px (π0-FAST's
    tower keeps 224), ``vision_config`` (this package's key) overriding."""
    vision = dict(_LEROBOT_VISION)
    resolution = values.get("image_resolution")
    if resolution is not None and values["type"] != "pi0_fast":  # LeRobot builds the table from the first side
        if not (isinstance(resolution, list | tuple) and len(resolution) == 2):
            raise ValueError(f"image_resolution {resolution!r} is not a [height, width] pair")
        vision["image_size"] = resolution[0]
    override = values.get("vision_config", {})
    if not isinstance(override, dict):
        raise ValueError(f"vision_config is a {type(override).__name__}, not an object")
    return {**vision, **override}


def _tower_root(names: Collection[str], default: str, label: str) -> str:
    """What the vision tower's tensor names start with, found from the folder's names (``default`` where
    none are known yet: a hub repository before its index is fetched).

    Raises:
        TensorLayoutError: no vision tower among the names, or several (each root named).
    """
    roots = sorted({match[1] for name in names if "vision_tower." in name and (match := _TOWER_ROOT.match(name))})
    if len(roots) > 1:
        raise TensorLayoutError(f"{label}: tensors of several vision towers, under {', '.join(roots)}; one expected")
    if roots:
        return roots[0]
    if len(names):
        raise TensorLayoutError(
            f"{label}: no SigLIP vision tower among its tensors (names such as "
            f"{default}[vision_model.]embeddings.patch_embedding.weight)"
        )
    return default


def _read_timm(values: dict[str, Any], where: Path) -> tuple[ClassicViTConfig, SiglipLayout]:
    match, args = timm_arguments(values, where, _TIMM_ARCH, _TIMM_KEYS)
    built = {key: value for key, value in args.items() if not (key == "fc_norm" and value is None)}  # timm's default
    refuse_timm_args(built, "SigLIP tower", {*_TIMM_ARGS, *_TIMM_OTHER_ARGS}, _TIMM_FIXED)
    size, patch, pixels = match["size"], int(match["patch"]), int(match["img"])
    check_timm_size(values["architecture"], size, SIZES, args)
    named: dict[str, Any] = dict(sized(size)) if size in SIZES else {}
    named.update(patch_size=patch, image_size=pixels)
    pretrained = values.get("pretrained_cfg") or {}
    input_size = pretrained.get("input_size") if isinstance(pretrained, dict) else None
    fields = timm_fields(named, input_size, args, _TIMM_ARGS)
    fields["input_size"] = fields["image_size"]  # the release's size, which SigLIP's rule resizes to
    fields["image_size"] = table_pixels(fields["image_size"], fields["patch_size"])
    if "embed_dim" in args or "mlp_ratio" in args or size not in SIZES:
        ratio = float(args.get("mlp_ratio", _TIMM_MLP_RATIO.get(size, 4.0)))
        fields["intermediate_size"] = int(fields["hidden_size"] * ratio)
    activation = args.get("act_layer", _timm_activation(size, patch, pixels))
    if activation not in ("gelu", "gelu_tanh"):
        raise ValueError(f"model_args act_layer {activation!r} is not supported (only 'gelu', 'gelu_tanh')")
    # model_args are timm's create_model arguments: they win over the hub config's (pretrained_cfg's) values
    pool = args.get("global_pool", values.get("global_pool", "avg" if match["gap"] else "map"))
    if pool not in ("map", "avg"):
        raise ValueError(f"global_pool {pool!r} is not supported (SigLIP's 'map', or 'avg' without fc_norm)")
    config = ClassicViTConfig(
        **{
            **SIGLIP_FIELDS,
            **fields,
            "hidden_act": activation,
            "pool": pool,
            "num_classes": int(args.get("num_classes", values.get("num_classes", 0))),
            "pos_emb_rule": "timm",
            "family": "siglip",
        }
    )
    return config, SiglipLayout("timm", "")


def _timm_activation(size: str, patch: int, pixels: int) -> str:
    """The GELU timm builds each SigLIP architecture with (its ``act_layer``, exact GELU where unset):
    tanh for the /32 base towers, so400m/16, giantopt and large at 512 px; exact for the others."""
    tanh = (
        patch == 32 or size == "giantopt" or (size == "so400m" and patch == 16) or (size == "large" and pixels == 512)
    )
    return "gelu_tanh" if tanh else "gelu"


# ---- tensor names ------------------------------------------------------------------------------

# The tower's module names (timm's) -> transformers' SigLIP names, below vision_model. (or nothing).
_TRANSFORMERS_NAMES = {
    "patch_embed.proj": "embeddings.patch_embedding",
    "norm": "post_layernorm",
    "attn_pool.proj": "head.attention.out_proj",
    "attn_pool.norm": "head.layernorm",
    "attn_pool.mlp.fc1": "head.mlp.fc1",
    "attn_pool.mlp.fc2": "head.mlp.fc2",
}
_TRANSFORMERS_BLOCK = {
    "norm1": "layer_norm1",
    "attn.proj": "self_attn.out_proj",
    "norm2": "layer_norm2",
    "mlp.fc1": "mlp.fc1",
    "mlp.fc2": "mlp.fc2",
}


def _unsqueeze(table: torch.Tensor) -> torch.Tensor:
    return table.unsqueeze(0)


def _squeeze(table: torch.Tensor) -> torch.Tensor:
    return table.squeeze(0)


def _table_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:]  # (1, N, D) -> (N, D)


@dataclass(frozen=True)
class SiglipLayout(TensorLayout):
    """How a folder names the SigLIP tower's tensors.

    Attributes:
        name: ``transformers`` (SigLIP), ``naflex`` (SigLIP2: transformers' names, a Linear patch
            embedding) or ``timm`` (the tower's names, the MAP head's ``q`` and ``kv`` apart).
        prefix: every tensor the loader reads starts with it (``vision_model.`` for a full model's vision
            half; ``""``: all the folder's, so that any other tensor is named as unexpected).
        base: what stands before transformers' names (``vision_model.`` or ``""``).
        patch_size, channels: the patch embedding's, to unflatten SigLIP2's (D, p * p * C) weight.
    """

    name: str
    prefix: str
    base: str = ""
    patch_size: int = 0
    channels: int = 0

    def source(self, model_name: str) -> TensorSource:
        """Where the tower's state-dict entry ``model_name`` comes from."""
        module, _, kind = model_name.rpartition(".")
        if self.name == "timm":
            if module == "attn_pool.qkv":  # timm's q (D rows) then kv (2D rows: [k | v])
                return TensorSource((f"attn_pool.q.{kind}", f"attn_pool.kv.{kind}"), shares=(1, 2))
            return TensorSource((model_name,))
        base = self.base
        if model_name == "pos_embed":
            return TensorSource(
                (f"{base}embeddings.position_embedding.weight",), (_unsqueeze,), (_squeeze,), stored_shape=_table_shape
            )
        if model_name == "attn_pool.latent":
            return TensorSource((f"{base}head.probe",))
        if module == "attn_pool.qkv":
            return TensorSource((f"{base}head.attention.in_proj_{kind}",))
        if model_name == "patch_embed.proj.weight" and self.name == "naflex":
            return TensorSource(
                (f"{base}embeddings.patch_embedding.weight",),
                (self._conv_weight,),
                (self._linear_weight,),
                stored_shape=_flat_patch_shape,
            )
        if module in _TRANSFORMERS_NAMES:
            return TensorSource((f"{base}{_TRANSFORMERS_NAMES[module]}.{kind}",))
        index, inner = module.removeprefix("blocks.").split(".", 1)
        layer = f"{base}encoder.layers.{index}."
        if inner == "attn.qkv":
            return TensorSource(tuple(f"{layer}self_attn.{p}_proj.{kind}" for p in "qkv"))
        return TensorSource((f"{layer}{_TRANSFORMERS_BLOCK[inner]}.{kind}",))

    def _conv_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """SigLIP2's (D, p * p * C) Linear weight over (row, column, channel) -> the tower's (D, C, p, p)."""
        p = self.patch_size
        return weight.view(weight.shape[0], p, p, self.channels).permute(0, 3, 1, 2).contiguous()

    @staticmethod
    def _linear_weight(weight: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_conv_weight`."""
        return weight.permute(0, 2, 3, 1).reshape(weight.shape[0], -1).contiguous()


def _flat_patch_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (shape[0], math.prod(shape[1:]))  # (D, C, p, p) -> (D, p * p * C)
