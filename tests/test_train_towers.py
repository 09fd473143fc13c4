"""`python -m moonvit_train` on the VLA stacks' ViTs (SigLIP, SigLIP2 NaFlex, DINOv2 with registers) as the ViT
tower runs them: the packed supervised loss through the MAP head and through registers + LayerScale + SwiGLU,
which group each new parameter is in (freezing, weight decay, layer decay), whole runs from folders saved in the
tower's own format (the trainer's head on ``pooled`` or the folder's own), exact resumption, and the refusals."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from test_train import interrupted_then_resumed, train, weights
from test_train_vit import DIGITS, assert_loads_back, each_image_alone, fit, pack

from moonvit.families.openvla.config import FusedBackboneConfig
from moonvit.families.openvla.model import FusedBackbone
from moonvit.families.vit import ClassicViT, classic_vit_config
from moonvit_train.classic import freeze_unread, select_trainable_classic
from moonvit_train.config import ModelSection
from moonvit_train.objectives.supervised import SupervisedObjective
from moonvit_train.optim import OptimConfig, param_groups

TOWERS = {
    # SigLIP: no prefix tokens, the MAP head, tanh GELU
    "siglip": dict(class_token=False, pool="map", hidden_act="gelu_tanh", layer_norm_eps=1e-6),
    # SigLIP2 NaFlex with a classifier on the MAP output (its table resampled by the naflex rule at every grid)
    "siglip2": dict(class_token=False, pool="map", hidden_act="gelu_tanh", pos_emb_rule="naflex", num_classes=10),
    # DINOv2 with 4 registers, LayerScale (initialised at 0.1 so that the blocks count), SwiGLU, a patch-only table
    "dinov2-reg": dict(
        num_register_tokens=4,
        layer_scale=True,
        layer_scale_init=0.1,
        mlp_type="swiglu",
        no_embed_class=True,
        pos_emb_rule="timm",
        num_classes=10,
    ),
}


def tower(name: str, seed: int = 0, **overrides) -> ClassicViT:
    """A tiny tower (64 px, patch 16: a 4x4 table, width 64, 2 blocks) of ``name``, drawn from ``seed``."""
    torch.manual_seed(seed)
    return ClassicViT(classic_vit_config("vit-tiny", **{**TOWERS[name], **overrides}))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Each tower saved by ClassicViT.save_pretrained (the own format), and a plain ViT teacher for distillation."""
    root = tmp_path_factory.mktemp("towers")
    for seed, name in enumerate(TOWERS):
        tower(name, seed=seed).save_pretrained(root / name)
    torch.manual_seed(9)
    ClassicViT(classic_vit_config("vit-tiny")).save_pretrained(root / "teacher")
    # OpenVLA's fused backbone: two towers on one pack, not one tower the trainer trains
    fused = FusedBackboneConfig(
        featurizer=classic_vit_config("vit-tiny", **{**TOWERS["dinov2-reg"], "num_classes": 0}),
        fused_featurizer=classic_vit_config("vit-tiny", **TOWERS["siglip"]),
        text_hidden_size=None,
        image_size=64,
    )
    FusedBackbone(fused).save_pretrained(root / "fused")
    return {name: root / name for name in [*TOWERS, "teacher", "fused"]}


# ---- the packed loss, on a fixed pack ------------------------------------------------------------


@pytest.mark.parametrize("name", ["siglip", "dinov2-reg"])
def test_the_packed_loss_through_the_map_head_and_registers_is_each_images_and_falls(name):
    """The trainer's head on ``pooled`` (SigLIP: the MAP head's softmax over the item's own kept patch rows; DINOv2:
    the CLS row after the registers): the packed loss is the sum of each image's cross-entropy computed alone (to
    float error: other shapes), with token drop; a few steps on the pack overfit it."""
    encoder = tower(name, num_classes=0)
    objective = SupervisedObjective(64, [str(i) for i in range(10)], 0.0, pooled=True)
    batch = pack(drop=True)
    loss = objective(encoder, batch).loss_sum
    alone = [
        F.cross_entropy(objective.head(objective.norm(out.pooled)), batch.labels[i : i + 1])
        for i, out in enumerate(each_image_alone(encoder, batch))
    ]
    torch.testing.assert_close(loss, sum(alone), rtol=1e-5, atol=1e-5)
    losses = fit(objective, encoder, batch)
    assert losses[-1] < 0.5 * losses[0], losses


