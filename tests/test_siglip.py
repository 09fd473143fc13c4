"""SigLIP and SigLIP2 (NaFlex) as configs of the classic-ViT tower, against transformers, timm's layout and
the loader's contract.

- transformers' ``SiglipVisionModel`` (with and without its MAP head) and ``SiglipModel``'s vision half,
  each run image by image with ``interpolate_pos_encoding=True``, against one packed call over a pack of
  the native grid, larger, smaller and odd-sided grids, loaded from the folders ``save_pretrained`` writes;
- transformers' ``Siglip2VisionModel`` (with and without its head) and ``Siglip2Model``'s vision half,
  given the same patches in its (row, column, channel) layout with ``spatial_shapes`` and a mask of
  ones, one image at a time and as one padded batch;
- bf16 against the float64 references, within transformers' own bf16 error;
- timm's SigLIP folders (written here from a transformers model under timm's names) against the
  transformers model at the native grid, and against it with timm's table resampling
  (:func:`reference_vit.resample_abs_pos_embed`) elsewhere;
- the loader: a full model's text tower never read, missing / unexpected / misshapen tensors named,
  config values refused by name, the hub id of a sharded full model, this package's own folder.

Weights are random (normal, std 0.2, LayerNorm scales 1 + that; the table and the MAP head's probe too),
so that a wrong tensor, rule or row shows far above float64's error.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import normal_images, patch_pack, randomise_, record_error, saved_models
from reference_vit import resample_abs_pos_embed
from safetensors.torch import load_file, save_file
from test_hub import offline, requested, write_hub_cache  # noqa: F401 (fixtures)
from transformers import (
    PreTrainedModel,
    Siglip2Config,
    Siglip2Model,
    Siglip2VisionConfig,
    Siglip2VisionModel,
    SiglipConfig,
    SiglipModel,
    SiglipVisionConfig,
    SiglipVisionModel,
)

from moonvit import CheckpointError, MoonViT
from moonvit.families import family_of, find_family
from moonvit.families.siglip import SiglipLayout, siglip_config
from moonvit.families.vit import ClassicViT, ClassicViTConfig
from moonvit.media.processor import patchify
from moonvit.weights.checkpoint import read_config

PATCH = 8
SIDE = 4  # the table's native grid: 32 px at patch 8 (SigLIP2: num_patches 16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, patch_size=PATCH)
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64)
TEXT_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# The native 4x4 grid, larger, smaller and odd-sided ones.
GRIDS = [(4, 4), (6, 5), (2, 3), (3, 5), (7, 2), (1, 4)]
FLOAT64 = dict(rtol=0.0, atol=1e-12)  # the parity bound against float64 references (errors about 5e-15: ERRORS)
FLOAT32_TABLE = dict(rtol=0.0, atol=1e-6)
"""The bound against SigLIP2 NaFlex: transformers resamples its table in float32 (as the tower does, its
antialiased kernel on another memory layout: errors about 2e-8)."""
ERRORS: dict[str, float] = {}
"""The largest error each comparison measured, by reference, backend and output (bf16: RMS errors, ours and
transformers'): the module's figures, for a script that runs these tests and prints them."""


# ---- shared builders ---------------------------------------------------------------------------


def naflex_patches(image: torch.Tensor) -> torch.Tensor:
    """(h * w, p * p * C): SigLIP2's processor's patches, each flattened as (row, column, channel)."""
    return patchify(image, PATCH).permute(0, 2, 3, 1).flatten(1)


def record(key: str, actual: torch.Tensor, expected: torch.Tensor, **tolerance: float) -> None:
    """Assert ``actual`` within :data:`FLOAT64` (unless told) of ``expected`` and keep the largest error seen
    under ``key``."""
    record_error(ERRORS, key, actual, expected, **(tolerance or FLOAT64))


def rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).pow(2).mean().sqrt())


# ---- transformers references -------------------------------------------------------------------


def siglip_vision(head: bool = True, act: str = "gelu_pytorch_tanh") -> SiglipVisionConfig:
    return SiglipVisionConfig(**VISION, image_size=SIDE * PATCH, vision_use_head=head, hidden_act=act)


def siglip2_vision(head: bool = True) -> Siglip2VisionConfig:
    return Siglip2VisionConfig(**VISION, num_patches=SIDE * SIDE, vision_use_head=head)


REFERENCES: dict[str, Callable[[], PreTrainedModel]] = {
    "SiglipVisionModel": lambda: SiglipVisionModel(siglip_vision()),
    "SiglipVisionModel-no-head": lambda: SiglipVisionModel(siglip_vision(head=False)),
    "SiglipModel": lambda: SiglipModel(
        SiglipConfig(vision_config=siglip_vision().to_dict(), text_config=TEXT, **TEXT_IDS)
    ),
    "Siglip2VisionModel": lambda: Siglip2VisionModel(siglip2_vision()),
    "Siglip2VisionModel-no-head": lambda: Siglip2VisionModel(siglip2_vision(head=False)),
    "Siglip2Model": lambda: Siglip2Model(
        Siglip2Config(vision_config=siglip2_vision().to_dict(), text_config=TEXT, **TEXT_IDS)
    ),
}
SIGLIP = [name for name in REFERENCES if not name.startswith("Siglip2")]
SIGLIP2 = [name for name in REFERENCES if name.startswith("Siglip2")]


def transformers_reference(name: str, seed: int = 0) -> PreTrainedModel:
    """A float64 transformers model of the tiny size with random weights, eval mode, SDPA attention (its
    eager attention takes the softmax in float32 whatever the dtype)."""
    model = REFERENCES[name]().to(torch.float64)
    model.set_attn_implementation("sdpa")
    return randomise_(model, seed).eval()


def vision_half(model: PreTrainedModel) -> PreTrainedModel:
    """The vision tower of a full model (``vision_model``), or the vision model itself."""
    return getattr(model, "vision_model", model)


@pytest.fixture(scope="module")
def transformers_folders(tmp_path_factory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each reference model and the folder its ``save_pretrained`` wrote (float64 tensors)."""
    return saved_models(tmp_path_factory, REFERENCES, transformers_reference)


def siglip_outputs(model: PreTrainedModel, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One image through a SigLIP vision model: (h * w, D) patch rows, (D,) pooler output or None."""
    with torch.no_grad():
        out = vision_half(model)(pixel_values=image.unsqueeze(0), interpolate_pos_encoding=True)
    return out.last_hidden_state[0], None if out.pooler_output is None else out.pooler_output[0]


def siglip2_outputs(
    model: PreTrainedModel, images: list[torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Images through a SigLIP2 vision model as one padded batch (the processor's layout: patches up to the
    longest image, a mask of ones over each image's own): each image's (h * w, D) rows and pooler output."""
    grids = [(image.shape[1] // PATCH, image.shape[2] // PATCH) for image in images]
    longest = max(h * w for h, w in grids)
    dtype = next(model.parameters()).dtype
    pixels = torch.zeros(len(images), longest, 3 * PATCH * PATCH, dtype=dtype)
    mask = torch.zeros(len(images), longest, dtype=torch.long)
    for i, image in enumerate(images):
        rows = naflex_patches(image)
        pixels[i, : len(rows)], mask[i, : len(rows)] = rows.to(dtype), 1
    with torch.no_grad():
        out = vision_half(model)(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=torch.tensor(grids))
    pooled = out.pooler_output
    return [
        (out.last_hidden_state[i, : h * w], None if pooled is None else pooled[i]) for i, (h, w) in enumerate(grids)
    ]


# ---- float64 parity ----------------------------------------------------------------------------


def check_outputs(
    ours: ClassicViT, key: str, expected: list[tuple[torch.Tensor, torch.Tensor | None]], **tolerance: float
) -> None:
    """The packed call over :data:`GRIDS` against each image's expected (rows, pooled), within :data:`FLOAT64`
    unless told."""
    pixels, grids = patch_pack(normal_images(GRIDS, PATCH), PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
    dim = ours.config.hidden_size
    assert out.last_hidden_state.shape == (len(pixels), dim) and out.pooled.shape == (len(GRIDS), dim)
    assert out.prefix_tokens.shape == (len(GRIDS), 0, dim) and out.logits is None
    assert torch.equal(out.merged, out.last_hidden_state.unsqueeze(1))
    lengths = [int(h) * int(w) for h, w in grids.tolist()]
    for i, (rows, (want_rows, want_pooled)) in enumerate(zip(out.last_hidden_state.split(lengths), expected)):
        record(f"{key}/patches", rows, want_rows, **tolerance)
        # without the head, pooled is the mean of the patch rows (documented; transformers has none)
        record(f"{key}/pooled", out.pooled[i], want_rows.mean(0) if want_pooled is None else want_pooled, **tolerance)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("name", SIGLIP)
def test_siglip_folders_match_transformers_image_by_image(transformers_folders, name, backend):
    reference, folder = transformers_folders[name]
    ours = MoonViT.from_pretrained(folder, dtype=torch.float64, attn_implementation=backend)
    assert isinstance(ours, ClassicViT) and ours.dtype == torch.float64 and ours.config.family == "siglip"
    head = not name.endswith("no-head")
    assert ours.config.pool == ("map" if head else "avg") and (ours.attn_pool is not None) == head
    assert (ours.config.pos_emb_rule, ours.config.hidden_act, ours.config.num_prefix_tokens) == (
        "transformers",
        "gelu_tanh",
        0,
    )
    expected = [siglip_outputs(reference, image) for image in normal_images(GRIDS, PATCH)]
    check_outputs(ours, f"{name}/{backend}", expected)


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("name", SIGLIP2)
def test_siglip2_folders_match_transformers_image_by_image_and_padded(transformers_folders, name, backend):
    reference, folder = transformers_folders[name]
    ours = MoonViT.from_pretrained(folder, dtype=torch.float64, attn_implementation=backend)
    assert isinstance(ours, ClassicViT) and ours.config.pos_emb_rule == "naflex" and ours.config.grid_side == SIDE
    assert ours.config.family == "siglip2"
    images = normal_images(GRIDS, PATCH)
    alone = [siglip2_outputs(reference, [image])[0] for image in images]
    check_outputs(ours, f"{name}/{backend}", alone, **FLOAT32_TABLE)
    check_outputs(ours, f"{name}/{backend}/padded-batch", siglip2_outputs(reference, images), **FLOAT32_TABLE)


def test_a_full_model_builds_the_tower_its_vision_model_builds(transformers_folders):
    for full, alone in (("SiglipModel", "SiglipVisionModel"), ("Siglip2Model", "Siglip2VisionModel")):
        config, _ = read_config(transformers_folders[full][1])
        assert config == read_config(transformers_folders[alone][1])[0]


# ---- bf16 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SiglipVisionModel", "Siglip2VisionModel"])
def test_bf16_within_transformers_own_bf16_error(transformers_folders, name):
    reference, folder = transformers_folders[name]
    images = normal_images(GRIDS, PATCH)
    naflex = name.startswith("Siglip2")

    def run(model: PreTrainedModel) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        if naflex:
            return siglip2_outputs(model, images)
        dtype = next(model.parameters()).dtype
        return [siglip_outputs(model, image.to(dtype)) for image in images]

    exact = run(reference)
    theirs = run(transformers_reference(name).to(torch.bfloat16))
    ours = MoonViT.from_pretrained(folder, dtype=torch.bfloat16)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels.to(torch.bfloat16), grids)
    assert out.last_hidden_state.dtype == torch.bfloat16
    lengths = [int(h) * int(w) for h, w in grids.tolist()]
    for part, mine in (("patches", out.last_hidden_state.split(lengths)), ("pooled", list(out.pooled))):
        index = 0 if part == "patches" else 1
        want = torch.cat([e[index].reshape(-1) for e in exact])  # type: ignore[union-attr]
        their_error = rms(torch.cat([t[index].reshape(-1) for t in theirs]), want)  # type: ignore[union-attr]
        our_error = rms(torch.cat([m.reshape(-1) for m in mine]), want)
        ERRORS[f"{name}/bf16/{part}/ours"], ERRORS[f"{name}/bf16/{part}/transformers"] = our_error, their_error
        assert our_error <= 1.25 * their_error + 1e-3, (part, our_error, their_error)


# ---- timm's folders ----------------------------------------------------------------------------


def timm_names(name: str) -> str:
    """A transformers SigLIP tensor name (unprefixed) -> timm's, written out from timm's module names."""
    fixed = {
        "embeddings.patch_embedding.weight": "patch_embed.proj.weight",
        "embeddings.patch_embedding.bias": "patch_embed.proj.bias",
        "embeddings.position_embedding.weight": "pos_embed",
        "post_layernorm.weight": "norm.weight",
        "post_layernorm.bias": "norm.bias",
        "head.probe": "attn_pool.latent",
    }
    if name in fixed:
        return fixed[name]
    for theirs, timm in (
        ("encoder.layers.", "blocks."),
        ("layer_norm1", "norm1"),
        ("layer_norm2", "norm2"),
        ("self_attn.out_proj", "attn.proj"),
        ("head.attention.out_proj", "attn_pool.proj"),
        ("head.layernorm", "attn_pool.norm"),
        ("head.mlp", "attn_pool.mlp"),
    ):
        name = name.replace(theirs, timm)
    return name


def write_timm_folder(
    folder: Path, model: PreTrainedModel, architecture: str, head: torch.nn.Linear | None = None, **config: Any
) -> Path:
    """A transformers SigLIP vision model's weights as a timm hub folder: the tensors renamed, each block's
    q, k, v joined into ``attn.qkv`` and the head's ``in_proj`` cut into ``attn_pool.q`` and ``attn_pool.kv``,
    the table (1, N, D); ``config.json`` with ``architecture``, ``model_args`` (the tiny size) and ``config``."""
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    tensors: dict[str, torch.Tensor] = {}
    for index in range(VISION["num_hidden_layers"]):
        layer = f"encoder.layers.{index}.self_attn."
        for kind in ("weight", "bias"):
            parts = [state.pop(f"{layer}{p}_proj.{kind}") for p in "qkv"]
            tensors[f"blocks.{index}.attn.qkv.{kind}"] = torch.cat(parts)
    dim = VISION["hidden_size"]
    for kind in ("weight", "bias"):
        in_proj = state.pop(f"head.attention.in_proj_{kind}", None)
        if in_proj is not None:
            tensors[f"attn_pool.q.{kind}"], tensors[f"attn_pool.kv.{kind}"] = in_proj[:dim], in_proj[dim:]
    tensors.update({timm_names(name): tensor for name, tensor in state.items()})
    tensors["pos_embed"] = tensors["pos_embed"].unsqueeze(0)
    if head is not None:
        tensors["head.weight"], tensors["head.bias"] = head.weight.detach(), head.bias.detach()
    folder.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, folder / "model.safetensors")
    values = {
        "architecture": architecture,
        "num_features": dim,
        "pretrained_cfg": {"input_size": [3, SIDE * PATCH, SIDE * PATCH], "interpolation": "bicubic"},
        "model_args": dict(
            embed_dim=dim,
            depth=VISION["num_hidden_layers"],
            num_heads=VISION["num_attention_heads"],
            mlp_ratio=VISION["intermediate_size"] / dim,
            patch_size=PATCH,
        ),
        **config,
    }
    (folder / "config.json").write_text(json.dumps(values, indent=2))
    return folder


def timm_table_outputs(model: PreTrainedModel, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The transformers model with timm's table rule (bicubic with antialias, the native square grid
    unchanged) in place of its own: a plain reference of a timm SigLIP's forward. Computed in the table's
    dtype (timm: float32 or wider; float64 here, as the tower computes a float64 table)."""
    embeddings = model.embeddings
    table = embeddings.position_embedding.weight.unsqueeze(0)

    def timm_rule(rows: torch.Tensor, height: int, width: int) -> torch.Tensor:
        grid = (height // PATCH, width // PATCH)
        return resample_abs_pos_embed(table, grid, num_prefix_tokens=0, compute_dtype=table.dtype)

    embeddings.interpolate_pos_encoding = timm_rule
    try:
        return siglip_outputs(model, image)
    finally:
        del embeddings.interpolate_pos_encoding


# architecture -> (transformers' activation for the same tower, global_pool, classes)
TIMM_CASES = {
    "vit_so400m_patch16_siglip_256": ("gelu_pytorch_tanh", "map", 0),  # timm builds it with tanh GELU
    "vit_base_patch16_siglip_224": ("gelu", "map", 3),  # ... and this one with exact GELU; a head
    "vit_so400m_patch16_siglip_gap_384": ("gelu_pytorch_tanh", "avg", 0),  # GAP: no attn_pool
}


@pytest.mark.parametrize("architecture", TIMM_CASES)
def test_timm_folders_match_transformers_up_to_the_table_rule(tmp_path, architecture):
    act, pool, classes = TIMM_CASES[architecture]
    reference = randomise_(SiglipVisionModel(siglip_vision(head=pool == "map", act=act)).double(), 3).eval()
    reference.set_attn_implementation("sdpa")
    head = (
        randomise_(torch.nn.Linear(VISION["hidden_size"], classes).double(), 4).requires_grad_(False)
        if classes
        else None
    )
    config = {"num_classes": classes, "global_pool": pool}
    folder = write_timm_folder(tmp_path / "timm", reference, architecture, head, **config)

    ours = MoonViT.from_pretrained(folder, dtype=torch.float64)
    assert (
        isinstance(ours, ClassicViT) and find_family(json.loads((folder / "config.json").read_text())).name == "siglip"
    )  # type: ignore[union-attr]
    assert (ours.config.pos_emb_rule, ours.config.pool, ours.config.num_classes) == ("timm", pool, classes)
    assert ours.config.family == "siglip"
    assert ours.config.hidden_act == ("gelu_tanh" if act == "gelu_pytorch_tanh" else "gelu")
    assert ours.config.layer_norm_eps == 1e-6 and ours.config.intermediate_size == VISION["intermediate_size"]

    images = normal_images(GRIDS, PATCH, seed=2)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
    lengths = [int(h) * int(w) for h, w in grids.tolist()]
    for i, (image, rows) in enumerate(zip(images, out.last_hidden_state.split(lengths))):
        native = image.shape[1:] == (SIDE * PATCH, SIDE * PATCH)
        # the native grid: timm's table unchanged, as transformers'; elsewhere timm's resampling
        want_rows, want_pooled = siglip_outputs(reference, image) if native else timm_table_outputs(reference, image)
        key = f"timm/{architecture}" + ("/native" if native else "")
        record(f"{key}/patches", rows, want_rows)
        pooled = want_rows.mean(0) if want_pooled is None else want_pooled
        record(f"{key}/pooled", out.pooled[i], pooled)
        if head is not None:
            record(f"{key}/logits", out.logits[i], head(pooled))


def test_timm_s_table_rule_is_not_transformers_at_other_grids(tmp_path):
    """The float64 comparisons above tell the two rules apart: timm's antialiased float32 bicubic is far from
    transformers' plain bicubic on a non-native grid (so a wrong rule could not pass them)."""
    reference = randomise_(SiglipVisionModel(siglip_vision()).double(), 3).eval()
    image = normal_images([(6, 5)], PATCH)[0]
    timm_rows, _ = timm_table_outputs(reference, image)
    transformers_rows, _ = siglip_outputs(reference, image)
    assert (timm_rows - transformers_rows).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("architecture", "size"),
    [
        ("vit_so400m_patch14_siglip_224", (1152, 27, 16, 4304, 14, 224, "gelu")),
        ("vit_so400m_patch14_siglip_384", (1152, 27, 16, 4304, 14, 384, "gelu")),
        ("vit_so400m_patch16_siglip_256", (1152, 27, 16, 4304, 16, 256, "gelu_tanh")),
        ("vit_base_patch16_siglip_224", (768, 12, 12, 3072, 16, 224, "gelu")),
        ("vit_base_patch32_siglip_256", (768, 12, 12, 3072, 32, 256, "gelu_tanh")),
        ("vit_large_patch16_siglip_256", (1024, 24, 16, 4096, 16, 256, "gelu")),
        ("vit_large_patch16_siglip_512", (1024, 24, 16, 4096, 16, 512, "gelu_tanh")),
        ("vit_giantopt_patch16_siglip_384", (1536, 40, 16, 6144, 16, 384, "gelu_tanh")),
    ],
)
def test_timm_architecture_names_give_timm_s_sizes(tmp_path, architecture, size):
    """The sizes and GELUs of timm's SigLIP architectures (its ``vision_transformer.py`` registrations), read
    from a hub config.json (``num_classes`` 0, ``global_pool`` map, ``pretrained_cfg``) without tensors."""
    width, depth, heads, mlp, patch, pixels, act = size
    values = {
        "architecture": architecture,
        "num_classes": 0,
        "num_features": width,
        "global_pool": "map",
        "pretrained_cfg": {"input_size": [3, pixels, pixels], "num_classes": 0},
    }
    family = find_family(values)
    assert family is not None and family.name == "siglip"
    config, layout = family.read(values, tmp_path / "config.json", ())
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (width, depth, heads)
    table = pixels // patch * patch  # timm's table: (img_size // patch)² rows (27 x 27 at 384 px, patch 14)
    assert (config.intermediate_size, config.patch_size, config.image_size) == (mlp, patch, table)
    assert config.hidden_act == act
    assert (config.pool, config.class_token, config.pos_emb_rule, layout.name) == ("map", False, "timm", "timm")


# ---- loading -----------------------------------------------------------------------------------


def write_sharded(folder: Path, tensors: dict[str, torch.Tensor], config: Path, tower: str = "vision_model.") -> None:
    """``tensors`` as two shards behind an index: the vision tower's (names under ``tower``), and everything
    else's (a full model's text tower; a VLM's language model and projector)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(config.read_text())
    shards: dict[str, dict[str, torch.Tensor]] = {"model-00001-of-00002.safetensors": {}}
    shards["model-00002-of-00002.safetensors"] = {}
    for name, tensor in tensors.items():
        shards[f"model-0000{1 if name.startswith(tower) else 2}-of-00002.safetensors"][name] = tensor
    weight_map = {name: shard for shard, part in shards.items() for name in part}
    for shard, part in shards.items():
        save_file(part, folder / shard)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("name", ["SiglipModel", "Siglip2Model"])
def test_a_full_model_reads_its_vision_half_only(transformers_folders, tmp_path, name):
    _, folder = transformers_folders[name]
    tensors = load_file(folder / "model.safetensors")
    assert {"logit_scale", "logit_bias"} <= set(tensors) and any(n.startswith("text_model.") for n in tensors)
    write_sharded(tmp_path, tensors, folder / "config.json")
    (tmp_path / "model-00002-of-00002.safetensors").unlink()  # the text tower's shard: never opened
    ours = MoonViT.from_pretrained(tmp_path, dtype=torch.float64)
    reference = MoonViT.from_pretrained(folder, dtype=torch.float64)
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), reference.state_dict().values()))
    _, layout = read_config(tmp_path)
    assert (layout.prefix, layout.base) == ("vision_model.", "vision_model.")


def test_a_hub_siglip_model_fetches_its_vision_shard_alone(transformers_folders, tmp_path, offline, requested):  # noqa: F811
    _, folder = transformers_folders["SiglipModel"]
    write_sharded(tmp_path / "repo", load_file(folder / "model.safetensors"), folder / "config.json")
    write_hub_cache(offline, "google/siglip-tiny-test", {p.name: p for p in (tmp_path / "repo").iterdir()})
    loaded = MoonViT.from_pretrained("google/siglip-tiny-test", dtype=torch.float64)
    assert isinstance(loaded, ClassicViT) and loaded.config.pool == "map"
    assert "model-00001-of-00002.safetensors" in requested
    assert "model-00002-of-00002.safetensors" not in requested  # the text tower's shard


def rewrite(folder: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of ``folder`` with its tensors edited in place by ``edit``."""
    target.mkdir(parents=True)
    (target / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def test_missing_unexpected_and_misshapen_tensors_are_named(transformers_folders, tmp_path):
    _, folder = transformers_folders["SiglipVisionModel"]
    missing = rewrite(folder, tmp_path / "missing", lambda t: t.pop("head.probe"))
    with pytest.raises(CheckpointError, match=r"missing \['head\.probe'\]"):
        MoonViT.from_pretrained(missing)
    extra = rewrite(folder, tmp_path / "extra", lambda t: t.update(stray=torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected \['stray'\]"):
        MoonViT.from_pretrained(extra)

    # a head that the config says is not there
    _, no_head = transformers_folders["SiglipVisionModel-no-head"]
    headed = rewrite(no_head, tmp_path / "headed", lambda t: t.update(load_file(folder / "model.safetensors")))
    with pytest.raises(CheckpointError, match=r"unexpected .*head\.attention\.in_proj_bias"):
        MoonViT.from_pretrained(headed)

    # SigLIP2's patch weight, stored as its Linear: the stored shape is checked, and named
    _, folder2 = transformers_folders["Siglip2VisionModel"]
    name = "embeddings.patch_embedding.weight"
    short = rewrite(folder2, tmp_path / "short", lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{name}: \(32, 191\), expected \(32, 192\)"):
        MoonViT.from_pretrained(short)
    # SigLIP's table, stored as (N, D)
    table = "embeddings.position_embedding.weight"
    cubed = rewrite(folder, tmp_path / "cubed", lambda t: t.update({table: t[table][None].contiguous()}))
    with pytest.raises(CheckpointError, match=rf"{table}: \(1, 16, 32\), expected \(16, 32\)"):
        MoonViT.from_pretrained(cubed)


def test_prefixed_vision_model_folders_load_as_the_hub_stores_them(transformers_folders, tmp_path):
    """transformers 4 and the hub keep a SiglipVisionModel's tensors under ``vision_model.``; transformers 5
    writes them unprefixed. Both load to the same tower, and a stray tensor beside the prefixed ones is named."""
    _, folder = transformers_folders["SiglipVisionModel"]
    prefixed = rewrite(
        folder, tmp_path / "prefixed", lambda t: t.update({f"vision_model.{n}": t.pop(n) for n in list(t)})
    )
    a, b = MoonViT.from_pretrained(folder), MoonViT.from_pretrained(prefixed)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    stray = rewrite(prefixed, tmp_path / "stray", lambda t: t.update(logit_scale=torch.zeros(1)))
    with pytest.raises(CheckpointError, match=r"unexpected \['logit_scale'\]"):
        MoonViT.from_pretrained(stray)


@pytest.mark.parametrize(
    ("vision", "message"),
    [
        ({"hidden_act": "quick_gelu"}, r"hidden_act 'quick_gelu' is not supported"),
        ({"num_patches": 20}, r"num_patches 20 is not a square number"),
        ({"vision_use_head": "yes"}, r"vision_use_head must be true or false"),
        ({"patch_size": [8, 4]}, r"patch_size \[8, 4\]: only square sizes"),
    ],
)
def test_config_values_the_tower_cannot_build_are_named(tmp_path, vision, message):
    values = {**siglip2_vision().to_dict(), **vision}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        read_config(tmp_path)


def test_unread_config_keys_are_named_in_a_warning(tmp_path):
    values = {**siglip_vision().to_dict(), "num_hiden_layers": 3}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.warns(UserWarning, match=r"ignoring keys this package does not read: num_hiden_layers$"):
        read_config(tmp_path)


TIMM_TINY = {"architecture": "vit_base_patch16_siglip_224", "model_args": {"embed_dim": 32, "depth": 1, "num_heads": 2}}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            {"mlp_layer": "SwiGLU", "num_reg_tokens": 4},
            "model_args mlp_layer, num_reg_tokens: not read by the SigLIP tower",
        ),
        ({"reg_tokens": 4}, r"model_args reg_tokens=4 is not supported by the SigLIP tower \(only 0\)"),
        ({"fc_norm": True}, r"model_args fc_norm=True is not supported by the SigLIP tower \(only False\)"),
    ],
)
def test_timm_model_args_the_tower_does_not_build_are_refused_by_key(tmp_path, args, message):
    """A timm argument the SigLIP tower does not build is refused by key, as the classic ViT's and DINOv2's timm
    readers refuse theirs, not read past with a warning; the harmless ones (dropouts, initialisation, timm's
    dynamic size) and fc_norm's default (None) are read silently."""
    values = {**TIMM_TINY, "model_args": {**TIMM_TINY["model_args"], **args}}
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        read_config(tmp_path)
    harmless = {"drop_path_rate": 0.1, "weight_init": "jax", "dynamic_img_size": True, "fc_norm": None}
    (tmp_path / "config.json").write_text(
        json.dumps({**TIMM_TINY, "model_args": {**TIMM_TINY["model_args"], **harmless}})
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, _ = read_config(tmp_path)
    assert (config.hidden_size, config.num_hidden_layers, config.family) == (32, 1, "siglip")


SO400M = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        # google/siglip-so400m-patch14-384: 384 // 14 = 27 rows per side
        (
            {"model_type": "siglip", "vision_config": {**SO400M, "image_size": 384, "patch_size": 14}},
            ("siglip", 27, 378, "transformers", "map"),
        ),
        # PaliGemma's tower, without the head
        (
            {
                "model_type": "siglip_vision_model",
                **SO400M,
                "image_size": 224,
                "patch_size": 14,
                "vision_use_head": False,
            },
            ("siglip", 16, 224, "transformers", "avg"),
        ),
        # google/siglip2-so400m-patch16-naflex: num_patches 256, a 16 x 16 table
        (
            {"model_type": "siglip2", "vision_config": {**SO400M, "num_patches": 256, "patch_size": 16}},
            ("siglip2", 16, 256, "naflex", "map"),
        ),
    ],
)
def test_the_released_configs_give_their_towers(tmp_path, values, expected):
    family = find_family(values)
    assert family is not None
    config, layout = family.read(values, tmp_path / "config.json", ())
    assert (family.name, config.grid_side, config.image_size, config.pos_emb_rule, config.pool) == expected
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (1152, 27, 4304)
    assert (config.hidden_act, config.layer_norm_eps, config.class_token) == ("gelu_tanh", 1e-6, False)
    assert layout.prefix == ("vision_model." if "vision_config" in values else "")


# ---- this package's own folder, and writing transformers' names back ----------------------------


@pytest.mark.parametrize("name", ["Siglip2VisionModel", "SiglipVisionModel-no-head"])
def test_a_loaded_tower_saves_and_reloads_as_the_same_tower(transformers_folders, tmp_path, name):
    _, folder = transformers_folders[name]
    tower = MoonViT.from_pretrained(folder, dtype=torch.float64)
    tower.save_pretrained(tmp_path)  # this package's classic-ViT folder
    values = json.loads((tmp_path / "config.json").read_text())
    assert values["model_type"] == "classic_vit" and find_family(values).name == "classic-vit"  # type: ignore[union-attr]
    again = MoonViT.from_pretrained(tmp_path)
    assert type(again) is ClassicViT and again.config == tower.config
    # the family it was read as travels in the saved config: the commands still ask SigLIP's spec
    assert family_of(again.config).name == ("siglip2" if name.startswith("Siglip2") else "siglip")  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), tower.state_dict().values()))
    pixels, grids = patch_pack(normal_images(GRIDS[:3], PATCH), PATCH)
    with torch.no_grad():
        assert torch.equal(again(pixels, grids).pooled, tower(pixels, grids).pooled)


