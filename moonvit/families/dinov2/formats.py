"""The folders DINOv2 and DINOv2 with registers come in: their ``config.json`` and their tensor names.

- **transformers** (``model_type`` ``"dinov2"`` or ``"dinov2_with_registers"``): ``Dinov2Model`` /
  ``Dinov2Backbone`` and ``Dinov2WithRegistersModel`` (tensors unprefixed). The hub's names, which
  ``save_pretrained`` writes back: ``embeddings.{cls_token, register_tokens, position_embeddings,
  patch_embeddings.projection, mask_token}``, ``encoder.layer.N.{norm1, attention.attention.{query,
  key, value}, attention.output.dense, layer_scale1.lambda1, norm2, mlp.fc1, mlp.fc2,
  layer_scale2.lambda1}``, ``layernorm``; the SwiGLU MLP (``use_swiglu_ffn``, the giant's) as
  ``mlp.weights_in`` ([gate | up]) and ``mlp.weights_out``. transformers 5 renames them on load (its
  ``conversion_mapping``): a folder written from its in-memory names (``attention.{q,k,v,o}_proj``,
  ``mlp.{gate,up,down}_proj``) loads too. q, k and v (and gate, up) are concatenated into the
  tower's ``qkv`` (``fc1``). The mask token (masked-image pre-training's) is stored and not read.
  The MLP is ``mlp_ratio`` x the width (SwiGLU: two thirds of that, rounded up to a multiple of 8);
  ``Dinov2Model``'s table is resampled bicubically in float32 (``transformers-f32``),
  ``Dinov2WithRegistersModel``'s with antialias (``timm``). The classification models' head (a
  linear layer on [CLS | mean of the patch rows]) is not built here: such a folder is refused by name.
- **timm** (``config.json`` with ``architecture`` ``vit_<size>_patch<p>[_reg<R>]_dinov2[.<tag>]``,
  optionally ``model_args`` and ``pretrained_cfg``): the tower's own names (``cls_token``,
  ``reg_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.N.{norm1, attn.qkv, attn.proj,
  ls1.gamma, norm2, mlp.fc1, mlp.fc2, ls2.gamma}``, ``norm``, ``head``). The size comes from the name
  (``giant``: SwiGLU, timm's ``SwiGLUPacked`` ``fc1`` giving [gate | up]), ``model_args`` overriding;
  the table is 518 px (37 x 37 at patch 14) unless ``model_args`` ``img_size`` or
  ``pretrained_cfg`` ``input_size`` say otherwise (Prismatic's towers are built at 224 px: 16 x 16),
  ``img_size // patch`` patches per side as timm builds it (384 px at patch 14: 27 x 27, 378 px);
  the register models have no table row for the CLS token (``no_embed_class``); LayerNorm eps 1e-6
  and LayerScale always; the table resampled as timm's dynamic-size forward does (``timm``).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...weights.config_keys import warn_unread_keys
from ...weights.formats import TensorLayout, TensorLayoutError, TensorSource
from ..vit.config import ClassicViTConfig
from ..vit.formats import ViTLayout
from ..vit.readers import check_timm_size, refuse_timm_args, square_int, table_pixels, timm_arguments, timm_fields
from .config import IMAGE_SIZE, LAYER_NORM_EPS, SIZES, SWIGLU_SIZES, swiglu_hidden_size

# transformers' model types: the table rule of each, and the defaults of its config class.
_TABLE_RULES = {"dinov2": "transformers-f32", "dinov2_with_registers": "timm"}
_DEFAULT_PATCH = {"dinov2": 14, "dinov2_with_registers": 16}
# transformers' activations by name; SwiGLU's SiLU is fixed (its hidden_act unread).
_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Keys of a transformers DINOv2 config.json this package reads, and those it knows change nothing
# here (dropouts, initialisation, the mask token's switch, Dinov2Backbone's feature maps, labels).
_TRANSFORMERS_KEYS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "mlp_ratio", "hidden_act", "layer_norm_eps",
    "image_size", "patch_size", "num_channels", "qkv_bias", "layerscale_value", "use_swiglu_ffn",
    "num_register_tokens",
}  # fmt: skip
_TRANSFORMERS_IGNORED = {
    "hidden_dropout_prob", "attention_probs_dropout_prob", "initializer_range", "drop_path_rate", "use_mask_token",
    "out_features", "out_indices", "stage_names", "apply_layernorm", "reshape_hidden_states", "num_labels",
}  # fmt: skip
# The transformers classes' base prefix of the tower's tensors, beside a head.
_BASES = ("dinov2.", "dinov2_with_registers.")

_TIMM_ARCH = re.compile(
    r"^vit_(?P<size>[a-z0-9]+)_patch(?P<patch>\d+)(?:_reg(?P<registers>\d+))?_dinov2(?:\.[\w.-]+)?$"
)
_TIMM_KEYS = {"architecture", "num_classes", "num_features", "global_pool", "model_args", "pretrained_cfg"}
# model_args this package reads (timm's VisionTransformer arguments -> the config's fields) ...
_TIMM_ARGS = {
    "embed_dim": "hidden_size", "depth": "num_hidden_layers", "num_heads": "num_attention_heads",
    "img_size": "image_size", "patch_size": "patch_size", "in_chans": "num_channels", "qkv_bias": "qkv_bias",
    "num_classes": "num_classes", "reg_tokens": "num_register_tokens", "no_embed_class": "no_embed_class",
}  # fmt: skip
# ... those read otherwise, and those whose other values it does not build; any other but the harmless ones
# (readers.TIMM_HARMLESS) is refused by key (refuse_timm_args).
_TIMM_READ = {"mlp_ratio", "init_values", "global_pool"}
_TIMM_UNBUILT = {
    "class_token": True, "pre_norm": False, "fc_norm": None, "qk_norm": False, "dynamic_img_pad": False,
    "final_norm": True, "proj_bias": True, "pos_embed": "learn",
}  # fmt: skip


def claims(values: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is a DINOv2 tower's (transformers' or timm's)."""
    if "vision_config" in values:  # a VLM's config.json whose tower is read by its own family
        return False
    if values.get("model_type") in _TABLE_RULES:
        return True
    architecture = values.get("architecture")
    return isinstance(architecture, str) and _TIMM_ARCH.match(architecture) is not None


