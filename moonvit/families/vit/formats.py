"""The folders the classic ViT and DeiT come in: their ``config.json`` and their tensor names.

- **transformers** (``model_type`` ``"vit"`` or ``"deit"``): ``ViTModel`` / ``DeiTModel`` (tensors
  unprefixed, with or without ``pooler.dense``), ``ViTForImageClassification`` /
  ``DeiTForImageClassification`` (``vit.`` / ``deit.`` + the same, ``classifier``) and
  ``DeiTForImageClassificationWithTeacher`` (``cls_classifier`` and ``distillation_classifier``), in
  the hub's on-disk names (``encoder.layer.N.attention.attention.query``, ...; what
  ``save_pretrained`` writes). q, k and v are concatenated into the tower's ``qkv``. Every
  transformers DeiT has the distillation token.
- **timm** (``config.json`` with ``architecture``, ``num_classes`` and optionally ``model_args``):
  ``cls_token``, ``dist_token``, ``pos_embed``, ``patch_embed.proj``, ``blocks.N.{norm1, attn.qkv,
  attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``, ``head``, ``head_dist``: the tower's own names.
  The standard sizes' widths, depths and head counts come from the architecture name
  (``vit_base_patch16_224``, ``deit_small_distilled_patch16_224``), ``model_args`` overriding;
  LayerNorm eps 1e-6 and the table resampled as timm's dynamic-size forward does.
- **own** (``model_type "classic_vit"``): :class:`ClassicViTConfig`'s fields and the timm names.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...weights.config_keys import warn_unread_keys
from ...weights.formats import TensorLayout, TensorSource
from .config import SIZES, ClassicViTConfig
from .readers import check_timm_size, refuse_timm_args, square_int, timm_arguments, timm_fields

# Keys of a transformers ViT / DeiT config.json this package reads, and those it knows change nothing
# here (dropouts, initialisation, the masked-image-modelling stride, the labels' names).
_TRANSFORMERS_KEYS = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "layer_norm_eps",
    "image_size", "patch_size", "num_channels", "qkv_bias", "hidden_act", "pooler_output_size", "pooler_act",
    "id2label", "label2id", "num_labels",
}  # fmt: skip
_TRANSFORMERS_IGNORED = {
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "hidden_dropout_prob",
    "attention_probs_dropout_prob", "initializer_range", "encoder_stride", "problem_type", "_name_or_path",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
}  # fmt: skip
_TIMM_KEYS = {
    "architecture", "num_classes", "num_features", "global_pool", "model_args", "pretrained_cfg", "label_names",
}  # fmt: skip
_TIMM_ARCH = re.compile(
    r"^(?P<kind>vit|deit)_(?P<size>[a-z]+)(?P<distilled>_distilled)?_patch(?P<patch>\d+)_(?P<img>\d+)"
)
# model_args this package reads (timm's VisionTransformer arguments), and those whose other values it does not build;
# any other but the harmless ones (readers.TIMM_HARMLESS) is refused by key (refuse_timm_args).
_TIMM_ARGS = {
    "embed_dim": "hidden_size", "depth": "num_hidden_layers", "num_heads": "num_attention_heads",
    "img_size": "image_size", "patch_size": "patch_size", "in_chans": "num_channels", "qkv_bias": "qkv_bias",
    "class_token": "class_token", "num_classes": "num_classes",
}  # fmt: skip
_TIMM_UNBUILT = {
    "init_values": None, "reg_tokens": 0, "no_embed_class": False, "pre_norm": False, "fc_norm": None,
    "qk_norm": False, "global_pool": "token", "dynamic_img_pad": False,
}  # fmt: skip


def claims(values: dict[str, Any]) -> bool:
    """Whether a ``config.json`` is a classic ViT's or DeiT's (transformers', timm's or this package's own)."""
    if "vision_config" in values:  # a VLM's config.json whose tower is another family's
        return False
    model_type = values.get("model_type")
    if model_type in ("vit", "deit", "classic_vit"):
        return True
    architecture = values.get("architecture")
    return isinstance(architecture, str) and _TIMM_ARCH.match(architecture) is not None


def read(values: dict[str, Any], where: Path, names: Collection[str]) -> tuple[ClassicViTConfig, ViTLayout]:
    """The tower's config and tensor layout of a classic-ViT folder (see the module docstring)."""
    model_type = values.get("model_type")
    if model_type == "classic_vit":
        warn_unread_keys(where, values, set(ClassicViTConfig.__dataclass_fields__))
        return ClassicViTConfig.from_dict(values), ViTLayout("own", "")
    if model_type in ("vit", "deit"):
        return _read_transformers(values, where, set(names))
    return _read_timm(values, where, set(names))


def _read_transformers(values: dict[str, Any], where: Path, names: set[str]) -> tuple[ClassicViTConfig, ViTLayout]:
    deit = values["model_type"] == "deit"
    activation = values.get("hidden_act", "gelu")
    if activation != "gelu":
        raise ValueError(f"hidden_act {activation!r} is not supported (the classic ViT's exact 'gelu')")
    warn_unread_keys(where, values, _TRANSFORMERS_KEYS | _TRANSFORMERS_IGNORED)
    base = next((p for p in ("vit.", "deit.") if any(name.startswith(p) for name in names)), "")
    pooler = f"{base}pooler.dense.weight" in names
    if pooler and values.get("pooler_act", "tanh") != "tanh":
        raise ValueError(f"pooler_act {values['pooler_act']!r} is not supported (only 'tanh')")
    teacher = "cls_classifier.weight" in names
    head = teacher or "classifier.weight" in names
    labels = values.get("id2label") or {}
    num_classes = int(values.get("num_labels", len(labels) or 2)) if head else 0
    if head and labels:
        num_classes = len(labels)
    fields: dict[str, Any] = {
        key: square_int(values[key], key)
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                    "patch_size", "num_channels")
        if key in values
    }  # fmt: skip
    if values.get("pooler_output_size", fields.get("hidden_size", 768)) != fields.get("hidden_size", 768) and pooler:
        raise ValueError("pooler_output_size differs from hidden_size: this package keeps the pooler at the width")
    config = ClassicViTConfig(
        **fields,
        layer_norm_eps=float(values.get("layer_norm_eps", 1e-12)),
        qkv_bias=bool(values.get("qkv_bias", True)),
        distillation_token=deit,
        num_classes=num_classes,
        distilled_head=teacher,
        pooler=pooler,
        pos_emb_rule="transformers",
    )
    return config, ViTLayout("transformers", "", base, teacher)