def test_the_layout_writes_transformers_names_back_exactly(transformers_folders):
    """Loading then writing gives the folder's own tensors back: SigLIP2's Linear patch weight in its (row,
    column, channel) order, SigLIP's (N, D) table, q / k / v apart again."""
    for name in ("Siglip2VisionModel", "SiglipModel"):
        _, folder = transformers_folders[name]
        tower = MoonViT.from_pretrained(folder, dtype=torch.float64)
        _, layout = read_config(folder)
        assert isinstance(layout, SiglipLayout)
        written = layout.checkpoint_tensors(tower.state_dict())
        stored = {n: t for n, t in load_file(folder / "model.safetensors").items() if n.startswith(layout.prefix)}
        assert written.keys() == stored.keys()
        for key, tensor in stored.items():
            assert torch.equal(written[key], tensor), key


def test_siglip2_s_patch_weight_is_the_conv_over_channel_first_patches():
    """The conversion itself: SigLIP2's Linear over (row, column, channel) patches equals the tower's
    Conv2d-shaped weight over (channel, row, column) patches, patch by patch."""
    layout = SiglipLayout("naflex", "", "", PATCH, 3)
    linear = torch.randn(5, PATCH * PATCH * 3, dtype=torch.float64)
    conv = layout.source("patch_embed.proj.weight").combine([linear])
    patches = torch.randn(7, 3, PATCH, PATCH, dtype=torch.float64)
    flat = patches.permute(0, 2, 3, 1).flatten(1)
    torch.testing.assert_close(patches.flatten(1) @ conv.flatten(1).T, flat @ linear.T, rtol=0, atol=1e-12)


def test_presets_are_siglip_towers():
    so400m = siglip_config("siglip-so400m-14-384")
    assert isinstance(so400m, ClassicViTConfig)
    assert (so400m.hidden_size, so400m.num_hidden_layers, so400m.intermediate_size, so400m.grid_side) == (
        1152,
        27,
        4304,
        27,
    )
    assert (so400m.pool, so400m.class_token, so400m.hidden_act, so400m.layer_norm_eps) == (
        "map",
        False,
        "gelu_tanh",
        1e-6,
    )
    assert siglip_config("paligemma-so400m-14-224").pool == "avg" and so400m.family == "siglip"
    naflex = siglip_config("siglip2-so400m-16-naflex")
    assert (naflex.grid_side, naflex.pos_emb_rule, naflex.family) == (16, "naflex", "siglip2")
    tiny = ClassicViT(siglip_config("siglip-tiny"))
    assert tiny.attn_pool is not None and tiny.cls_token is None and tuple(tiny.pos_embed.shape) == (1, 16, 64)
    with pytest.raises(ValueError, match="unknown SigLIP preset 'nope'"):
        siglip_config("nope")