def read(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, Any]:
    """The tower's config and tensor layout of a DINOv2 folder (see the module docstring)."""
    if values.get("model_type") in _TABLE_RULES:
        return _read_transformers(values, where, names)
    return _read_timm(values, where, names)


# ---- transformers ------------------------------------------------------------------------------


def _read_transformers(
    values: dict[str, Any], where: Path, names: Collection[str]
) -> tuple[ClassicViTConfig, Dinov2Layout]:
    model_type = values["model_type"]
    warn_unread_keys(where, values, _TRANSFORMERS_KEYS | _TRANSFORMERS_IGNORED)
    names = set(names)
    base = next((p for p in _BASES if any(name.startswith(p) for name in names)), "")
    if "classifier.weight" in names:
        raise TensorLayoutError(
            "the folder has a classifier (Dinov2ForImageClassification's head on [CLS | mean of the patch rows]), "
            "which this tower does not build; load the tower from a Dinov2Model folder"
        )
    swiglu = values.get("use_swiglu_ffn", False)
    if not isinstance(swiglu, bool):
        raise ValueError(f"use_swiglu_ffn must be true or false, got {swiglu!r}")
    activation = values.get("hidden_act", "gelu")
    if not swiglu and activation not in _ACTIVATIONS:
        raise ValueError(f"hidden_act {activation!r} is not supported (one of {', '.join(_ACTIVATIONS)})")
    fields: dict[str, Any] = {
        "hidden_size": values.get("hidden_size", 768),
        "num_hidden_layers": values.get("num_hidden_layers", 12),
        "num_attention_heads": values.get("num_attention_heads", 12),
        "image_size": square_int(values.get("image_size", 224), "image_size"),
        "patch_size": square_int(values.get("patch_size", _DEFAULT_PATCH[model_type]), "patch_size"),
        "num_channels": values.get("num_channels", 3),
    }
    width = fields["hidden_size"]
    if not isinstance(width, int) or isinstance(width, bool) or width < 1:
        raise ValueError(f"hidden_size must be a positive int, got {width!r}")
    mlp_width = int(width * _positive(values.get("mlp_ratio", 4), "mlp_ratio"))
    registers = values.get("num_register_tokens", 4) if model_type == "dinov2_with_registers" else 0
    config = ClassicViTConfig(
        **fields,
        intermediate_size=swiglu_hidden_size(mlp_width) if swiglu else mlp_width,
        mlp_type="swiglu" if swiglu else "mlp",
        hidden_act="gelu" if swiglu else _ACTIVATIONS[activation],
        layer_norm_eps=float(_positive(values.get("layer_norm_eps", LAYER_NORM_EPS), "layer_norm_eps")),
        qkv_bias=bool(values.get("qkv_bias", True)),
        layer_scale=True,
        layer_scale_init=float(values.get("layerscale_value", 1.0)),
        num_register_tokens=registers,
        pool="token",
        pos_emb_rule=_TABLE_RULES[model_type],
        family="dinov2",
    )
    in_memory = any(name.endswith(".attention.q_proj.weight") for name in names)
    split_mlp = any(name.endswith(".mlp.gate_proj.weight") for name in names)
    mlp = ("split" if split_mlp else "packed") if swiglu else "fc"
    return config, Dinov2Layout(base, "memory" if in_memory else "hub", mlp)


