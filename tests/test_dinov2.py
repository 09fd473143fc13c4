"""DINOv2 and DINOv2 with registers, built as configs of the classic-ViT tower, against transformers.

- transformers' ``Dinov2Model`` (plain, SwiGLU, tanh GELU) and ``Dinov2WithRegistersModel`` (plain,
  SwiGLU), each run image by image, against one packed call of the folder its ``save_pretrained``
  wrote, over the native grid, larger, smaller and odd-sided ones (and 2 x 8: the native patch count
  on a non-square grid): the patch rows, the prefix rows (CLS, then the registers) and ``pooled``
  against ``pooler_output``;
- the same weights under transformers 5's in-memory names (``q_proj``, ``gate_proj``, ...), and in
  timm's (renamed here from transformers' tensors; the register models folded to timm's table
  without a CLS row, as timm converts them);
- bf16 against the float64 references, within the references' own bf16 error;
- what the loader reads and refuses: the mask token ignored, a missing or unexpected tensor named,
  activations, classifier folders and timm arguments the tower does not build; a hub id, offline.

Weights are random (normal, std 0.2, LayerNorm scales 1 + that, tokens, table and LayerScale included)
so that a wrong tensor, rule or row shows far above float64's error.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    check_bf16,
    copied_folder,
    normal_images,
    patch_pack,
    randomise_,
    record_error,
    rewrite_config,
    rewrite_tensors,
    saved_models,
)
from reference_vit import resample_abs_pos_embed
from safetensors.torch import load_file, save_file
from test_hub import offline, requested, write_hub_cache  # noqa: F401 (fixtures)
from transformers import (
    Dinov2Config,
    Dinov2Model,
    Dinov2WithRegistersConfig,
    Dinov2WithRegistersModel,
    PreTrainedModel,
)

from moonvit import CheckpointError, MoonViT
from moonvit.families import family_of, find_family
from moonvit.families.dinov2 import dinov2_config, dinov2_preset, swiglu_hidden_size
from moonvit.families.vit import ClassicViT
from moonvit.media.processor import patchify
from moonvit.model.interface import tower_name

PATCH = 8
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4, image_size=32, patch_size=PATCH)
# The native 4x4 grid of a 32 px table at patch 8, larger, smaller and odd-sided ones; 2x8 has the
# native patch count on a grid that is not square (transformers resamples it: so must the tower).
GRIDS = [(4, 4), (6, 6), (2, 3), (3, 5), (7, 2), (1, 4), (2, 8), (5, 1)]
FLOAT64 = dict(rtol=0.0, atol=1e-12)  # against a float64 reference (Dinov2Model's float32 bicubic table is the tower's)
FLOAT32_TABLE = dict(rtol=0.0, atol=1e-6)
"""Against transformers' register models, which round their resampled table to float32 where the tower keeps
float64 (errors about 1e-7); each is also held to :data:`FLOAT64` against the same rule in float64."""
ERRORS: dict[str, float] = {}
"""The largest error each comparison measured, by reference and output (a script can print them)."""


def record(key: str, actual: torch.Tensor, expected: torch.Tensor, **tolerance: float) -> None:
    """Assert ``actual`` close to ``expected`` (within :data:`FLOAT64` unless told) and keep the largest
    error seen under ``key``."""
    record_error(ERRORS, key, actual, expected, **(tolerance or FLOAT64))


# ---- transformers ------------------------------------------------------------------------------

REFERENCES: dict[str, Callable[[], PreTrainedModel]] = {
    "Dinov2Model": lambda: Dinov2Model(Dinov2Config(**TINY)),
    "Dinov2Model-swiglu": lambda: Dinov2Model(Dinov2Config(**TINY, use_swiglu_ffn=True)),
    "Dinov2Model-tanh": lambda: Dinov2Model(Dinov2Config(**TINY, hidden_act="gelu_pytorch_tanh")),
    "Dinov2WithRegistersModel": lambda: Dinov2WithRegistersModel(Dinov2WithRegistersConfig(**TINY)),
    "Dinov2WithRegistersModel-swiglu": lambda: Dinov2WithRegistersModel(
        Dinov2WithRegistersConfig(**TINY, num_register_tokens=2, use_swiglu_ffn=True)
    ),
}


def registers_of(name: str) -> int:
    return {"Dinov2WithRegistersModel": 4, "Dinov2WithRegistersModel-swiglu": 2}.get(name, 0)


def transformers_reference(name: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> PreTrainedModel:
    """A transformers model of the tiny size with random weights, eval mode, SDPA attention."""
    model = randomise_(REFERENCES[name]().double(), seed).to(dtype)
    model.set_attn_implementation("sdpa")
    return model.eval()


@pytest.fixture(scope="module")
def transformers_folders(tmp_path_factory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each reference model and the folder its ``save_pretrained`` wrote (float64 tensors, hub names)."""
    return saved_models(tmp_path_factory, REFERENCES, transformers_reference)