# ---- which group each new parameter is in ------------------------------------------------------------


def trainable(model: ClassicViT) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def test_freeze_semantics_of_registers_layerscale_and_the_map_head():
    """--freeze-blocks N: the registers with the other embeddings (frozen), each LayerScale with its block; the MAP
    head is the tower's top, as the final norm: it trains. --freeze tower: only the heads train, not the MAP head."""
    dino = tower("dinov2-reg")
    select_trainable_classic(dino, ModelSection(preset="vit-tiny", freeze_blocks=1))
    names = trainable(dino)
    for frozen in ("reg_token", "cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.ls1.gamma"):
        assert frozen not in names, frozen
    assert {"blocks.0.ls2.gamma", "blocks.0.mlp.fc1.weight"}.isdisjoint(names)
    assert {"blocks.1.ls1.gamma", "blocks.1.ls2.gamma", "blocks.1.mlp.fc1.weight", "norm.weight"} <= names
    assert dino.blocks[0].drop_path == 0.0

    siglip = tower("siglip2")
    select_trainable_classic(siglip, ModelSection(preset="vit-tiny", freeze_blocks=2))
    assert {name for name in trainable(siglip) if name.startswith("attn_pool.")} == {
        name for name, _ in siglip.named_parameters() if name.startswith("attn_pool.")
    }
    siglip = tower("siglip2")
    select_trainable_classic(siglip, ModelSection(preset="vit-tiny", freeze="tower"))
    assert trainable(siglip) == {"head.weight", "head.bias"}


def test_what_no_loss_reads_stays_as_loaded():
    """The MAP head is frozen where the loss reads no ``pooled`` (feature distillation, DeiT's two heads), the heads
    where it reads none of them; a supervised objective on pooled leaves both training."""
    siglip = tower("siglip2")
    freeze_unread(siglip, pooled=True, heads=True)
    assert all(p.requires_grad for p in siglip.parameters())
    freeze_unread(siglip, pooled=False, heads=True)
    assert not any(p.requires_grad for p in siglip.attn_pool.parameters()) and siglip.head.weight.requires_grad
    freeze_unread(siglip, pooled=False, heads=False)
    assert trainable(siglip) == {n for n, _ in siglip.named_parameters() if not n.startswith(("attn_pool.", "head."))}


def test_the_optimiser_groups_of_the_new_parameters():
    """No weight decay on the registers, the LayerScales and the MAP head's latent query (its matrices decay);
    layer decay: the registers at depth 0 with the CLS token, a LayerScale at its block's depth, the MAP head at the
    final norm's (full rate); the tower's head at the objective's rate."""
    config = OptimConfig(lr=1.0, head_lr=5.0, weight_decay=0.1, layer_decay=0.5)
    dino, siglip = tower("dinov2-reg"), tower("siglip2")
    for model in (dino, siglip):
        groups = param_groups(model, torch.nn.Linear(2, 2), config)
        decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
        lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
        assert len(lr_of) == sum(1 for _ in model.parameters()) + 2
        if model is dino:
            for token in (dino.reg_token, dino.cls_token, dino.pos_embed):
                assert id(token) not in decayed and lr_of[id(token)] == 0.5**3  # depth 0 of 2 blocks + final norm
            gamma = dino.blocks[1].ls2.gamma
            assert id(gamma) not in decayed and lr_of[id(gamma)] == 0.5
            assert id(dino.blocks[1].mlp.fc1.weight) in decayed  # SwiGLU's [gate | up]
        else:
            pool = siglip.attn_pool
            assert id(pool.latent) not in decayed and lr_of[id(pool.latent)] == 1.0
            assert id(pool.qkv.weight) in decayed and lr_of[id(pool.qkv.weight)] == 1.0
            assert lr_of[id(pool.mlp.fc2.weight)] == 1.0 and lr_of[id(siglip.head.weight)] == 5.0


