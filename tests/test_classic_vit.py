"""The classic ViT / DeiT tower against independent references, its folders' strictness, and the engine
around it.

- transformers' ``ViTModel`` (with and without its pooler), ``ViTForImageClassification``, ``DeiTModel``,
  ``DeiTForImageClassification`` and ``DeiTForImageClassificationWithTeacher``, each run image by image
  with ``interpolate_pos_encoding=True``, against one packed call over a pack of the native grid, larger,
  smaller and odd-sided grids, loaded from the folders their ``save_pretrained`` writes;
- timm's folders against :mod:`reference_vit` (timm's forward with ``dynamic_img_size``, written from its
  description), and the three table rules against hand-built resampling weights and scipy;
- bf16 against the float64 references, within the references' own bf16 error;
- the loader's refusals; attention backends, dropped patches, hidden states, saving, resizing the
  table, the table cache and gradients.

Weights are random (normal, std 0.2, LayerNorm scales 1 + that, tokens and table included) so that a
wrong tensor, rule or row shows far above float64's error.
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import itertools
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.ndimage
import torch
import torch.nn.functional as F
from helpers import (
    FLEX,
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
from reference_vit import TimmViT, resample_abs_pos_embed, save_timm_folder
from transformers import (
    DeiTConfig,
    DeiTForImageClassification,
    DeiTForImageClassificationWithTeacher,
    DeiTModel,
    PreTrainedModel,
    ViTConfig,
    ViTForImageClassification,
    ViTModel,
)

from moonvit import CheckpointError, MoonViT
from moonvit.families.vit import ClassicViT
from moonvit.families.vit.model import resample_table
from moonvit.media.processor import patchify
from moonvit.model import attention, varlen
from moonvit.model.encoder import MoonViTOutput

PATCH = 16
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=64)
CLASSES = 5
# The native 4x4 grid of a 64 px tower at patch 16, larger, smaller and odd-sided ones.
GRIDS = [(4, 4), (6, 3), (2, 5), (7, 7), (3, 1)]
FLOAT64 = dict(rtol=0.0, atol=1e-6)  # the parity bound; the errors measured are ~1e-15 (see ERRORS)
ERRORS: dict[str, float] = {}
"""The largest error each comparison measured, by reference, backend and output: the module's figures,
for a script that runs these tests and prints them."""


# ---- shared builders ---------------------------------------------------------------------------


def per_image(rows: torch.Tensor, grids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(L, D) packed patch rows -> one (h * w, D) tensor per image."""
    return rows.split([int(h) * int(w) for h, w in grids.tolist()])


def record(key: str, actual: torch.Tensor, expected: torch.Tensor, **tolerance: float) -> None:
    """Assert ``actual`` close to ``expected`` (within :data:`FLOAT64` unless told) and keep the largest
    error seen under ``key``."""
    record_error(ERRORS, key, actual, expected, **(tolerance or FLOAT64))


# ---- transformers ------------------------------------------------------------------------------


def vit_config() -> ViTConfig:
    return ViTConfig(**TINY, patch_size=PATCH, num_labels=CLASSES)


def deit_config() -> DeiTConfig:
    return DeiTConfig(**TINY, patch_size=PATCH, num_labels=CLASSES)


REFERENCES: dict[str, Callable[[], PreTrainedModel]] = {
    "ViTModel": lambda: ViTModel(vit_config()),
    "ViTModel-no-pooler": lambda: ViTModel(vit_config(), add_pooling_layer=False),
    "ViTForImageClassification": lambda: ViTForImageClassification(vit_config()),
    "DeiTModel": lambda: DeiTModel(deit_config()),
    "DeiTModel-no-pooler": lambda: DeiTModel(deit_config(), add_pooling_layer=False),
    "DeiTForImageClassification": lambda: DeiTForImageClassification(deit_config()),
    "DeiTForImageClassificationWithTeacher": lambda: DeiTForImageClassificationWithTeacher(deit_config()),
}


def transformers_reference(name: str, seed: int = 0) -> PreTrainedModel:
    """A float64 transformers model of the tiny size with random weights, eval mode; SDPA attention (its
    eager attention takes the softmax in float32 whatever the dtype: ~1e-7 off a float64 reference)."""
    model = REFERENCES[name]().to(torch.float64)
    model.set_attn_implementation("sdpa")
    return randomise_(model, seed).eval()


