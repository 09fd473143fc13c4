"""OpenVLA's fused DINOv2 + SigLIP backbone and its projector (moonvit.families.openvla).

Pinned against: the two towers run apart and concatenated (bit-equal: the same calls on the same
shapes), and a plain per-image reference written from Prismatic's and timm's code (timm's ViT forward
with its prefix tokens, ``get_intermediate_layers(n={depth - 2})``, prefix dropped, the features
concatenated, the fused GELU MLP) in float64 within 1e-10, reading the checkpoint's tensors by their
OpenVLA names. Tiny towers: DINOv2-like 32 wide with 3 blocks, 4 registers and LayerScale; SigLIP-like
48 wide with 2 blocks and a MAP head; patch 4, a 4 x 4 table.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from helpers import randomise_
from safetensors.torch import save_file
from test_hub import offline, requested, write_hub_cache  # noqa: F401 (fixtures)

from moonvit import CheckpointError, MoonViT
from moonvit.families import find_family
from moonvit.families.openvla import FusedBackbone, FusedBackboneConfig, timm_tower
from moonvit.families.vit import ClassicViT
from moonvit.weights.checkpoint import read_config

PATCH, SIDE, TEXT = 4, 4, 40
DINO_ID, SIGLIP_ID = "vit_large_patch14_reg4_dinov2.lvd142m", "vit_so400m_patch14_siglip_224"
DINO_ARGS = dict(patch_size=PATCH, embed_dim=32, depth=3, num_heads=4)
SIGLIP_ARGS = dict(patch_size=PATCH, embed_dim=48, depth=2, num_heads=4)
GRIDS = [(4, 4), (3, 5), (2, 6), (6, 1), (1, 1)]  # the native grid first, then resampled ones


def tiny_config(text: int | None = TEXT) -> FusedBackboneConfig:
    return FusedBackboneConfig(
        featurizer=timm_tower(DINO_ID, PATCH * SIDE, DINO_ARGS),
        fused_featurizer=timm_tower(SIGLIP_ID, PATCH * SIDE, SIGLIP_ARGS),
        text_hidden_size=text,
        image_size=PATCH * SIDE,
    )


def openvla_config(**changes: Any) -> dict[str, Any]:
    """A config.json as OpenVLA's release writes it (openvla/openvla-7b's keys), the towers made tiny by
    timm_model_args."""
    values: dict[str, Any] = {
        "architectures": ["OpenVLAForActionPrediction"],
        "model_type": "openvla",
        "vision_backbone_id": "dinosiglip-vit-so-224px",
        "llm_backbone_id": "llama2-7b-pure",
        "hf_llm_id": "meta-llama/Llama-2-7b-hf",
        "arch_specifier": "no-align+fused-gelu-mlp",
        "use_fused_vision_backbone": True,
        "image_resize_strategy": "resize-naive",
        "timm_model_ids": [DINO_ID, SIGLIP_ID],
        "timm_override_act_layers": [None, None],
        "image_sizes": [PATCH * SIDE, PATCH * SIDE],
        "timm_model_args": [DINO_ARGS, SIGLIP_ARGS],
        "text_config": {"model_type": "llama", "hidden_size": TEXT, "vocab_size": 64},
        "llm_max_length": 2048,
        "n_action_bins": 256,
        "norm_stats": {"bridge_orig": {"action": {"q01": [0.0], "q99": [1.0]}}},
        "output_projector_states": False,
        "pad_to_multiple_of": 64,
        "pad_token_id": 32000,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
    }
    values.update(changes)
    return values


# ---- OpenVLA's tensors, by the names its checkpoints use --------------------------------------------


def _normal(shape: tuple[int, ...], gen: torch.Generator, mean: float = 0.0, std: float = 0.2) -> torch.Tensor:
    return (mean + std * torch.randn(shape, generator=gen, dtype=torch.float64)).float()


def timm_vit_tensors(root: str, args: dict[str, Any], gen: torch.Generator, *, dino: bool) -> dict[str, torch.Tensor]:
    """A timm ViT's state dict as Prismatic saves it under ``root``: DINOv2 with registers (CLS, 4 registers,
    patch-only table, LayerScale as ``scale_factor``) or SigLIP (no CLS, MAP head ``attn_pool.*``)."""
    d, depth, p = args["embed_dim"], args["depth"], args["patch_size"]
    mlp = int(d * (4.0 if dino else 3.7362))
    t: dict[str, torch.Tensor] = {
        "patch_embed.proj.weight": _normal((d, 3, p, p), gen),
        "patch_embed.proj.bias": _normal((d,), gen),
        "pos_embed": _normal((1, SIDE * SIDE, d), gen, std=0.5),
        "norm.weight": _normal((d,), gen, 1.0),
        "norm.bias": _normal((d,), gen),
    }
    if dino:
        t["cls_token"], t["reg_token"] = _normal((1, 1, d), gen, std=0.5), _normal((1, 4, d), gen, std=0.5)
    for i in range(depth):
        b = f"blocks.{i}."
        for norm in ("norm1", "norm2"):
            t[b + norm + ".weight"], t[b + norm + ".bias"] = _normal((d,), gen, 1.0), _normal((d,), gen)
        for name, (rows, cols) in {
            "attn.qkv": (3 * d, d),
            "attn.proj": (d, d),
            "mlp.fc1": (mlp, d),
            "mlp.fc2": (d, mlp),
        }.items():
            t[b + name + ".weight"], t[b + name + ".bias"] = _normal((rows, cols), gen), _normal((rows,), gen)
        if dino:  # LayerScale, renamed from timm's gamma
            t[b + "ls1.scale_factor"], t[b + "ls2.scale_factor"] = _normal((d,), gen, 0.5), _normal((d,), gen, 0.5)
    if not dino:  # timm's AttentionPoolLatent: never read by the backbone
        t["attn_pool.latent"] = _normal((1, 1, d), gen)
        for name, rows in {"q": d, "kv": 2 * d, "proj": d, "mlp.fc1": mlp}.items():
            t[f"attn_pool.{name}.weight"], t[f"attn_pool.{name}.bias"] = _normal((rows, d), gen), _normal((rows,), gen)
        t["attn_pool.mlp.fc2.weight"], t["attn_pool.mlp.fc2.bias"] = _normal((d, mlp), gen), _normal((d,), gen)
        t["attn_pool.norm.weight"], t["attn_pool.norm.bias"] = _normal((d,), gen, 1.0), _normal((d,), gen)
    return {root + name: tensor for name, tensor in t.items()}


def openvla_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        **timm_vit_tensors("vision_backbone.featurizer.", DINO_ARGS, gen, dino=True),
        **timm_vit_tensors("vision_backbone.fused_featurizer.", SIGLIP_ARGS, gen, dino=False),
    }
    width = DINO_ARGS["embed_dim"] + SIGLIP_ARGS["embed_dim"]
    for name, (rows, cols) in {"fc1": (4 * width, width), "fc2": (TEXT, 4 * width), "fc3": (TEXT, TEXT)}.items():
        tensors[f"projector.{name}.weight"] = _normal((rows, cols), gen, std=0.1)
        tensors[f"projector.{name}.bias"] = _normal((rows,), gen)
    tensors["language_model.model.embed_tokens.weight"] = _normal((64, TEXT), gen)
    tensors["language_model.lm_head.weight"] = _normal((64, TEXT), gen)
    return tensors


def write_openvla_folder(
    folder: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict[str, Any] | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(openvla_config() if config is None else config))
    save_file(openvla_tensors() if tensors is None else tensors, str(folder / "model.safetensors"))
    return folder


def write_sharded_openvla_folder(folder: Path) -> Path:
    """The release's shape: the vision backbone, the projector and the language model in three shards."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(openvla_config()))
    tensors = openvla_tensors()
    shards = {"model-00001-of-00003.safetensors": "vision_backbone.", "model-00002-of-00003.safetensors": "projector."}
    weight_map = {}
    for shard, prefix in shards.items():
        part = {name: t for name, t in tensors.items() if name.startswith(prefix)}
        save_file(part, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    lm = "model-00003-of-00003.safetensors"
    (folder / lm).write_bytes(b"not a safetensors file: the loader must never open it")
    weight_map.update(dict.fromkeys((n for n in tensors if n.startswith("language_model.")), lm))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ---- the reference: Prismatic's forward, per image, from its tensors -------------------------------


def _ref_table(table: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """timm's resample_abs_pos_embed: (1, G * G, D) -> (1, rows * cols, D), bicubic with antialias on the
    (1, D, G, G) view of the (1, G, G, D) table; skipped at the native square grid. timm computes it in
    float32; here in float32 or wider (float64 for the float64 comparison)."""
    side, dim = int(table.shape[1] ** 0.5), table.shape[-1]
    if rows * cols == table.shape[1] and rows == cols:
        return table
    wide = table.to(torch.promote_types(table.dtype, torch.float32))
    grid = wide.reshape(1, side, side, dim).permute(0, 3, 1, 2)
    out = F.interpolate(grid, size=(rows, cols), mode="bicubic", antialias=True)
    return out.permute(0, 2, 3, 1).reshape(1, -1, dim).to(table.dtype)


def _ref_tower(t: dict[str, torch.Tensor], root: str, image: torch.Tensor, heads: int) -> torch.Tensor:
    """timm's VisionTransformer.get_intermediate_layers(image[None], n={depth - 2})[0]: (h * w, D)."""
    w = {name[len(root) :]: tensor for name, tensor in t.items() if name.startswith(root)}
    d = w["patch_embed.proj.bias"].shape[0]
    depth = 1 + max(int(name.split(".")[1]) for name in w if name.startswith("blocks."))
    x = F.conv2d(image[None], w["patch_embed.proj.weight"], w["patch_embed.proj.bias"], stride=PATCH)
    rows, cols = x.shape[-2:]
    x = x.flatten(2).transpose(1, 2) + _ref_table(w["pos_embed"], rows, cols)  # no_embed_class: add, then prefix
    prefix = [w[name] for name in ("cls_token", "reg_token") if name in w]
    x = torch.cat([*prefix, x], dim=1)
    for i in range(depth - 1):  # the output of block depth - 2 (counting from 0)
        b = f"blocks.{i}."
        h = F.layer_norm(x, (d,), w[b + "norm1.weight"], w[b + "norm1.bias"], eps=1e-6)
        q, k, v = (
            F.linear(h, w[b + "attn.qkv.weight"], w[b + "attn.qkv.bias"]).view(1, -1, 3, heads, d // heads).unbind(2)
        )
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) * (d // heads) ** -0.5
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, -1, d)
        a = F.linear(a, w[b + "attn.proj.weight"], w[b + "attn.proj.bias"])
        x = x + (a * w[b + "ls1.scale_factor"] if b + "ls1.scale_factor" in w else a)
        h = F.layer_norm(x, (d,), w[b + "norm2.weight"], w[b + "norm2.bias"], eps=1e-6)
        m = F.gelu(F.linear(h, w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"]))  # timm's nn.GELU: exact
        m = F.linear(m, w[b + "mlp.fc2.weight"], w[b + "mlp.fc2.bias"])
        x = x + (m * w[b + "ls2.scale_factor"] if b + "ls2.scale_factor" in w else m)
    return x[0, len(torch.cat(prefix, dim=1)[0]) if prefix else 0 :]


def reference(
    t: dict[str, torch.Tensor], pixels: torch.Tensor, grids: list[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prismatic's backbone and projector, one image at a time: (L, 2176-like) features and (L, T) tokens."""
    features, start = [], 0
    for rows, cols in grids:
        patches = pixels[start : start + rows * cols]
        start += rows * cols
        image = (
            patches.reshape(rows, cols, 6, PATCH, PATCH).permute(2, 0, 3, 1, 4).reshape(6, rows * PATCH, cols * PATCH)
        )
        dino = _ref_tower(t, "vision_backbone.featurizer.", image[:3], DINO_ARGS["num_heads"])
        siglip = _ref_tower(t, "vision_backbone.fused_featurizer.", image[3:], SIGLIP_ARGS["num_heads"])
        features.append(torch.cat([dino, siglip], dim=-1))
    fused = torch.cat(features)
    x = F.gelu(F.linear(fused, t["projector.fc1.weight"], t["projector.fc1.bias"]))
    x = F.gelu(F.linear(x, t["projector.fc2.weight"], t["projector.fc2.bias"]))
    return fused, F.linear(x, t["projector.fc3.weight"], t["projector.fc3.bias"])


def pack_pixels(grids: list[tuple[int, int]], dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    count = sum(rows * cols for rows, cols in grids)
    return torch.randn(count, 6, PATCH, PATCH, generator=gen, dtype=torch.float64).to(dtype)


# ---- the tests --------------------------------------------------------------------------------------


def test_an_openvla_folder_matches_prismatics_forward_in_float64(tmp_path):
    tensors = openvla_tensors()
    folder = write_openvla_folder(tmp_path / "openvla", tensors)
    model = MoonViT.from_pretrained(folder, dtype=torch.float64)
    assert isinstance(model, FusedBackbone)
    pixels = pack_pixels(GRIDS, torch.float64)
    out = model(pixels, GRIDS)
    wide = {name: tensor.double() for name, tensor in tensors.items()}
    features, tokens = reference(wide, pixels, GRIDS)
    assert out.last_hidden_state.shape == (len(pixels), 80) and out.merged is not None
    assert out.merged.shape == (len(pixels), 1, 80)
    assert torch.equal(out.merged[:, 0], out.last_hidden_state)
    torch.testing.assert_close(out.last_hidden_state, features, rtol=0, atol=1e-10)
    projected = model.project(out.last_hidden_state)
    assert projected.shape == (len(pixels), TEXT) and projected.dtype == torch.float64
    torch.testing.assert_close(projected, tokens, rtol=0, atol=1e-10)
    assert model.slices == {"featurizer": slice(0, 32), "fused_featurizer": slice(32, 80)}
    assert out.prefix_tokens is None and out.pooled is None and out.hidden_states is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_output_is_the_two_towers_run_apart_and_concatenated(dtype):
    config = tiny_config()
    fused = FusedBackbone(config).to(dtype).eval()
    towers = [
        randomise_(ClassicViT(config.featurizer), seed=1),
        randomise_(ClassicViT(config.fused_featurizer), seed=2),
    ]
    for full, part in zip(towers, fused.towers()):
        full.to(dtype).eval()
        part.load_state_dict({name: value for name, value in full.state_dict().items() if name in part.state_dict()})
    pixels = pack_pixels(GRIDS, dtype)
    with torch.inference_mode():
        out = fused(pixels, GRIDS)
        apart = [
            tower(pixels[:, 3 * i : 3 * i + 3], GRIDS, hidden_state_indices=[-2]).hidden_states[0]
            for i, tower in enumerate(towers)
        ]
    assert torch.equal(out.last_hidden_state[:, fused.slices["featurizer"]], apart[0])
    assert torch.equal(out.last_hidden_state[:, fused.slices["fused_featurizer"]], apart[1])
    # each tower built with the blocks it runs: the checkpoint's last block and SigLIP's MAP head are not
    assert len(fused.featurizer.blocks) == 2 and len(fused.fused_featurizer.blocks) == 1
    assert fused.fused_featurizer.attn_pool is None and towers[1].attn_pool is not None


def test_a_pack_equals_its_images_encoded_alone(tmp_path):
    model = FusedBackbone.from_pretrained(write_openvla_folder(tmp_path / "openvla"), dtype=torch.float64)
    pixels = pack_pixels(GRIDS, torch.float64)
    packed = model(pixels, GRIDS).last_hidden_state
    start = 0
    for grid in GRIDS:
        count = grid[0] * grid[1]
        alone = model(pixels[start : start + count], [grid]).last_hidden_state
        torch.testing.assert_close(alone, packed[start : start + count], rtol=1e-10, atol=1e-10)  # other shapes
        start += count


def test_only_the_backbone_and_projector_shards_are_opened(tmp_path):
    folder = write_sharded_openvla_folder(tmp_path / "sharded")
    model = MoonViT.from_pretrained(folder)  # the language model's shard is not a safetensors file
    single = FusedBackbone.from_pretrained(write_openvla_folder(tmp_path / "single"))
    assert model.dtype == torch.float32
    for (name, a), (other, b) in zip(model.state_dict().items(), single.state_dict().items()):
        assert name == other and torch.equal(a, b), name


def test_a_hub_snapshot_fetches_the_backbone_and_projector_shards_alone(tmp_path, offline, requested):  # noqa: F811
    folder = write_sharded_openvla_folder(tmp_path / "repo")
    needed = ("config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors",
              "model-00002-of-00003.safetensors")  # fmt: skip
    write_hub_cache(offline, "openvla/openvla-tiny", {name: folder / name for name in needed})
    model = MoonViT.from_pretrained("openvla/openvla-tiny")
    assert isinstance(model, FusedBackbone) and sorted(requested) == sorted(needed)


def test_the_checkpoint_is_read_strictly(tmp_path):
    tensors = openvla_tensors()
    missing = dict(tensors)
    del missing["vision_backbone.featurizer.blocks.0.ls1.scale_factor"]
    with pytest.raises(
        CheckpointError, match=r"missing \['vision_backbone\.featurizer\.blocks\.0\.ls1\.scale_factor'\]"
    ):
        MoonViT.from_pretrained(write_openvla_folder(tmp_path / "missing", missing))
    unexpected = {**tensors, "vision_backbone.fused_featurizer.fc_norm.weight": torch.ones(48)}
    with pytest.raises(CheckpointError, match=r"unexpected \['vision_backbone\.fused_featurizer\.fc_norm\.weight'\]"):
        MoonViT.from_pretrained(write_openvla_folder(tmp_path / "unexpected", unexpected))
    # timm's own name for LayerScale (not Prismatic's scale_factor) is named, both ways
    renamed = {n.replace("ls2.scale_factor", "ls2.gamma"): t for n, t in tensors.items()}
    with pytest.raises(CheckpointError, match=r"missing .*ls2\.scale_factor.*unexpected .*ls2\.gamma"):
        MoonViT.from_pretrained(write_openvla_folder(tmp_path / "gamma", renamed))
    # the last block is never read, but a checkpoint without it is another model: refused, counted
    short = {n: t for n, t in tensors.items() if not n.startswith("vision_backbone.fused_featurizer.blocks.1.")}
    with pytest.raises(CheckpointError, match=r"fused_featurizer\.blocks: the checkpoint has 1 blocks .* model has 2"):
        MoonViT.from_pretrained(write_openvla_folder(tmp_path / "short", short))
    wide = {**tensors, "projector.fc3.weight": torch.zeros(TEXT + 1, TEXT)}
    with pytest.raises(CheckpointError, match=r"wrong shape .*projector\.fc3\.weight"):
        MoonViT.from_pretrained(write_openvla_folder(tmp_path / "wide", wide))


def test_the_release_config_reads_as_openvla_7b(tmp_path):
    """The real sizes, from the keys alone (an index naming the tensors; no shard is opened)."""
    folder = tmp_path / "openvla-7b"
    folder.mkdir()
    values = openvla_config(image_sizes=[224, 224], text_config={"hidden_size": 4096})
    del values["timm_model_args"]
    (folder / "config.json").write_text(json.dumps(values))
    names = [f"vision_backbone.featurizer.blocks.{i}.norm1.weight" for i in range(24)]
    names += [f"vision_backbone.fused_featurizer.blocks.{i}.norm1.weight" for i in range(27)]
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00003.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every key of the release is read or known
        config, layout = read_config(folder)
    assert config == FusedBackboneConfig()
    dino, siglip = config.featurizer, config.fused_featurizer
    assert (dino.hidden_size, dino.num_hidden_layers, dino.num_attention_heads, dino.intermediate_size) == (
        1024,
        24,
        16,
        4096,
    )
    assert (dino.num_register_tokens, dino.no_embed_class, dino.layer_scale, dino.grid_side) == (4, True, True, 16)
    assert (siglip.hidden_size, siglip.num_hidden_layers, siglip.intermediate_size, siglip.class_token) == (
        1152,
        27,
        4304,
        False,
    )
    assert siglip.pool == "map" and dino.hidden_act == siglip.hidden_act == "gelu"  # timm's exact GELU
    assert dino.layer_norm_eps == siglip.layer_norm_eps == 1e-6 and dino.pos_emb_rule == "timm"
    assert config.hidden_size == 2176 and config.slices["fused_featurizer"] == slice(1024, 2176)
    assert (config.text_hidden_size, config.num_channels, config.image_resize_strategy) == (4096, 6, "resize-naive")
    assert layout.prefix == ("vision_backbone.", "projector.")
    assert layout.source("featurizer.blocks.3.ls1.gamma").names == (
        "vision_backbone.featurizer.blocks.3.ls1.scale_factor",
    )
    assert layout.source("projector.fc2.bias").names == ("projector.fc2.bias",)
    assert layout.unused("vision_backbone.featurizer.blocks.23.mlp.fc1.weight")
    assert layout.unused("vision_backbone.fused_featurizer.blocks.26.norm1.bias")
    assert layout.unused("vision_backbone.fused_featurizer.attn_pool.kv.weight")
    assert not layout.unused("vision_backbone.featurizer.blocks.22.norm1.bias")
    assert "read after 23 of its 24 blocks" in config.describe()


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"use_fused_vision_backbone": False}, r"use_fused_vision_backbone False .*only Prismatic's fused"),
        ({"timm_model_ids": [DINO_ID, "vit_large_patch14_clip_336.openai"]}, r"vit_large_patch14_clip_336\.openai"),
        ({"timm_override_act_layers": [None, "quick_gelu"]}, r"timm_override_act_layers .*quick_gelu"),
        ({"arch_specifier": "no-align+gelu-mlp"}, r"arch_specifier 'no-align\+gelu-mlp'"),
        ({"image_sizes": [16, 32]}, r"image_sizes \[16, 32\]: both towers read the same patches"),
        ({"timm_model_args": [DINO_ARGS, dict(SIGLIP_ARGS, patch_size=2)]}, r"both towers read the same patches"),
        ({"text_config": {}}, r"text_config\.hidden_size"),
        ({"timm_model_args": [{"qkv_bias": False}, {}]}, r"timm_model_args .*qkv_bias not read"),
    ],
)
def test_a_release_config_the_backbone_cannot_build_is_refused_by_name(tmp_path, changes, message):
    folder = write_openvla_folder(tmp_path / "bad", config=openvla_config(**changes))
    with pytest.raises(CheckpointError, match=message):
        MoonViT.from_pretrained(folder)


def test_the_towers_come_from_the_backbone_id_without_timm_ids(tmp_path):
    values = openvla_config(vision_backbone_id="dinosiglip-vit-so-384px", text_config={"hidden_size": 4096})
    for key in (
        "timm_model_ids",
        "image_sizes",
        "timm_model_args",
        "image_resize_strategy",
        "use_fused_vision_backbone",
    ):
        del values[key]
    family = find_family(values)
    assert family is not None and family.name == "openvla"
    config, _ = family.read(values, tmp_path / "config.json", ())
    assert config.grid_side == 27 and config.image_size == 384  # 27 patches of 14 px: timm reads 378 of 384
    assert config.fused_featurizer.image_size == config.featurizer.image_size == 378
    assert config.image_resize_strategy == "letterbox"  # Prismatic's default


def test_an_own_folder_round_trips(tmp_path):
    model = FusedBackbone.from_pretrained(write_openvla_folder(tmp_path / "openvla"))
    model.save_pretrained(tmp_path / "own")
    assert json.loads((tmp_path / "own" / "config.json").read_text())["model_type"] == "openvla_backbone"
    again = MoonViT.from_pretrained(tmp_path / "own")
    assert isinstance(again, FusedBackbone) and again.config == model.config
    pixels = pack_pixels(GRIDS)
    with torch.inference_mode():
        first, second = model(pixels, GRIDS).last_hidden_state, again(pixels, GRIDS).last_hidden_state
        assert torch.equal(first, second)
        assert torch.equal(model.project(first), again.project(second))
    assert find_family(json.loads((tmp_path / "own" / "config.json").read_text())).name == "openvla"  # type: ignore[union-attr]


def test_bad_inputs_are_named():
    model = FusedBackbone(tiny_config()).eval()
    grids = [(2, 3)]
    with pytest.raises(ValueError, match=r"takes 6 channels per patch \(the DINOv2-normalised RGB, then the SigLIP"):
        model(torch.randn(6, 3, PATCH, PATCH), grids)
    with pytest.raises(ValueError, match=r"pixel_values holds 5 patches but the grids add up to sum\(h \* w\) = 6"):
        model(torch.randn(5, 6, PATCH, PATCH), grids)
    with pytest.raises(TypeError, match="must be floating"):
        model(torch.zeros(6, 6, PATCH, PATCH, dtype=torch.uint8), grids)
    with pytest.raises(ValueError, match="second-to-last-block features only"):
        model(torch.randn(6, 6, PATCH, PATCH), grids, hidden_state_indices=[-1])
    with pytest.raises(ValueError, match=r"project takes the backbone's features \(\.\.\., 80\)"):
        model.project(torch.randn(6, 32))
    with pytest.raises(ValueError, match="has no projector"):
        FusedBackbone(tiny_config(text=None)).project(torch.randn(6, 80))
    with pytest.raises(ValueError, match="each tower takes RGB"):
        FusedBackboneConfig(featurizer=dataclasses.replace(tiny_config().featurizer, num_channels=6))