def transformers_outputs(model: PreTrainedModel, image: torch.Tensor) -> dict[str, torch.Tensor]:
    """One image through a transformers model: ``tokens`` (T, D) after the final norm (CLS, registers,
    patches) and ``pooler_output`` (D,)."""
    with torch.no_grad():
        out = model(pixel_values=image.unsqueeze(0))
    return {"tokens": out.last_hidden_state[0], "pooler_output": out.pooler_output[0]}


def check_against(
    key: str, ours: ClassicViT, run: Callable[[torch.Tensor], dict[str, torch.Tensor]], prefix: int, **tolerance: float
) -> None:
    """One packed call of ``ours`` over :data:`GRIDS` against ``run`` image by image."""
    images = normal_images(GRIDS, PATCH)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
    assert out.prefix_tokens.shape == (len(GRIDS), prefix, ours.config.hidden_size)
    rows = out.last_hidden_state.split([h * w for h, w in GRIDS])
    for i, (image, patches) in enumerate(zip(images, rows, strict=True)):
        expected = run(image)
        record(f"{key}/patches", patches, expected["tokens"][prefix:], **tolerance)
        record(f"{key}/prefix", out.prefix_tokens[i], expected["tokens"][:prefix], **tolerance)
        record(f"{key}/pooled", out.pooled[i], expected["pooler_output"], **tolerance)