@pytest.fixture(scope="module")
def transformers_folders(tmp_path_factory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each reference model and the folder its ``save_pretrained`` wrote (float64 tensors, hub names)."""
    return saved_models(tmp_path_factory, REFERENCES, transformers_reference)


def transformers_outputs(model: PreTrainedModel, image: torch.Tensor) -> dict[str, torch.Tensor]:
    """One image through a transformers model: ``tokens`` (T, D) after the final norm, prefix rows first,
    and whichever of ``pooler_output``, ``logits``, ``cls_logits``, ``distillation_logits`` it gives."""
    base = next((getattr(model, name) for name in ("vit", "deit") if hasattr(model, name)), model)
    with torch.no_grad():
        out = model(pixel_values=image.unsqueeze(0), interpolate_pos_encoding=True, output_hidden_states=True)
        tokens = base.layernorm(out.hidden_states[-1])[0]
    if getattr(out, "last_hidden_state", None) is not None:
        torch.testing.assert_close(tokens, out.last_hidden_state[0], rtol=0, atol=1e-14)
    found = {"tokens": tokens}
    for key in ("pooler_output", "logits", "cls_logits", "distillation_logits"):
        value = getattr(out, key, None)
        if value is not None:
            found[key] = value[0]
    return found


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("name", REFERENCES)
def test_transformers_folders_match_their_models_image_by_image(transformers_folders, name, backend):
    reference, folder = transformers_folders[name]
    ours = MoonViT.from_pretrained(folder, dtype=torch.float64, attn_implementation=backend)
    assert isinstance(ours, ClassicViT) and ours.dtype == torch.float64
    config = ours.config
    deit = name.startswith("DeiT")
    prefix = 2 if deit else 1
    assert config.num_prefix_tokens == prefix and config.pos_emb_rule == "transformers"
    assert config.pooler == (name in ("ViTModel", "DeiTModel"))
    assert config.num_classes == (CLASSES if "Classification" in name else 0)
    assert config.distilled_head == name.endswith("WithTeacher")

    images = normal_images(GRIDS, PATCH)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
    assert out.last_hidden_state.shape == (len(pixels), config.hidden_size)
    assert out.prefix_tokens.shape == (len(GRIDS), prefix, config.hidden_size)
    assert torch.equal(out.merged, out.last_hidden_state.unsqueeze(1))
    assert (out.pooler_output is None) == (not config.pooler)
    assert (out.logits is None) == (not config.num_classes)
    assert (out.head_logits is None) == (not config.distilled_head)

    for i, (image, patches) in enumerate(zip(images, per_image(out.last_hidden_state, grids), strict=True)):
        expected = transformers_outputs(reference, image)
        key = f"{name}/{backend}"
        record(f"{key}/patches", patches, expected["tokens"][prefix:])
        record(f"{key}/prefix", out.prefix_tokens[i], expected["tokens"][:prefix])
        record(f"{key}/pooled", out.pooled[i], expected["tokens"][0])
        if "pooler_output" in expected:
            record(f"{key}/pooler_output", out.pooler_output[i], expected["pooler_output"])
        if "logits" in expected:
            record(f"{key}/logits", out.logits[i], expected["logits"])
        if "cls_logits" in expected:
            record(f"{key}/head_logits", out.head_logits[i, 0], expected["cls_logits"])
            record(f"{key}/head_logits", out.head_logits[i, 1], expected["distillation_logits"])


# ---- timm --------------------------------------------------------------------------------------

# timm folders: (architecture, model_args, num_classes); the tiny "test" size is unknown to timm's
# names, so its width, depth and heads come from model_args; deit_tiny reads its width and heads from
# the name, its depth from model_args, and its 64 px table from pretrained_cfg's input_size, not the name.
TIMM_TINY_ARGS = dict(embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0)
TIMM_FOLDERS = {
    "vit": ("vit_test_patch16_64", TIMM_TINY_ARGS, CLASSES),
    "vit-no-head": ("vit_test_patch16_64", TIMM_TINY_ARGS, 0),
    "deit-distilled": ("deit_test_distilled_patch16_64", TIMM_TINY_ARGS, CLASSES),
    "deit-tiny-distilled": ("deit_tiny_distilled_patch16_224", dict(depth=1), CLASSES),
}
TIMM_SIZES = {"tiny": (192, 12, 3)}


def timm_reference(case: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> TimmViT:
    architecture, args, classes = TIMM_FOLDERS[case]
    sizes = dict(zip(("embed_dim", "depth", "num_heads"), TIMM_SIZES.get(architecture.split("_")[1], (0, 0, 0))))
    model = TimmViT(
        img_size=64,
        patch_size=PATCH,
        **{**sizes, **args},
        num_classes=classes,
        distilled="_distilled_" in architecture,
    )
    return randomise_(model.to(dtype), seed).eval()


def write_timm_folder(folder: Path, case: str, model: TimmViT, **extra) -> Path:
    architecture, args, classes = TIMM_FOLDERS[case]
    return save_timm_folder(folder, model, architecture, num_classes=classes, input_size=64, model_args=args, **extra)


@pytest.mark.parametrize("case", TIMM_FOLDERS)
def test_timm_folders_match_timms_forward_image_by_image(tmp_path, case):
    reference = timm_reference(case)
    ours = MoonViT.from_pretrained(write_timm_folder(tmp_path, case, reference), dtype=torch.float64)
    assert isinstance(ours, ClassicViT)
    config = ours.config
    assert config.pos_emb_rule == "timm" and config.layer_norm_eps == 1e-6 and config.image_size == 64
    assert config.hidden_size == reference.norm.normalized_shape[0]
    assert config.num_hidden_layers == len(reference.blocks)
    assert config.num_prefix_tokens == reference.num_prefix_tokens
    assert config.distilled_head == (reference.head_dist is not None)

    images = normal_images(GRIDS, PATCH, seed=3)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
        count = config.num_prefix_tokens
        assert (out.logits is None) == (reference.head is None)
        for i, (image, patches) in enumerate(zip(images, per_image(out.last_hidden_state, grids), strict=True)):
            # timm resamples in float32 (``posemb.float()``) whatever the dtype; this tower keeps a
            # float64 table in float64, so against timm's own rounding the bound is FLOAT64's and
            # against the same rule in float64 it is float64's error.
            for table_dtype, tolerance in ((torch.float32, FLOAT64), (torch.float64, dict(rtol=0, atol=1e-12))):
                expected = reference(image, table_dtype=table_dtype)
                key = f"timm-{case}/{'float32' if table_dtype == torch.float32 else 'float64'} table"
                record(f"{key}/patches", patches, expected["tokens"][count:], **tolerance)
                record(f"{key}/prefix", out.prefix_tokens[i], expected["tokens"][:count], **tolerance)
                record(f"{key}/pooled", out.pooled[i], expected["pooled"], **tolerance)
                if "logits" in expected:
                    record(f"{key}/logits", out.logits[i], expected["logits"], **tolerance)
                if "head_logits" in expected:
                    record(f"{key}/head_logits", out.head_logits[i], expected["head_logits"], **tolerance)


def test_timm_input_size_gives_the_channels_and_side_where_model_args_do_not(tmp_path):
    """timm builds ``in_chans`` and ``img_size`` from ``pretrained_cfg.input_size`` (C, H, W)."""
    reference = randomise_(TimmViT(img_size=48, patch_size=PATCH, in_chans=1, **TIMM_TINY_ARGS).double()).eval()
    architecture = "vit_test_patch16_224"  # the name's 224 gives way to input_size's 48
    folder = save_timm_folder(
        tmp_path, reference, architecture, num_classes=0, input_size=48, model_args=TIMM_TINY_ARGS
    )
    ours = MoonViT.from_pretrained(folder)
    assert (ours.config.num_channels, ours.config.image_size, ours.config.grid_side) == (1, 48, 3)
    image = normal_images([(5, 2)], PATCH, seed=4)[0][:1]
    with torch.no_grad():
        out = ours(patchify(image, PATCH), [[5, 2]])
        expected = reference(image, table_dtype=torch.float64)["tokens"]
    record("timm-vit-grey/patches", out.last_hidden_state, expected[1:], rtol=0, atol=1e-12)


# ---- the table rules ---------------------------------------------------------------------------


def cubic(x: torch.Tensor, a: float) -> torch.Tensor:
    """Keys' cubic convolution kernel with parameter ``a`` (PIL: -0.5; torch's plain bicubic: -0.75)."""
    x = x.abs()
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return torch.where(x <= 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def bicubic_matrix(size_in: int, size_out: int) -> torch.Tensor:
    """(out, in) float64: torch's bicubic without antialias, ``align_corners=False`` (a = -0.75, the
    taps beyond an edge read the edge row)."""
    weights = torch.zeros(size_out, size_in, dtype=torch.float64)
    for i in range(size_out):
        source = (i + 0.5) * size_in / size_out - 0.5
        base = int(np.floor(source))
        for tap in range(base - 1, base + 3):
            weight = cubic(torch.tensor(float(tap - source), dtype=torch.float64), -0.75)
            weights[i, min(max(tap, 0), size_in - 1)] += weight
    return weights


def antialias_matrix(size_in: int, size_out: int) -> torch.Tensor:
    """(out, in) float64: PIL's bicubic resampling (a = -0.5), which torch's ``antialias=True`` follows:
    the kernel widened by the scale when shrinking, taps beyond an edge dropped and the rest renormalised."""
    scale = size_in / size_out
    stretch = max(scale, 1.0)
    weights = torch.zeros(size_out, size_in, dtype=torch.float64)
    for i in range(size_out):
        center = (i + 0.5) * scale
        first, last = max(int(center - 2 * stretch + 0.5), 0), min(int(center + 2 * stretch + 0.5), size_in)
        taps = torch.arange(first, last, dtype=torch.float64)
        row = cubic((taps - center + 0.5) / stretch, -0.5)
        weights[i, first:last] = row / row.sum()
    return weights


def separable(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """(G, G, D) -> (r, c, D): ``rows`` (r, G) along the first side, ``cols`` (c, G) along the second."""
    return torch.einsum("ri,ijd,cj->rcd", rows, table, cols)


def random_table(side: int = 4, dim: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randn(side, side, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 0.2


# (3, 1) and (6, 1): one-column grids, which torch's antialiased kernel gets wrong from an NCHW input
@pytest.mark.parametrize("size", [(6, 6), (6, 3), (2, 5), (7, 7), (3, 1), (6, 1), (1, 3), (1, 1)])
def test_transformers_and_timm_rules_are_their_cubic_kernels(size):
    table, (rows, cols) = random_table(), size
    plain = separable(table, bicubic_matrix(4, rows), bicubic_matrix(4, cols)).reshape(rows * cols, -1)
    smooth = separable(table, antialias_matrix(4, rows), antialias_matrix(4, cols)).reshape(rows * cols, -1)
    torch.testing.assert_close(resample_table(table, rows, cols, "transformers"), plain, rtol=0, atol=1e-12)
    torch.testing.assert_close(resample_table(table, rows, cols, "timm"), smooth, rtol=0, atol=1e-12)
    # timm's own function, in its float32, on a table with a prefix row
    posemb = torch.cat([torch.ones(1, 1, table.shape[-1], dtype=torch.float64), table.reshape(1, 16, -1)], dim=1)
    theirs = resample_abs_pos_embed(posemb, (rows, cols), (4, 4), num_prefix_tokens=1)
    assert torch.equal(theirs[0, 0], posemb[0, 0])
    torch.testing.assert_close(resample_table(table, rows, cols, "timm"), theirs[0, 1:], rtol=0, atol=1e-6)


def test_timm_and_transformers_rules_differ_when_growing():
    """4x4 -> 6x6: PIL's kernel (a = -0.5, timm's antialias) against torch's plain bicubic (a = -0.75)."""
    table = random_table()
    timm = resample_table(table, 6, 6, "timm")
    transformers = resample_table(table, 6, 6, "transformers")
    assert float((timm - transformers).abs().max()) > 1e-3
    # the same grid, the same table: the native grid is the table itself under every rule
    for rule in ("transformers", "timm", "jax"):
        assert torch.equal(resample_table(table, 4, 4, rule), table.reshape(16, -1))