def _read_timm(values: dict[str, Any], where: Path, names: set[str]) -> tuple[ClassicViTConfig, ViTLayout]:
    match, args = timm_arguments(values, where, _TIMM_ARCH, _TIMM_KEYS)
    refuse_timm_args(args, "classic-ViT tower", {*_TIMM_ARGS, "mlp_ratio"}, _TIMM_UNBUILT)
    global_pool = values.get("global_pool", args.get("global_pool", "token"))
    if global_pool not in ("token", ""):
        raise ValueError(
            f"global_pool {global_pool!r} is not supported (timm's 'avg' ViTs have an fc_norm; "
            "only 'token' folders load)"
        )
    size = match["size"]
    check_timm_size(values["architecture"], size, SIZES, args)
    width, depth, heads = SIZES.get(size, (0, 0, 0))
    pretrained = values.get("pretrained_cfg") or {}
    input_size = pretrained.get("input_size") if isinstance(pretrained, dict) else None
    named = {
        "hidden_size": width,
        "num_hidden_layers": depth,
        "num_attention_heads": heads,
        "patch_size": int(match["patch"]),
        "image_size": int(match["img"]),
        "num_classes": int(values.get("num_classes", 1000)),
    }
    fields = timm_fields(named, input_size, args, _TIMM_ARGS)
    mlp_ratio = float(args.get("mlp_ratio", 4.0))
    fields["intermediate_size"] = int(fields["hidden_size"] * mlp_ratio)
    distilled = match["distilled"] is not None
    class_token = bool(fields.pop("class_token", True))
    config = ClassicViTConfig(
        **fields,
        layer_norm_eps=1e-6,
        class_token=class_token,
        pool="token" if class_token else "avg",
        distillation_token=distilled,
        distilled_head=distilled and fields["num_classes"] > 0,
        pos_emb_rule="timm",
    )
    return config, ViTLayout("timm", "")


# ---- tensor names ------------------------------------------------------------------------------

# The tower's own names (timm's) -> transformers' on-disk names, below the ``vit.`` / ``deit.`` base.
_TRANSFORMERS_NAMES = {
    "cls_token": "embeddings.cls_token",
    "dist_token": "embeddings.distillation_token",
    "pos_embed": "embeddings.position_embeddings",
    "patch_embed.proj": "embeddings.patch_embeddings.projection",
    "norm": "layernorm",
    "pooler.dense": "pooler.dense",
}
_TRANSFORMERS_BLOCK = {
    "norm1": "layernorm_before",
    "attn.proj": "attention.output.dense",
    "norm2": "layernorm_after",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


@dataclass(frozen=True)
class ViTLayout(TensorLayout):
    """How a folder names the classic-ViT tower's tensors.

    Attributes:
        name: ``own``, ``timm`` (the tower's names) or ``transformers``.
        prefix: the prefix every tensor the loader reads starts with (``""``: all the folder's).
        base: transformers' ``vit.`` / ``deit.`` before the tower's names (``""`` for the bare models).
        teacher: transformers' DeiT with teacher (``cls_classifier``, ``distillation_classifier``).
    """

    name: str
    prefix: str
    base: str = ""
    teacher: bool = False

    def source(self, model_name: str) -> TensorSource:
        """Where the tower's state-dict entry ``model_name`` comes from."""
        if self.name != "transformers":
            return TensorSource((model_name,))
        if model_name in ("cls_token", "dist_token", "pos_embed"):
            return TensorSource((self.base + _TRANSFORMERS_NAMES[model_name],))
        module, _, kind = model_name.rpartition(".")
        if module == "head":
            return TensorSource((f"{'cls_classifier' if self.teacher else 'classifier'}.{kind}",))
        if module == "head_dist":
            return TensorSource((f"distillation_classifier.{kind}",))
        if module in _TRANSFORMERS_NAMES:
            return TensorSource((f"{self.base}{_TRANSFORMERS_NAMES[module]}.{kind}",))
        index, inner = module.removeprefix("blocks.").split(".", 1)
        layer = f"{self.base}encoder.layer.{index}."
        if inner == "attn.qkv":
            return TensorSource(tuple(f"{layer}attention.attention.{p}.{kind}" for p in ("query", "key", "value")))
        return TensorSource((f"{layer}{_TRANSFORMERS_BLOCK[inner]}.{kind}",))