# ---- whole runs from own-format folders -------------------------------------------------------------


def test_a_siglip_folder_fine_tunes_on_pooled_with_token_drop_and_resumes_exactly(tmp_path, folders, monkeypatch):
    """The trainer's head reads the MAP head's output; the MAP head and the blocks train; interrupted at step 3 and
    resumed, the weights are the uninterrupted run's, bit for bit; the checkpoint loads back as the same tower."""
    args = [*DIGITS, "--objective", "supervised", "--checkpoint", folders["siglip"], "--token-drop", "0.25"]
    args += ["--steps", "4", "--save-every", "2"]
    results = train(*args, "--out", tmp_path / "straight")
    assert "MAP head" in results["encoder"]["shape"] and results["files"][1:] == ["head.safetensors", "head.json"]
    interrupted_then_resumed(monkeypatch, args, tmp_path / "resumed")
    straight, resumed = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight)
    for head in ("head.safetensors",):
        first, second = load_file(tmp_path / "straight" / head), load_file(tmp_path / "resumed" / head)
        assert all(torch.equal(first[k], second[k]) for k in first)
    loaded = assert_loads_back(tmp_path / "straight")
    assert (loaded.config.pool, loaded.config.hidden_act, loaded.config.class_token) == ("map", "gelu_tanh", False)
    source = load_file(folders["siglip"] / "model.safetensors")
    for name in ("attn_pool.latent", "attn_pool.qkv.weight", "blocks.0.attn.qkv.weight"):
        assert not torch.equal(source[name], straight[name]), name


def test_a_dinov2_register_folder_trains_its_head_above_frozen_blocks(tmp_path, folders):
    """--freeze-blocks 1 on DINOv2 with registers and its own 10-class head: the registers, the table, the CLS
    token and block 0 (its LayerScales too) stay as loaded; block 1's LayerScales and SwiGLU, and the head, train."""
    results = train(*DIGITS, "--objective", "supervised", "--checkpoint", folders["dinov2-reg"], "--steps", "3",
                    "--freeze-blocks", "1", "--out", tmp_path)  # fmt: skip
    assert results["files"] == ["checkpoint"] and "4 registers" in results["encoder"]["shape"]
    loaded = assert_loads_back(tmp_path)
    assert loaded.config.num_register_tokens == 4 and loaded.config.no_embed_class and loaded.config.layer_scale
    source, trained = load_file(folders["dinov2-reg"] / "model.safetensors"), loaded.state_dict()
    for name in ("reg_token", "cls_token", "pos_embed", "blocks.0.ls1.gamma", "blocks.0.ls2.gamma"):
        assert torch.equal(source[name], trained[name]), name
    for name in ("blocks.1.ls1.gamma", "blocks.1.ls2.gamma", "blocks.1.mlp.fc1.weight", "head.weight"):
        assert not torch.equal(source[name], trained[name]), name


def test_a_siglip2_naflex_probe_trains_its_head_alone(tmp_path, folders):
    """--freeze tower on SigLIP2 NaFlex with its own head: a linear probe of the frozen MAP embedding."""
    results = train(*DIGITS, "--objective", "supervised", "--checkpoint", folders["siglip2"], "--steps", "2",
                    "--freeze", "tower", "--out", tmp_path)  # fmt: skip
    assert results["encoder"]["trained"] == 64 * 10 + 10
    source, trained = load_file(folders["siglip2"] / "model.safetensors"), assert_loads_back(tmp_path).state_dict()
    assert [name for name in source if not torch.equal(source[name], trained[name])] == ["head.bias", "head.weight"]