@pytest.mark.parametrize("size", [(6, 6), (6, 3), (2, 5), (7, 7), (3, 1), (6, 1), (1, 3), (1, 1)])
def test_jax_rule_is_scipy_zoom_order_1(size):
    """The original JAX code's ``scipy.ndimage.zoom(posemb_grid, zoom, order=1)`` on the (G, G, D) grid."""
    table, (rows, cols) = random_table(), size
    zoomed = scipy.ndimage.zoom(table.numpy(), (rows / 4, cols / 4, 1), order=1)
    assert zoomed.shape == (rows, cols, table.shape[-1])
    expected = torch.from_numpy(zoomed).reshape(rows * cols, -1)
    torch.testing.assert_close(resample_table(table, rows, cols, "jax"), expected, rtol=0, atol=1e-12)


# ---- bf16 --------------------------------------------------------------------------------------

# Four images of each grid. The error is the RMS over the pack's values, per output: the largest single
# error of a few dozen logits swings by 2x from one set of images to the next (each side's bf16
# rounding is noise), its RMS by some 10%; the largest errors are recorded beside it.
BF16_GRIDS = GRIDS * 4


def reference_rows(run: Callable[[torch.Tensor], dict[str, torch.Tensor]], images: list[torch.Tensor]):
    """``run`` on each image; its outputs concatenated over the images, key by key."""
    rows = [run(image) for image in images]
    return {key: torch.cat([row[key].reshape(-1, row[key].shape[-1]) for row in rows]) for key in rows[0]}