def _positive(value: Any, key: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{key} must be a positive number, got {value!r}")
    return value


# The tower's own names (timm's) -> transformers' on-disk names, below the base.
_EMBEDDINGS = {
    "cls_token": "embeddings.cls_token",
    "reg_token": "embeddings.register_tokens",
    "pos_embed": "embeddings.position_embeddings",
}
_MODULES = {"patch_embed.proj": "embeddings.patch_embeddings.projection", "norm": "layernorm"}
_BLOCK = {"norm1": "norm1", "norm2": "norm2", "ls1": "layer_scale1", "ls2": "layer_scale2"}
_KINDS = {"gamma": "lambda1"}  # LayerScale's parameter
# Each naming of the attention's and the MLP's linears: the tower's module -> the folder's module(s).
_ATTENTION: dict[str, dict[str, tuple[str, ...]]] = {
    "hub": {"attn.qkv": ("attention.attention.query", "attention.attention.key", "attention.attention.value"),
            "attn.proj": ("attention.output.dense",)},
    "memory": {"attn.qkv": ("attention.q_proj", "attention.k_proj", "attention.v_proj"),
               "attn.proj": ("attention.o_proj",)},
}  # fmt: skip
_MLP: dict[str, dict[str, tuple[str, ...]]] = {
    "fc": {"mlp.fc1": ("mlp.fc1",), "mlp.fc2": ("mlp.fc2",)},
    "packed": {"mlp.fc1": ("mlp.weights_in",), "mlp.fc2": ("mlp.weights_out",)},
    "split": {"mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"), "mlp.fc2": ("mlp.down_proj",)},
}