@contextlib.contextmanager
def timm_table_in_float64(model: PreTrainedModel) -> Iterator[None]:
    """``model`` resampling its table by timm's rule (antialiased bicubic) in float64
    (:func:`reference_vit.resample_abs_pos_embed`), where transformers' register model rounds the
    resampled table to float32 and ``Dinov2Model`` has no antialias."""
    embeddings = model.embeddings
    side = embeddings.config.image_size // PATCH

    def timm_rule(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
        size = (height // PATCH, width // PATCH)
        table = embeddings.position_embeddings
        return resample_abs_pos_embed(table, size, (side, side), num_prefix_tokens=1, compute_dtype=torch.float64)

    embeddings.interpolate_pos_encoding = timm_rule
    try:
        yield
    finally:
        del embeddings.interpolate_pos_encoding


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("name", REFERENCES)
def test_transformers_folders_match_their_models_image_by_image(transformers_folders, name, backend):
    reference, folder = transformers_folders[name]
    names = load_file(folder / "model.safetensors").keys()
    assert "embeddings.mask_token" in names  # stored, not read
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of the folder's config.json is known
        ours = MoonViT.from_pretrained(folder, dtype=torch.float64, attn_implementation=backend)
    assert isinstance(ours, ClassicViT) and ours.dtype == torch.float64
    config = ours.config
    registers = registers_of(name)
    assert config.num_register_tokens == registers and config.num_prefix_tokens == 1 + registers
    assert config.layer_scale and config.layer_norm_eps == 1e-6 and config.pool == "token"
    assert config.mlp_type == ("swiglu" if "swiglu" in name else "mlp")
    assert config.pos_emb_rule == ("timm" if registers else "transformers-f32")
    assert config.hidden_act == ("gelu_tanh" if "tanh" in name else "gelu")
    assert (config.grid_side, config.num_table_prefix_rows) == (4, 1)
    run = functools.partial(transformers_outputs, reference)
    check_against(f"{name}/{backend}", ours, run, 1 + registers, **(FLOAT32_TABLE if registers else FLOAT64))
    if registers:
        # the float32 rounding of transformers' resampled table is all that differs: the same rule in
        # float64 (the tower keeps a float64 table in float64) agrees to float64's error
        with timm_table_in_float64(reference):
            check_against(f"{name}/{backend}/float64 table", ours, run, 1 + registers, **FLOAT64)


def test_transformers_folders_are_dinov2_towers_also_once_saved_in_the_own_format(transformers_folders, tmp_path):
    """The family a tower was read as (its default processor rule, its name in messages) survives a save."""
    for _, folder in transformers_folders.values():
        ours = MoonViT.from_pretrained(folder)
        assert (family_of(ours.config).name, tower_name(ours.config)) == ("dinov2", "DINOv2 tower")
        ours.save_pretrained(tmp_path / folder.name)
        again = MoonViT.from_pretrained(tmp_path / folder.name)
        assert family_of(again.config).name == "dinov2"


def test_swiglu_width_is_transformers_rule():
    """Two thirds of the MLP width, rounded up to a multiple of 8: the giant's 4096 of 6144."""
    assert swiglu_hidden_size(6144) == 4096 and swiglu_hidden_size(256) == 176
    reference = REFERENCES["Dinov2Model-swiglu"]()
    assert reference.encoder.layer[0].mlp.gate_proj.out_features == swiglu_hidden_size(256)
    giant = dinov2_preset("dinov2-giant-reg4")
    assert (giant.intermediate_size, giant.mlp_type, giant.num_register_tokens) == (4096, "swiglu", 4)
    assert (giant.hidden_size, giant.num_hidden_layers, giant.num_attention_heads, giant.grid_side) == (
        1536,
        40,
        24,
        37,
    )
    assert dinov2_config("small").intermediate_size == 1536
    with pytest.raises(ValueError, match="unknown DINOv2 size 'huge'"):
        dinov2_config("huge")


def in_memory_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's tensors under transformers 5's in-memory names (what its ``conversion_mapping``
    turns the hub's into): ``attention.q_proj``, ``mlp.gate_proj`` / ``up_proj`` / ``down_proj``."""
    return {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("name", ["Dinov2Model-swiglu", "Dinov2WithRegistersModel"])
def test_a_folder_in_transformers_in_memory_names_loads_the_same(transformers_folders, tmp_path, name):
    reference, folder = transformers_folders[name]
    tensors = in_memory_tensors(reference)
    assert any(".attention.q_proj." in key for key in tensors)
    assert ("swiglu" in name) == any(".mlp.gate_proj." in key for key in tensors)
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    hub, memory = MoonViT.from_pretrained(folder), MoonViT.from_pretrained(tmp_path)
    for key, value in hub.state_dict().items():
        assert torch.equal(memory.state_dict()[key], value), key


# ---- bf16 --------------------------------------------------------------------------------------

BF16_GRIDS = GRIDS * 3


@pytest.mark.parametrize("name", ["Dinov2Model-swiglu", "Dinov2WithRegistersModel"])
def test_bf16_within_the_references_own_bf16_error(transformers_folders, name):
    exact_model, folder = transformers_folders[name]
    half_model = transformers_reference(name, dtype=torch.bfloat16)
    ours = MoonViT.from_pretrained(folder, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    prefix = 1 + registers_of(name)
    images = normal_images(BF16_GRIDS, PATCH, seed=5)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels.to(torch.bfloat16), grids)
    mine = {"patches": out.last_hidden_state, "prefix": out.prefix_tokens.flatten(0, 1), "pooled": out.pooled}

    def rows(model: PreTrainedModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        found = [transformers_outputs(model, image.to(dtype)) for image in images]
        return {
            "patches": torch.cat([f["tokens"][prefix:] for f in found]),
            "prefix": torch.cat([f["tokens"][:prefix] for f in found]),
            "pooled": torch.stack([f["pooler_output"] for f in found]),
        }

    check_bf16(ERRORS, name, mine, rows(half_model, torch.bfloat16), rows(exact_model, torch.float64))


# ---- timm --------------------------------------------------------------------------------------

_TIMM_RENAMES = [  # transformers' hub names -> timm's (the tower's own)
    (r"^embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (r"^embeddings\.position_embeddings$", "pos_embed"),
    (r"^embeddings\.cls_token$", "cls_token"),
    (r"^embeddings\.register_tokens$", "reg_token"),
    (r"^layernorm\.", "norm."),
    (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"blocks.\1.attn.proj."),
    (r"^encoder\.layer\.(\d+)\.layer_scale([12])\.lambda1$", r"blocks.\1.ls\2.gamma"),
    (r"^encoder\.layer\.(\d+)\.mlp\.weights_in\.", r"blocks.\1.mlp.fc1."),
    (r"^encoder\.layer\.(\d+)\.mlp\.weights_out\.", r"blocks.\1.mlp.fc2."),
    (r"^encoder\.layer\.(\d+)\.", r"blocks.\1."),
]


def timm_tensors(hub: dict[str, torch.Tensor], fold: bool) -> dict[str, torch.Tensor]:
    """A transformers DINOv2 folder's tensors under timm's names: q, k, v concatenated into ``qkv``, the
    mask token dropped and, with ``fold`` (timm's register models, ``no_embed_class``), the table's CLS
    row added to the CLS token and dropped from the table, as timm converts the released weights."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hub.items():
        if name == "embeddings.mask_token" or ".attention.attention." in name:
            continue
        for pattern, target in _TIMM_RENAMES:
            if re.match(pattern, name):
                name = re.sub(pattern, target, name)
                break
        out[name] = tensor
    for key in [k for k in hub if k.endswith("attention.attention.query.weight") or k.endswith("query.bias")]:
        layer, kind = re.match(r"^encoder\.layer\.(\d+)\.attention\.attention\.query\.(\w+)$", key).groups()  # type: ignore[union-attr]
        parts = [hub[key.replace(".query.", f".{p}.")] for p in ("query", "key", "value")]
        out[f"blocks.{layer}.attn.qkv.{kind}"] = torch.cat(parts)
    if fold:
        out["cls_token"] = out["cls_token"] + out["pos_embed"][:, :1]
        out["pos_embed"] = out["pos_embed"][:, 1:]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def write_timm_folder(folder: Path, tensors: dict[str, torch.Tensor], architecture: str, **config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architecture": architecture, "num_classes": 0, **config}))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


TIMM_ARGS = dict(embed_dim=64, depth=2, num_heads=4)
TIMM_CASES = {
    # transformers' model, timm's architecture, its config.json besides; the register models fold the table
    "reg": ("Dinov2WithRegistersModel", "vit_test_patch8_reg4_dinov2.lvd142m",
            dict(model_args=dict(TIMM_ARGS, img_size=32), pretrained_cfg=dict(input_size=[3, 518, 518]))),
    "reg-swiglu": ("Dinov2WithRegistersModel-swiglu", "vit_giant_patch8_reg2_dinov2",
                   dict(model_args=dict(TIMM_ARGS, img_size=32, mlp_ratio=2 * 176 / 64))),
    "plain": ("Dinov2Model", "vit_test_patch8_dinov2",
              dict(model_args=TIMM_ARGS, pretrained_cfg=dict(input_size=[3, 32, 32]))),
}  # fmt: skip


@pytest.mark.parametrize("case", TIMM_CASES)
def test_timm_folders_give_the_transformers_models_outputs(transformers_folders, tmp_path, case):
    name, architecture, extra = TIMM_CASES[case]
    reference, folder = transformers_folders[name]
    registers = registers_of(name)
    tensors = timm_tensors(load_file(folder / "model.safetensors"), fold=bool(registers))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = MoonViT.from_pretrained(write_timm_folder(tmp_path, tensors, architecture, **extra))
    assert isinstance(ours, ClassicViT)
    config = ours.config
    assert (config.pos_emb_rule, config.layer_norm_eps, config.grid_side, config.layer_scale) == ("timm", 1e-6, 4, True)
    assert (config.num_register_tokens, config.no_embed_class) == (registers, bool(registers))
    assert config.num_table_prefix_rows == (0 if registers else 1)
    assert (family_of(config).name, tower_name(config)) == ("dinov2", "DINOv2 tower")
    assert config.mlp_type == ("swiglu" if "swiglu" in name else "mlp")
    assert config.intermediate_size == (176 if "swiglu" in name else 256)

    if registers:
        # transformers' register models resample as timm does (antialiased bicubic, in float32): every grid
        run = functools.partial(transformers_outputs, reference)
        check_against(f"timm-{case}", ours, run, 1 + registers, **FLOAT32_TABLE)
        with timm_table_in_float64(reference):
            check_against(f"timm-{case}/float64 table", ours, run, 1 + registers, **FLOAT64)
        return
    # Dinov2Model resamples by plain bicubic, timm with antialias: the same outputs at the native grid, and
    # at every grid those of Dinov2Model with timm's resampling (in float64: the tower keeps a float64 table)
    image = normal_images([(4, 4)], PATCH, seed=2)[0]
    with torch.no_grad():
        out = ours(patchify(image, PATCH), [[4, 4]])
    expected = transformers_outputs(reference, image)
    record(f"timm-{case}/native/patches", out.last_hidden_state, expected["tokens"][1:])
    record(f"timm-{case}/native/pooled", out.pooled[0], expected["pooler_output"])
    with timm_table_in_float64(reference):
        check_against(f"timm-{case}", ours, functools.partial(transformers_outputs, reference), 1, **FLOAT64)


def test_a_timm_head_reads_the_cls_row(transformers_folders, tmp_path):
    """timm's ``head`` on the pooled CLS row (``global_pool "token"``), ``num_classes`` from the config."""
    name, architecture, extra = TIMM_CASES["reg"]
    reference, folder = transformers_folders[name]
    generator = torch.Generator().manual_seed(4)
    weight, bias = (torch.randn(*shape, generator=generator, dtype=torch.float64) for shape in ((3, 64), (3,)))
    tensors = {
        **timm_tensors(load_file(folder / "model.safetensors"), fold=True),
        "head.weight": weight,
        "head.bias": bias,
    }
    ours = MoonViT.from_pretrained(write_timm_folder(tmp_path, tensors, architecture, **{**extra, "num_classes": 3}))
    assert ours.config.num_classes == 3
    image = normal_images([(3, 5)], PATCH, seed=8)[0]
    with torch.no_grad():
        out = ours(patchify(image, PATCH), [[3, 5]])
    expected = torch.nn.functional.linear(transformers_outputs(reference, image)["pooler_output"], weight, bias)
    record("timm-reg/logits", out.logits[0], expected, **FLOAT32_TABLE)


def test_timm_names_give_the_released_sizes_and_their_tables():
    """Read from the architecture alone (and pretrained_cfg's input size), as timm's hub folders are."""
    cases = {
        "vit_small_patch14_dinov2.lvd142m": (384, 12, 6, 1536, "mlp", 0, 37),
        "vit_large_patch14_reg4_dinov2.lvd142m": (1024, 24, 16, 4096, "mlp", 4, 37),
        "vit_giant_patch14_dinov2": (1536, 40, 24, 4096, "swiglu", 0, 37),
        "vit_giant_patch14_reg4_dinov2.lvd142m": (1536, 40, 24, 4096, "swiglu", 4, 37),
    }
    for architecture, (width, depth, heads, mlp, kind, registers, side) in cases.items():
        values = {"architecture": architecture, "num_classes": 0, "pretrained_cfg": {"input_size": [3, 518, 518]}}
        family = find_family(values)
        assert family is not None and family.name == "dinov2", architecture
        config, layout = family.read(values, Path("config.json"), ())
        assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (width, depth, heads)
        assert (config.intermediate_size, config.mlp_type, config.num_register_tokens) == (mlp, kind, registers)
        assert (config.grid_side, config.no_embed_class, config.patch_size) == (side, bool(registers), 14)
        assert layout.name == "timm"
    # Prismatic's (OpenVLA's) tower: the same name, built at 224 px
    values = {"architecture": "vit_large_patch14_reg4_dinov2.lvd142m", "model_args": {"img_size": 224}}
    config, _ = find_family(values).read(values, Path("config.json"), ())  # type: ignore[union-attr]
    assert config.grid_side == 16 and config.num_classes == 0
    # ... and at 384 px: timm's img_size // patch = 27 patches per side (378 px), the rest cut off
    values = {"architecture": "vit_large_patch14_reg4_dinov2.lvd142m", "model_args": {"img_size": 384}}
    config, _ = find_family(values).read(values, Path("config.json"), ())  # type: ignore[union-attr]
    assert (config.grid_side, config.image_size) == (27, 378)


# ---- what the loader reads and refuses -----------------------------------------------------------


def test_the_mask_token_is_ignored_and_a_folder_without_it_loads(transformers_folders, tmp_path):
    folder = transformers_folders["Dinov2Model"][1]
    with_mask = MoonViT.from_pretrained(folder)
    assert not any("mask" in name for name in with_mask.state_dict())
    without = rewrite_tensors(copied_folder(folder, tmp_path / "f"), lambda t: t.pop("embeddings.mask_token"))
    loaded = MoonViT.from_pretrained(without)
    for key, value in with_mask.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize(
    ("name", "gone"),
    [
        ("Dinov2Model", "encoder.layer.1.layer_scale2.lambda1"),
        ("Dinov2Model", "encoder.layer.0.attention.attention.key.weight"),
        ("Dinov2Model-swiglu", "encoder.layer.1.mlp.weights_in.bias"),
        ("Dinov2WithRegistersModel", "embeddings.register_tokens"),
    ],
)
def test_a_missing_tensor_is_named(transformers_folders, tmp_path, name, gone):
    folder = rewrite_tensors(copied_folder(transformers_folders[name][1], tmp_path / "f"), lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=f"missing.*{re.escape(gone)}"):
        MoonViT.from_pretrained(folder)


def test_an_unexpected_tensor_is_named(transformers_folders, tmp_path):
    extra = "encoder.layer.0.attention.attention.relative_position_bias"
    folder = copied_folder(transformers_folders["Dinov2Model"][1], tmp_path / "f")
    rewrite_tensors(folder, lambda t: t.update({extra: torch.zeros(4, dtype=torch.float64)}))
    with pytest.raises(CheckpointError, match=f"unexpected.*{re.escape(extra)}"):
        MoonViT.from_pretrained(folder)


def test_a_classifier_folder_is_refused_by_name(transformers_folders, tmp_path):
    """Dinov2ForImageClassification's head reads [CLS | mean of the patch rows]: not built here."""
    folder = copied_folder(transformers_folders["Dinov2Model"][1], tmp_path / "f")

    def classifier(tensors: dict[str, torch.Tensor]) -> None:
        for name in list(tensors):
            tensors[f"dinov2.{name}"] = tensors.pop(name)
        tensors.update({"classifier.weight": torch.zeros(3, 128), "classifier.bias": torch.zeros(3)})

    rewrite_tensors(folder, classifier)
    with pytest.raises(CheckpointError, match=r"f: the folder has a classifier \(Dinov2ForImageClassification"):
        MoonViT.from_pretrained(folder)


@pytest.mark.parametrize(
    ("name", "change", "named"),
    [
        ("Dinov2Model", lambda c: c.update(hidden_act="relu"), "hidden_act 'relu' is not supported"),
        ("Dinov2Model", lambda c: c.update(image_size=[32, 48]), "image_size"),
        ("Dinov2Model", lambda c: c.update(mlp_ratio=0), "mlp_ratio must be a positive number"),
        ("Dinov2Model", lambda c: c.update(use_swiglu_ffn="yes"), "use_swiglu_ffn must be true or false"),
    ],
    ids=["hidden_act", "image_size", "mlp_ratio", "use_swiglu_ffn"],
)
def test_transformers_configs_the_tower_does_not_build_are_refused_by_key(
    transformers_folders, tmp_path, name, change, named
):
    folder = rewrite_config(copied_folder(transformers_folders[name][1], tmp_path / "f"), change)
    with pytest.raises(CheckpointError, match=named):
        MoonViT.from_pretrained(folder)


def test_swiglu_reads_no_activation(transformers_folders, tmp_path):
    """transformers' SwiGLU is SiLU whatever hidden_act says (its Dinov2SwiGLUFFN never reads it)."""
    folder = rewrite_config(
        copied_folder(transformers_folders["Dinov2Model-swiglu"][1], tmp_path / "f"),
        lambda c: c.update(hidden_act="relu"),
    )
    assert MoonViT.from_pretrained(folder).config.mlp_type == "swiglu"


def timm_folder(tmp_path: Path, transformers_folders, change: Callable[[dict], None]) -> Path:
    name, architecture, extra = TIMM_CASES["reg"]
    tensors = timm_tensors(load_file(transformers_folders[name][1] / "model.safetensors"), fold=True)
    return rewrite_config(write_timm_folder(tmp_path, tensors, architecture, **json.loads(json.dumps(extra))), change)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c["model_args"].update(no_embed_class=False), "register tokens with no_embed_class false"),
        (
            lambda c: c.update(architecture="vit_medium_patch8_dinov2", model_args={}),
            "architecture.*'medium'.*embed_dim",
        ),
        (lambda c: c["model_args"].update(rope="axial"), "model_args rope: not read"),
        (lambda c: c["model_args"].update(qk_norm=True), "model_args qk_norm=True"),
        (lambda c: c.update(global_pool="avg"), "global_pool 'avg'"),
        (
            lambda c: c.update(architecture="vit_giant_patch8_dinov2", model_args=dict(TIMM_ARGS, mlp_ratio=5 / 64)),
            "odd",
        ),
    ],
    ids=["registers with table rows", "unknown size", "unknown argument", "qk_norm", "global_pool", "odd swiglu"],
)
def test_timm_configs_the_tower_does_not_build_are_refused_by_key(tmp_path, transformers_folders, change, named):
    with pytest.raises(CheckpointError, match=named):
        MoonViT.from_pretrained(timm_folder(tmp_path, transformers_folders, change))


def test_a_missing_timm_tensor_is_named(tmp_path, transformers_folders):
    folder = timm_folder(tmp_path, transformers_folders, lambda c: None)
    rewrite_tensors(folder, lambda t: t.pop("blocks.1.ls1.gamma"))
    with pytest.raises(CheckpointError, match=r"missing \['blocks\.1\.ls1\.gamma'\]"):
        MoonViT.from_pretrained(folder)


# ---- a hub id ------------------------------------------------------------------------------------


def test_a_transformers_dinov2_repository_loads_by_hub_id(tmp_path, offline, requested, transformers_folders):  # noqa: F811
    """facebook/dinov2-*'s layout (config.json model_type "dinov2", model.safetensors in the hub's names)."""
    reference, folder = transformers_folders["Dinov2WithRegistersModel"]
    files = {p.name: p for p in folder.iterdir()}
    write_hub_cache(
        offline, "facebook/dinov2-with-registers-tiny-test", files, missing=("model.safetensors.index.json",)
    )
    loaded = MoonViT.from_pretrained("facebook/dinov2-with-registers-tiny-test", dtype=torch.float64)
    assert isinstance(loaded, ClassicViT) and loaded.config.num_register_tokens == 4
    assert "model.safetensors" in requested
    image = normal_images([(3, 5)], PATCH, seed=7)[0]
    with torch.no_grad():
        out = loaded(patchify(image, PATCH), [[3, 5]])
    record("hub/patches", out.last_hidden_state, transformers_outputs(reference, image)["tokens"][5:], **FLOAT32_TABLE)