def test_bf16_vit_classifier_within_the_references_own_bf16_error(transformers_folders):
    exact_model, folder = transformers_folders["ViTForImageClassification"]
    half_model = transformers_reference("ViTForImageClassification").to(torch.bfloat16)
    ours = MoonViT.from_pretrained(folder, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    images = normal_images(BF16_GRIDS, PATCH, seed=5)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels.to(torch.bfloat16), grids)
    mine = {"patches": out.last_hidden_state, "pooled": out.pooled, "logits": out.logits}

    def run(model: PreTrainedModel, dtype: torch.dtype) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
        def outputs(image: torch.Tensor) -> dict[str, torch.Tensor]:
            found = transformers_outputs(model, image.to(dtype))
            return {"patches": found["tokens"][1:], "pooled": found["tokens"][0], "logits": found["logits"]}

        return outputs

    exact = reference_rows(run(exact_model, torch.float64), images)
    check_bf16(
        ERRORS, "ViTForImageClassification", mine, reference_rows(run(half_model, torch.bfloat16), images), exact
    )


def test_bf16_timm_deit_distilled_within_the_references_own_bf16_error(tmp_path):
    exact_model = timm_reference("deit-distilled")
    half_model = timm_reference("deit-distilled", dtype=torch.bfloat16)
    ours = MoonViT.from_pretrained(write_timm_folder(tmp_path, "deit-distilled", exact_model), dtype=torch.bfloat16)
    images = normal_images(BF16_GRIDS, PATCH, seed=6)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels.to(torch.bfloat16), grids)
        mine = {
            "patches": out.last_hidden_state,
            "prefix": out.prefix_tokens.flatten(0, 1),
            "head_logits": out.head_logits.flatten(0, 1),
            "logits": out.logits,
        }

        def run(model: TimmViT, dtype: torch.dtype) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
            def outputs(image: torch.Tensor) -> dict[str, torch.Tensor]:
                found = model(image.to(dtype))
                tokens = found["tokens"]
                return {
                    "patches": tokens[2:],
                    "prefix": tokens[:2],
                    "head_logits": found["head_logits"],
                    "logits": found["logits"],
                }

            return outputs

        exact = reference_rows(run(exact_model, torch.float64), images)
        half = reference_rows(run(half_model, torch.bfloat16), images)
    check_bf16(ERRORS, "timm-deit-distilled", mine, half, exact)