@dataclass(frozen=True)
class Dinov2Layout(TensorLayout):
    """How a transformers DINOv2 folder names the tower's tensors.

    Attributes:
        base: ``dinov2.`` / ``dinov2_with_registers.`` before the tower's names (``""`` for the bare models).
        attention: ``hub`` (``attention.attention.query``, ..., ``attention.output.dense``: the hub's, and
            what ``save_pretrained`` writes) or ``memory`` (transformers 5's ``attention.{q,k,v,o}_proj``).
        mlp: ``fc`` (``mlp.fc1``, ``mlp.fc2``), ``packed`` (SwiGLU's ``mlp.weights_in`` [gate | up],
            ``mlp.weights_out``) or ``split`` (``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj``).
    """

    base: str = ""
    attention: str = "hub"
    mlp: str = "fc"
    name: str = "transformers"
    prefix: str = ""

    def source(self, model_name: str) -> TensorSource:
        """Where the tower's state-dict entry ``model_name`` comes from."""
        if model_name in _EMBEDDINGS:
            return TensorSource((self.base + _EMBEDDINGS[model_name],))
        module, _, kind = model_name.rpartition(".")
        if module in _MODULES:
            return TensorSource((f"{self.base}{_MODULES[module]}.{kind}",))
        if not module.startswith("blocks."):
            raise ValueError(f"{model_name}: no such tensor in a transformers DINOv2 folder")
        index, inner = module.removeprefix("blocks.").split(".", 1)
        layer = f"{self.base}encoder.layer.{index}."
        kind = _KINDS.get(kind, kind)
        if inner in _BLOCK:
            return TensorSource((f"{layer}{_BLOCK[inner]}.{kind}",))
        parts = {**_ATTENTION[self.attention], **_MLP[self.mlp]}[inner]
        return TensorSource(tuple(f"{layer}{part}.{kind}" for part in parts))

    def unused(self, name: str) -> bool:
        """Whether the folder's tensor ``name`` is one the tower knows and does not read: the mask token
        (masked-image pre-training's)."""
        return name == f"{self.base}embeddings.mask_token"


# ---- timm --------------------------------------------------------------------------------------


def _read_timm(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, ViTLayout]:
    match, args = timm_arguments(values, where, _TIMM_ARCH, _TIMM_KEYS)
    refuse_timm_args(args, "DINOv2 tower", {*_TIMM_ARGS, *_TIMM_READ}, _TIMM_UNBUILT)
    global_pool = values.get("global_pool", args.get("global_pool", "token"))
    if global_pool not in ("token", ""):
        raise ValueError(f"global_pool {global_pool!r} is not supported (DINOv2's towers pool the CLS token)")
    size = match["size"]
    check_timm_size(values["architecture"], size, SIZES, args)
    width, depth, heads = SIZES.get(size, (0, 0, 0))
    registers = int(match["registers"] or 0)
    pretrained = values.get("pretrained_cfg") or {}
    if not isinstance(pretrained, dict):
        raise ValueError(f"pretrained_cfg is a {type(pretrained).__name__}, not an object")
    named = {
        "hidden_size": width,
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "patch_size": int(match["patch"]),
        "image_size": IMAGE_SIZE,
        "num_classes": values.get("num_classes", pretrained.get("num_classes", 0)),
        "num_register_tokens": registers,
        "no_embed_class": registers > 0,  # timm builds its register models so (and converts their weights)
    }
    fields = timm_fields(named, pretrained.get("input_size"), args, _TIMM_ARGS)
    fields["image_size"] = table_pixels(fields["image_size"], fields["patch_size"])
    if fields["num_register_tokens"] and not fields["no_embed_class"]:
        raise ValueError(
            "model_args give register tokens with no_embed_class false (a table row per register): "
            "the tower's registers have no table row"
        )
    swiglu = size in SWIGLU_SIZES  # timm's giant: SwiGLUPacked, fc1 giving [gate | up]
    mlp_width = int(
        fields["hidden_size"] * _positive(args.get("mlp_ratio", 2.66667 * 2 if swiglu else 4.0), "mlp_ratio")
    )
    if swiglu and mlp_width % 2:
        raise ValueError(f"SwiGLU's fc1 width {mlp_width} (embed_dim x mlp_ratio) is odd: it holds [gate | up]")
    init_values = args.get("init_values", 1e-5)  # timm: LayerScale where it is set and not 0
    if init_values is not None and init_values != 0:
        _positive(init_values, "init_values")
    config = ClassicViTConfig(
        **fields,
        intermediate_size=mlp_width // 2 if swiglu else mlp_width,
        mlp_type="swiglu" if swiglu else "mlp",
        layer_norm_eps=LAYER_NORM_EPS,
        layer_scale=bool(init_values),
        layer_scale_init=float(init_values or 1e-5),
        pool="token",
        pos_emb_rule="timm",
        family="dinov2",
    )
    return config, ViTLayout("timm", "")