def test_feature_distillation_into_a_siglip_tower_leaves_its_map_head_as_loaded(tmp_path, folders):
    """--objective distill regresses the patch rows: the MAP head reaches no loss and stays as loaded (out of DDP's
    reduction), the blocks learn."""
    args = [*DIGITS, "--objective", "distill", "--checkpoint", folders["siglip"], "--teacher", folders["teacher"]]
    results = train(*args, "--calibration-images", "32", "--steps", "2", "--out", tmp_path)
    source, trained = load_file(folders["siglip"] / "model.safetensors"), assert_loads_back(tmp_path).state_dict()
    pool = [name for name in source if name.startswith("attn_pool.")]
    assert pool and all(torch.equal(source[name], trained[name]) for name in pool)
    assert not torch.equal(source["blocks.1.mlp.fc2.weight"], trained["blocks.1.mlp.fc2.weight"])
    pool_size = sum(source[name].numel() for name in pool)
    assert results["encoder"]["trained"] == results["encoder"]["parameters"] - pool_size


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--objective", "mae", "--checkpoint", "SIGLIP"], "--objective mae pretrains a MoonViT"),
        (["--objective", "supervised", "--checkpoint", "DINO", "--lora-rank", "4"], "--lora-rank adapts a MoonViT"),
        (["--objective", "supervised", "--checkpoint", "DINO", "--save-layout", "release"], "a classic ViT is saved"),
        (["--objective", "deit", "--checkpoint", "DINO", "--teacher", "DINO"], "trains a DeiT tower"),
        (["--objective", "supervised", "--checkpoint", "FUSED"], "(FusedBackbone): the trainer trains one MoonViT"),
    ],
)
def test_what_these_towers_cannot_take_is_one_line(tmp_path, folders, flags, message):
    named = {"SIGLIP": folders["siglip"], "DINO": folders["dinov2-reg"], "FUSED": folders["fused"]}
    flags = [str(named.get(flag, flag)) for flag in flags]
    with pytest.raises(SystemExit, match="error: .*" + re.escape(message)):
        train(*DIGITS, *flags, "--steps", "1", "--out", tmp_path / "run")


# ---- from transformers' folders (the families' loaders) ----------------------------------------------


def test_a_transformers_dinov2_with_registers_folder_fine_tunes(tmp_path):
    """transformers' Dinov2WithRegistersModel (2 registers, SwiGLU) saved by its save_pretrained loads as the ViT
    tower and trains packed with the trainer's head on the CLS row; the run's checkpoint is the tower's own folder,
    registers and LayerScales included."""
    from transformers import Dinov2WithRegistersConfig, Dinov2WithRegistersModel

    torch.manual_seed(0)
    config = Dinov2WithRegistersConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=4, image_size=64, patch_size=16,
        num_register_tokens=2, use_swiglu_ffn=True,
    )  # fmt: skip
    Dinov2WithRegistersModel(config).save_pretrained(tmp_path / "dinov2")
    results = train(*DIGITS, "--objective", "supervised", "--checkpoint", tmp_path / "dinov2", "--steps", "2",
                    "--out", tmp_path / "run")  # fmt: skip
    assert "2 registers" in results["encoder"]["shape"] and "SwiGLU" in results["encoder"]["shape"]
    loaded = assert_loads_back(tmp_path / "run")
    assert loaded.config.num_register_tokens == 2 and loaded.config.layer_scale
    source = ClassicViT.from_pretrained(tmp_path / "dinov2").state_dict()
    trained = loaded.state_dict()
    assert not torch.equal(source["reg_token"], trained["reg_token"])
    assert not torch.equal(source["blocks.0.ls1.gamma"], trained["blocks.0.ls1.gamma"])