# ---- what the loader refuses -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ViTForImageClassification", "DeiTForImageClassificationWithTeacher"])
def test_a_missing_transformers_tensor_is_named(transformers_folders, tmp_path, name):
    base = "vit" if name.startswith("ViT") else "deit"
    gone = f"{base}.encoder.layer.1.attention.attention.key.weight"
    folder = rewrite_tensors(copied_folder(transformers_folders[name][1], tmp_path / "f"), lambda t: t.pop(gone))
    with pytest.raises(CheckpointError, match=f"missing.*{gone}"):
        MoonViT.from_pretrained(folder)


def test_an_unexpected_transformers_tensor_is_named(transformers_folders, tmp_path):
    extra = "embeddings.mask_token"  # ViTForMaskedImageModeling's
    folder = copied_folder(transformers_folders["ViTModel"][1], tmp_path / "f")
    rewrite_tensors(folder, lambda t: t.update({extra: torch.zeros(1, 1, 64, dtype=torch.float64)}))
    with pytest.raises(CheckpointError, match=f"unexpected.*{extra}"):
        MoonViT.from_pretrained(folder)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t.pop("head_dist.bias"), "missing.*head_dist.bias"),
        (lambda t: t.pop("dist_token"), "missing.*dist_token"),
        (
            lambda t: t.update({"blocks.0.ls1.gamma": torch.ones(64, dtype=torch.float64)}),
            "unexpected.*blocks.0.ls1.gamma",
        ),
        (lambda t: t.update({"reg_token": torch.zeros(1, 4, 64, dtype=torch.float64)}), "unexpected.*reg_token"),
    ],
    ids=["missing head_dist", "missing dist_token", "LayerScale", "registers"],
)
def test_timm_tensors_missing_or_unexpected_are_named(tmp_path, change, named):
    folder = rewrite_tensors(write_timm_folder(tmp_path, "deit-distilled", timm_reference("deit-distilled")), change)
    with pytest.raises(CheckpointError, match=named):
        MoonViT.from_pretrained(folder)


def timm_folder(tmp_path: Path, change: Callable[[dict], None]) -> Path:
    return rewrite_config(write_timm_folder(tmp_path, "vit", timm_reference("vit")), change)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c.update(architecture="vit_medium_patch16_64", model_args={}), "architecture.*'medium'.*embed_dim"),
        (lambda c: c.update(global_pool="avg"), "global_pool 'avg'"),
        (lambda c: c["model_args"].update(global_pool="avg"), "global_pool='avg'"),
        (lambda c: c["model_args"].update(init_values=1e-5), "init_values"),
        (lambda c: c["model_args"].update(reg_tokens=4), "reg_tokens"),
        (lambda c: c["model_args"].update(mlp_layer="SwiGLU"), "model_args mlp_layer: not read by the classic-ViT"),
        (lambda c: c["model_args"].update(img_size=[64, 96]), "img_size"),
        (lambda c: c["pretrained_cfg"].update(input_size=[3, 64, 96]), r"input_size \[3, 64, 96\]"),
        (lambda c: c["pretrained_cfg"].update(input_size=[64, 64]), r"input_size \[64, 64\]"),
    ],
    ids=[
        "unknown size",
        "global_pool",
        "model_args global_pool",
        "init_values",
        "reg_tokens",
        "unknown argument",
        "img_size",
        "input_size",
        "input_size 2D",
    ],
)
def test_timm_configs_the_tower_does_not_build_are_refused_by_key(tmp_path, change, named):
    with pytest.raises(CheckpointError, match=named):
        MoonViT.from_pretrained(timm_folder(tmp_path, change))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda c: c.update(hidden_act="gelu_new"), "hidden_act 'gelu_new'"),
        (lambda c: c.update(image_size=[64, 96]), "image_size"),
        (lambda c: c.update(patch_size=[16, 8]), "patch_size"),
    ],
    ids=["hidden_act", "image_size", "patch_size"],
)
def test_transformers_configs_the_tower_does_not_build_are_refused_by_key(
    transformers_folders, tmp_path, change, named
):
    folder = rewrite_config(copied_folder(transformers_folders["ViTModel"][1], tmp_path / "f"), change)
    with pytest.raises(CheckpointError, match=named):
        MoonViT.from_pretrained(folder)