def test_a_transformers_siglip2_naflex_folder_fine_tunes_through_its_map_head(tmp_path):
    """transformers' Siglip2VisionModel (a 4x4 NaFlex table, the MAP head) saved by its save_pretrained loads as the
    ViT tower and trains packed with the trainer's head on the MAP head's output: the MAP head and the blocks move;
    the run's checkpoint is the tower's own folder, with the naflex rule."""
    from transformers import Siglip2VisionConfig, Siglip2VisionModel

    torch.manual_seed(0)
    config = Siglip2VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, patch_size=16, num_patches=16
    )
    Siglip2VisionModel(config).save_pretrained(tmp_path / "siglip2")
    results = train(*DIGITS, "--objective", "supervised", "--checkpoint", tmp_path / "siglip2", "--steps", "2",
                    "--out", tmp_path / "run")  # fmt: skip
    assert "MAP head" in results["encoder"]["shape"] and results["files"][1:] == ["head.safetensors", "head.json"]
    loaded = assert_loads_back(tmp_path / "run")
    assert (loaded.config.pool, loaded.config.pos_emb_rule, loaded.config.class_token) == ("map", "naflex", False)
    source = ClassicViT.from_pretrained(tmp_path / "siglip2").state_dict()
    trained = loaded.state_dict()
    for name in ("attn_pool.latent", "attn_pool.mlp.fc1.weight", "blocks.0.attn.qkv.weight"):
        assert not torch.equal(source[name], trained[name]), name


@pytest.mark.parametrize("kind", ["siglip2", "dinov2-reg"])
def test_the_trainer_reads_a_transformers_folder_by_the_commands_processor(tmp_path, kind):
    """A folder without a processor file: the trainer renders (normalises) and saves with the processor the commands
    read it with (``checkpoint_processors``: NaFlex's rule for SigLIP2, the native rule with ImageNet's statistics
    for DINOv2), not the native rule at 0.5 / 0.5; ``--image-size`` keeps the native budget's multiple of the
    resized table (4 x 4 x 4 patches at 64 px -> 4 x 6 x 6 at 96 px)."""
    from transformers import (
        Dinov2WithRegistersConfig,
        Dinov2WithRegistersModel,
        Siglip2VisionConfig,
        Siglip2VisionModel,
    )

    from moonvit.encode import checkpoint_processors
    from moonvit.families.siglip import NaFlexImageProcessor
    from moonvit.families.vit.processor import IMAGENET_MEAN, IMAGENET_STD, NativeViTImageProcessor
    from moonvit_train.build import build_encoder
    from moonvit_train.config import parse_args

    torch.manual_seed(0)
    folder = tmp_path / kind
    if kind == "siglip2":
        config = Siglip2VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=16,
            num_patches=16,
        )  # fmt: skip
        Siglip2VisionModel(config).save_pretrained(folder)
    else:
        config = Dinov2WithRegistersConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
            num_register_tokens=2,
        )  # fmt: skip
        Dinov2WithRegistersModel(config).save_pretrained(folder)
    args = [*DIGITS, "--objective", "supervised", "--checkpoint", str(folder), "--steps", "1", "--out", str(tmp_path)]
    encoder, processor = build_encoder(parse_args(args))
    assert processor == checkpoint_processors(folder, encoder.config).image
    if kind == "siglip2":
        assert isinstance(processor, NaFlexImageProcessor) and processor.max_num_patches == 256
        assert processor.image_mean == processor.image_std == (0.5,) * 3
        return
    assert isinstance(processor, NativeViTImageProcessor) and processor.in_token_limit == 4 * 4 * 4
    assert (processor.image_mean, processor.image_std) == (IMAGENET_MEAN, IMAGENET_STD)
    encoder, resized = build_encoder(parse_args([*args, "--image-size", "96"]))
    assert encoder.config.grid_side == 6 and resized == dataclasses.replace(processor, in_token_limit=4 * 6 * 6)