# ---- the engine around the tower ---------------------------------------------------------------

# The mixed pack plus a second 6x3 image: two items of one size share their resampled table rows.
ENGINE_GRIDS = [*GRIDS, (6, 3)]


def tiny_tower(seed: int = 0, dtype: torch.dtype = torch.float64, **overrides) -> ClassicViT:
    """A DeiT-with-teacher tower of the ``vit-tiny`` preset (CLS and distillation tokens, two heads),
    random weights, eval mode."""
    settings = dict(distillation_token=True, num_classes=CLASSES, distilled_head=True, pooler=True)
    model = ClassicViT.from_preset("vit-tiny", **{**settings, **overrides})
    return randomise_(model.to(dtype), seed).eval()


def outputs_of(out: MoonViTOutput) -> dict[str, torch.Tensor]:
    """The output's tensors, by name (the hidden states, if any, as hidden_states.i)."""
    found = {
        f.name: getattr(out, f.name) for f in dataclasses.fields(out) if isinstance(getattr(out, f.name), torch.Tensor)
    }
    found.update({f"hidden_states.{i}": h for i, h in enumerate(out.hidden_states or ())})
    return found


@pytest.fixture
def cpu_varlen(monkeypatch) -> list[list[int]]:
    """The ``varlen`` backend runnable here: torch's ``varlen_attn`` (CUDA, bf16 / fp16 only) replaced
    by softmax attention per item in q's dtype, bounded by the ``cu_seqlens`` it is handed (the real
    kernel runs in tests/test_cuda.py); returns the cu_seqlens of each call."""
    calls: list[list[int]] = []

    def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None):
        assert cu_seq_q.dtype == torch.int32 and cu_seq_k is cu_seq_q and type(max_q) is int
        calls.append(cu_seq_q.tolist())
        outputs = []
        for start, end in itertools.pairwise(calls[-1]):
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))
            outputs.append(F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(0, 1))
        return torch.cat(outputs)

    module = types.ModuleType("torch.nn.attention.varlen")
    module.__spec__ = importlib.machinery.ModuleSpec(module.__name__, None)
    module.varlen_attn = varlen_attn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(varlen, "_found", {})
    backend = attention._BACKENDS["varlen"]
    monkeypatch.setitem(attention._BACKENDS, "varlen", dataclasses.replace(backend, unavailable=lambda d, t: None))
    return calls


def test_attention_backends_agree_on_a_mixed_pack(cpu_varlen):
    model = tiny_tower()
    pixels, grids = patch_pack(normal_images(ENGINE_GRIDS, PATCH, seed=7), PATCH)
    results = {}
    for backend in ("sdpa", "eager", "varlen"):
        model.set_attn_implementation(backend)
        with torch.no_grad():
            results[backend] = outputs_of(model(pixels, grids, output_hidden_states=True))
    # varlen: one call per block over the pack's items, each its 2 prefix tokens then its patches
    bounds = [0, *itertools.accumulate(h * w + 2 for h, w in ENGINE_GRIDS)]
    assert cpu_varlen == [bounds] * model.config.num_hidden_layers
    for backend in ("eager", "varlen"):
        assert results[backend].keys() == results["sdpa"].keys()
        for name, value in results[backend].items():
            record(f"backends/{backend} vs sdpa/{name}", value, results["sdpa"][name], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", [FLEX])
def test_flex_agrees_with_eager_in_float32(backend):
    """flex runs in fp32, bf16 and fp16 only: against eager in float32, within float32's error."""
    model = tiny_tower(dtype=torch.float32)
    pixels, grids = patch_pack(normal_images(ENGINE_GRIDS, PATCH, seed=7, dtype=torch.float32), PATCH)
    results = {}
    for name in ("eager", backend):
        model.set_attn_implementation(name)
        with torch.no_grad():
            results[name] = outputs_of(model(pixels, grids))
    for name, value in results[backend].items():
        record(f"backends/flex vs eager (float32)/{name}", value, results["eager"][name], rtol=1e-5, atol=1e-5)


def parts_reference(model: ClassicViT, image: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """One (C, H, W) image through ``model``'s own weights, written out plainly and unpacked: the patch
    conv, the table resampled to the image's grid (:meth:`ClassicViT.position_table`), only the ``keep``
    patches (each with its own table row), prefix tokens first, softmax attention per head, exact GELU.
    Returns the (prefix + kept, D) token rows after the final norm."""
    config = model.config
    weight, bias = model.patch_embed.proj.weight, model.patch_embed.proj.bias
    x = F.conv2d(image.unsqueeze(0), weight, bias, stride=config.patch_size)[0]  # (D, h, w)
    rows, cols = x.shape[1:]
    x = x.flatten(1).T + model.position_table(rows, cols).reshape(rows * cols, -1)
    if keep is not None:
        x = x[keep]
    count = config.num_prefix_tokens
    prefix = (
        torch.cat([t[0] for t in (model.cls_token, model.dist_token) if t is not None]) + model.pos_embed[0, :count]
    )
    x = torch.cat([prefix, x])
    heads = config.num_attention_heads
    for block in model.blocks:
        q, k, v = block.attn.qkv(block.norm1(x)).unflatten(-1, (3, heads, -1)).permute(1, 2, 0, 3)
        weights = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        x = x + block.attn.proj((weights @ v).transpose(0, 1).flatten(1))
        x = x + block.mlp.fc2(F.gelu(block.mlp.fc1(block.norm2(x))))
    return model.norm(x)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_dropped_patches_each_kept_patch_as_if_the_others_were_absent(backend):
    model = tiny_tower(attn_implementation=backend)
    images = normal_images(ENGINE_GRIDS, PATCH, seed=8)
    pixels, grids = patch_pack(images, PATCH)
    generator = torch.Generator().manual_seed(0)
    keep = []
    for i, (h, w) in enumerate(ENGINE_GRIDS):
        count = {0: h * w, 1: 1}.get(i, max(1, (h * w) // 2))  # all of the first, one patch of the second
        keep.append(torch.randperm(h * w, generator=generator)[:count].sort().values)
    grid = model.prepare_grid(grids, keep=keep)
    assert grid.dropped and grid.seqlens == tuple(len(k) for k in keep)
    kept_pixels = torch.cat([patches[k] for patches, k in zip(pixels.split(grid_sizes(grids)), keep, strict=True)])
    with torch.no_grad():
        out = model(kept_pixels, grid=grid)
        assert out.merged is None and out.last_hidden_state.shape == (len(kept_pixels), 64)
        rows = out.last_hidden_state.split(list(grid.seqlens))
        for i, (image, k) in enumerate(zip(images, keep, strict=True)):
            expected = parts_reference(model, image, k)
            record(f"dropped/{backend}/patches", rows[i], expected[2:], rtol=0, atol=1e-12)
            record(f"dropped/{backend}/prefix", out.prefix_tokens[i], expected[:2], rtol=0, atol=1e-12)
            head = (model.head(expected[0]) + model.head_dist(expected[1])) / 2
            record(f"dropped/{backend}/logits", out.logits[i], head, rtol=0, atol=1e-12)
        # nothing dropped: the same reference, whole images
        full = model(pixels, grids)
        for i, (image, rows_i) in enumerate(zip(images, per_image(full.last_hidden_state, grids), strict=True)):
            expected = parts_reference(model, image)
            record(f"parts/{backend}/patches", rows_i, expected[2:], rtol=0, atol=1e-12)
            record(
                f"parts/{backend}/pooler_output", full.pooler_output[i], model.pooler(expected[0]), rtol=0, atol=1e-12
            )


def grid_sizes(grids: torch.Tensor) -> list[int]:
    return [int(h) * int(w) for h, w in grids.tolist()]


def test_hidden_states_are_patch_rows_and_the_last_normed_is_the_output():
    model = tiny_tower()
    images = normal_images(ENGINE_GRIDS, PATCH, seed=9)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = model(pixels, grids, output_hidden_states=True)
        assert out.hidden_states is not None and len(out.hidden_states) == model.config.num_hidden_layers + 1
        for hidden in out.hidden_states:
            assert hidden.shape == out.last_hidden_state.shape
        torch.testing.assert_close(model.norm(out.hidden_states[-1]), out.last_hidden_state, rtol=0, atol=1e-12)
        # 0: the embeddings (patch projection + table rows), before any block
        tables = [model.position_table(h, w).flatten(0, 1) for h, w in ENGINE_GRIDS]
        embedded = model.patch_embed(pixels) + torch.cat(tables)
        torch.testing.assert_close(out.hidden_states[0], embedded, rtol=0, atol=1e-12)
        # chosen ones, negative from the end, are the same tensors
        chosen = model(pixels, grids, hidden_state_indices=[0, -1])
        assert chosen.hidden_states is not None and len(chosen.hidden_states) == 2
        assert torch.equal(chosen.hidden_states[0], out.hidden_states[0])
        assert torch.equal(chosen.hidden_states[1], out.hidden_states[-1])
        assert model(pixels, grids).hidden_states is None
        with pytest.raises(ValueError, match="hidden_state_indices: 3 is out of range"):
            model(pixels, grids, hidden_state_indices=[3])


@pytest.mark.parametrize("rule", ["transformers", "timm", "jax"])
def test_save_and_load_back_bit_equal(tmp_path, rule):
    model = tiny_tower(pos_emb_rule=rule)
    pixels, grids = patch_pack(normal_images(ENGINE_GRIDS, PATCH, seed=10), PATCH)
    model.save_pretrained(tmp_path)
    loaded = MoonViT.from_pretrained(tmp_path)
    assert isinstance(loaded, ClassicViT) and loaded.dtype == torch.float64
    assert loaded.config.to_dict() == {**model.config.to_dict(), "attn_implementation": "auto"}
    with torch.no_grad():
        before, after = outputs_of(model(pixels, grids)), outputs_of(loaded(pixels, grids))
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name


@pytest.mark.parametrize("rule", ["transformers", "timm", "jax"])
def test_a_resized_table_saves_and_loads_at_its_new_native_grid(tmp_path, rule):
    """``resize_position_table(96)`` on a 64 px tower: the 6x6 grid gets the table it was resampled to
    before, now stored and used as it is, in memory and loaded back."""
    model = tiny_tower(pos_emb_rule=rule)
    images = normal_images([(6, 6), (6, 6), (3, 5)], PATCH, seed=11)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        before = model(pixels, grids)
        table = model.position_table(6, 6).clone()
        model.resize_position_table(96)
    assert model.config.image_size == 96 and model.config.grid_side == 6
    assert model.pos_embed.shape == (1, 2 + 36, 64)
    assert torch.equal(model.pos_embed[0, 2:].detach(), table.flatten(0, 1))
    model.save_pretrained(tmp_path)
    loaded = MoonViT.from_pretrained(tmp_path)
    assert loaded.config.image_size == 96
    six = slice(0, 72)  # the two 6x6 images' patch rows
    with torch.no_grad():
        for resized in (model, loaded):
            after = resized(pixels, grids)
            torch.testing.assert_close(after.last_hidden_state[six], before.last_hidden_state[six], rtol=0, atol=1e-12)
            torch.testing.assert_close(after.logits[:2], before.logits[:2], rtol=0, atol=1e-12)


def test_the_table_cache_follows_in_place_changes_of_the_table():
    model = tiny_tower()
    pixels, grids = patch_pack(normal_images(ENGINE_GRIDS, PATCH, seed=12), PATCH)
    with torch.no_grad():
        first = model(pixels, grids).last_hidden_state
        second = model(pixels, grids).last_hidden_state
        assert torch.equal(first, second)
        # the patch rows only (random: a shift along the width is what the norms remove); a stale
        # cache would keep the old ones
        model.pos_embed[0, 2:].add_(torch.randn(model.pos_embed[0, 2:].shape, dtype=torch.float64))
        changed = model(pixels, grids).last_hidden_state
        assert float((changed - first).abs().max()) > 1e-2
        model.clear_caches()
        assert torch.equal(model(pixels, grids).last_hidden_state, changed)


def test_gradients_reach_the_tokens_the_table_and_every_block_in_training():
    model = tiny_tower().train()
    pixels, grids = patch_pack(normal_images(ENGINE_GRIDS, PATCH, seed=13), PATCH)
    out = model(pixels, grids)
    loss = out.last_hidden_state.square().mean() + out.logits.square().mean()
    loss.backward()
    for name in ("cls_token", "dist_token", "pos_embed"):
        grad = getattr(model, name).grad
        assert grad is not None and bool(grad.abs().gt(0).any()), name
    # every table row is used by some grid of the pack, the prefix rows by every item
    assert bool(model.pos_embed.grad[0].abs().sum(-1).gt(0).all())
    for name, param in model.blocks.named_parameters():
        assert param.grad is not None and bool(param.grad.abs().gt(0).any()), name
    assert model.head.weight.grad is not None and model.head_dist.weight.grad is not None


def test_integer_pixels_name_the_towers_own_processor():
    """Pixels not normalised yet: the error names the tower's own processor (``processor_for``, its family's
    rule), the tower's and its ONNX inputs' alike, not MoonViT's whatever the tower."""
    from moonvit import preset_config
    from moonvit.families.dinov2 import dinov2_preset
    from moonvit.families.siglip import siglip_config
    from moonvit.families.vit import classic_vit_config
    from moonvit.onnx.vit_inputs import vit_onnx_inputs

    towers = {
        "classic ViT / DeiT tower": ClassicViT(classic_vit_config("vit-tiny")),
        "SigLIP tower": ClassicViT(siglip_config("siglip-tiny")),
        "SigLIP2 NaFlex tower": ClassicViT(siglip_config("siglip-tiny", pos_emb_rule="naflex")),
        "DINOv2 tower": ClassicViT(dinov2_preset("dinov2-small", num_hidden_layers=1, image_size=56)),
        "MoonViT tower": MoonViT(preset_config("tiny")),
    }
    for name, tower in towers.items():
        p = tower.config.patch_size
        pixels, grids = torch.zeros(4, 3, p, p, dtype=torch.uint8), torch.tensor([[2, 2]])
        expected = f"got torch.uint8; run the images through the {name}'s image processor (moonvit.processor_for("
        with pytest.raises(TypeError, match=re.escape(expected)) as refused:
            tower(pixels, grids)
        assert "MoonViTImageProcessor" not in str(refused.value), name
        if isinstance(tower, ClassicViT):
            with pytest.raises(TypeError, match=re.escape(f"the {name}'s image processor")):
                vit_onnx_inputs(tower.config, pixels.numpy(), grids.numpy())
