"""The family registry: every family's spec is complete, each family's ``config.json`` is claimed by its
own spec alone, the registry picks the family the MoonViT detection always picked (a plain reference
of its rules, below), and each family goes through save -> ``read_config`` and back."""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import (
    k3_release_config,
    locateanything_config,
    tiny_k3_model,
    tiny_locateanything,
    tiny_model,
    write_k25_release_folder,
    write_kimi_vl_folder,
)
from safetensors.torch import save_file

import moonvit.families as registry
from moonvit import MoonViT, MoonViTConfig, preset_config
from moonvit.families import Family, families, family_named, find_family, register_family
from moonvit.families.moonvit import MOONVIT_FAMILIES, MoonViTFamily
from moonvit.families.vit import ClassicViT, ClassicViTConfig
from moonvit.media.presets import FAMILY_RULES
from moonvit.weights.checkpoint import read_config
from moonvit.weights.formats import TowerLayout, encoder_config_from_json
from moonvit.weights.storage import CheckpointError
from moonvit_projector import MoonViTProjector, ProjectorConfig

MOONVIT = {family.name for family in MOONVIT_FAMILIES}
RUNTIME = ("attn_implementation", "drop_path_rate")  # settings of a run, never in a checkpoint

# ---- each family's config.json, as its checkpoints write it ----------------------------------------


def _own(tmp: Path) -> dict[str, Any]:
    tiny_model().save_pretrained(tmp / "own")
    return json.loads((tmp / "own" / "config.json").read_text())


def _kimi_vl(tmp: Path) -> dict[str, Any]:
    return json.loads((write_kimi_vl_folder(tmp / "kimi-vl", tiny_model()) / "config.json").read_text())


def _kimi_k25(tmp: Path) -> dict[str, Any]:
    model = MoonViT(preset_config("tiny-3d"))
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, 32))
    return json.loads((write_k25_release_folder(tmp / "k25", model, projector) / "config.json").read_text())


def _kimi_k25_transformers(tmp: Path) -> dict[str, Any]:
    pytest.importorskip("transformers.models.kimi_k25")
    from helpers import tiny_k25_config

    return tiny_k25_config().to_dict()


def _kimi_k3(tmp: Path) -> dict[str, Any]:
    return k3_release_config(tiny_k3_model(), 48)


def _locateanything(tmp: Path) -> dict[str, Any]:
    return locateanything_config(tiny_model(), 48)


def _vit_transformers(tmp: Path) -> dict[str, Any]:
    from transformers import ViTConfig

    return ViTConfig().to_dict()


def _deit_transformers(tmp: Path) -> dict[str, Any]:
    from transformers import DeiTConfig

    return DeiTConfig().to_dict()


def _vit_timm(tmp: Path) -> dict[str, Any]:
    return {"architecture": "deit_small_distilled_patch16_224", "num_classes": 1000, "num_features": 384}


def _vit_own(tmp: Path) -> dict[str, Any]:
    ClassicViT.from_preset("vit-tiny").save_pretrained(tmp / "vit")
    return json.loads((tmp / "vit" / "config.json").read_text())


def _dinov2_transformers(tmp: Path) -> dict[str, Any]:
    from transformers import Dinov2Config

    return Dinov2Config(use_swiglu_ffn=True).to_dict()


def _dinov2_registers_transformers(tmp: Path) -> dict[str, Any]:
    from transformers import Dinov2WithRegistersConfig

    return Dinov2WithRegistersConfig().to_dict()


def _dinov2_timm(tmp: Path) -> dict[str, Any]:
    return {"architecture": "vit_giant_patch14_dinov2", "num_classes": 0, "pretrained_cfg": {"tag": "lvd142m"}}


def _dinov2_registers_timm(tmp: Path) -> dict[str, Any]:
    # Prismatic's (OpenVLA's) DINOv2 tower: the hub's name with its tag, built at 224 px
    return {"architecture": "vit_large_patch14_reg4_dinov2.lvd142m", "model_args": {"img_size": 224}}


def _siglip_vision(tmp: Path) -> dict[str, Any]:
    from transformers import SiglipVisionConfig

    return SiglipVisionConfig(vision_use_head=False).to_dict()


def _siglip_full(tmp: Path) -> dict[str, Any]:
    from transformers import SiglipConfig

    return SiglipConfig().to_dict()


def _siglip_timm(tmp: Path) -> dict[str, Any]:
    return {
        "architecture": "vit_so400m_patch14_siglip_224",
        "num_classes": 0,
        "num_features": 1152,
        "global_pool": "map",
        "pretrained_cfg": {"input_size": [3, 224, 224], "num_classes": 0},
    }


def _paligemma(tmp: Path) -> dict[str, Any]:
    from transformers import PaliGemmaConfig

    return PaliGemmaConfig().to_dict()  # its vision_config a SigLIP vision model's, without the head


def _gemma3(tmp: Path) -> dict[str, Any]:
    from transformers import Gemma3Config

    return Gemma3Config().to_dict()


def _pi0_transformers(tmp: Path) -> dict[str, Any]:
    from transformers import PI0Config

    return PI0Config().to_dict()  # PaliGemma's config as its vlm_config


def _pi0_lerobot(tmp: Path) -> dict[str, Any]:
    # LeRobot's policy config.json: the policy's "type", no model_type, no tower keys
    return {"type": "pi05", "paligemma_variant": "gemma_2b", "chunk_size": 50, "image_resolution": [224, 224]}


def _siglip2_vision(tmp: Path) -> dict[str, Any]:
    from transformers import Siglip2VisionConfig

    return Siglip2VisionConfig().to_dict()


def _siglip2_full(tmp: Path) -> dict[str, Any]:
    from transformers import Siglip2Config

    return Siglip2Config().to_dict()


EXAMPLES: dict[str, list[Callable[[Path], dict[str, Any]]]] = {
    "own": [_own],
    "kimi-vl": [_kimi_vl],
    "kimi-k25": [_kimi_k25],
    "kimi-k25-transformers": [_kimi_k25_transformers],
    "kimi-k3": [_kimi_k3],
    "locateanything": [_locateanything],
    "classic-vit": [_vit_transformers, _deit_transformers, _vit_timm, _vit_own],
    "siglip": [_siglip_vision, _siglip_full, _siglip_timm, _paligemma, _gemma3, _pi0_transformers, _pi0_lerobot],
    "siglip2": [_siglip2_vision, _siglip2_full],
    "dinov2": [_dinov2_transformers, _dinov2_registers_transformers, _dinov2_timm, _dinov2_registers_timm],
}
CASES = [
    pytest.param(name, build, id=f"{name}-{build.__name__.strip('_')}")
    for name, builds in EXAMPLES.items()
    for build in builds
]


def claimants(values: dict[str, Any]) -> list[str]:
    """The families that claim ``values`` where the loader asks first: the specific ones, or, where none
    does, the catch-alls."""
    specific = [family.name for family in families() if not family.catch_all and family.claims(values)]
    return specific or [family.name for family in families() if family.catch_all and family.claims(values)]


# ---- the specs ---------------------------------------------------------------------------------


def test_every_family_has_an_example_and_every_spec_is_complete():
    names = [family.name for family in families()]
    assert len(names) == len(set(names)), names
    assert set(names) >= set(EXAMPLES) | MOONVIT
    for family in families():
        assert isinstance(family.config_type, type), family.name
        assert callable(family.claims) and callable(family.read) and callable(family.build), family.name
        assert family.processors, f"{family.name} names no processor rule"
        assert family_named(family.name) is family
    for family in MOONVIT_FAMILIES:
        assert family.description, family.name
        assert set(family.processors) <= set(FAMILY_RULES), family.processors
        assert family.config_type is MoonViTConfig and family.build is MoonViT
        # a release layout is written exactly where the spec says which release
        has_release = family.release is not None
        assert has_release == (family.write_vision is not None) == bool(family.tower_prefix), family.name
    assert {family.name for family in families() if family.catch_all} == {"kimi-vl", "own"}
    # the loader's order: every specific family before the catch-alls
    flags = [family.catch_all for family in families()]
    assert flags == sorted(flags)
    with pytest.raises(ValueError, match=r"no checkpoint family 'nope' \(registered: .*classic-vit.*, own\)"):
        family_named("nope")


@pytest.mark.parametrize(("name", "build"), CASES)
def test_a_familys_config_is_claimed_by_its_own_spec_alone(tmp_path, name, build):
    values = build(tmp_path)
    assert claimants(values) == [name]
    family = find_family(values)
    assert family is not None and family.name == name
    config, layout = family.read(values, tmp_path / "config.json", ())
    assert isinstance(config, family.config_type)
    assert isinstance(layout.prefix, str) and callable(layout.source)


def reference_family(values: dict[str, Any]) -> str:
    """Which MoonViT family a ``config.json`` was read as before the registry, from the rules as the
    format docs state them: no ``vision_config`` is this package's own; any ``vt_*`` key a K2.5 / K3
    release (K3 by ``model_type "kimi_k3"`` or one of its switches); else ``kimi_k25_vision`` (or top
    ``kimi_k25``) transformers'; else ``model_type "locateanything"``; else Kimi-VL's."""
    vision = values.get("vision_config")
    if vision is None:
        return "own"
    if not isinstance(vision, dict):
        return "kimi-vl"  # refused by its reader: not an object
    if any(key.startswith("vt_") for key in vision):
        k3_switches = ("qkv_hidden_size", "norm_type", "layer_norm_eps", "attn_bias", "linear_bias",
                       "patch_embed_proj_bias", "pos_emb_interpolation_mode")  # fmt: skip
        k3 = values.get("model_type") == "kimi_k3" or any(key in vision for key in k3_switches)
        return "kimi-k3" if k3 else "kimi-k25"
    if vision.get("model_type") == "kimi_k25_vision" or values.get("model_type") == "kimi_k25":
        return "kimi-k25-transformers"
    if values.get("model_type") == "locateanything":
        return "locateanything"
    return "kimi-vl"


def _variants(values: dict[str, Any]) -> list[dict[str, Any]]:
    """``values`` under every top-level model_type, vision model_type and the marks that tell families
    apart (a ``vt_`` key, a K3 switch), to find any config the registry reads as another family."""
    out = []
    tops = (None, "kimi_vl", "kimi_k25", "kimi_k3", "locateanything", "llava")
    visions = (None, "moonvit", "kimi_k25_vision")
    for top, vision_type, vt, switch in itertools.product(tops, visions, (False, True), (False, True)):
        config = json.loads(json.dumps(values))
        config.pop("model_type", None)
        if top is not None:
            config["model_type"] = top
        vision = config.get("vision_config")
        if isinstance(vision, dict):
            vision.pop("model_type", None)
            if vision_type is not None:
                vision["model_type"] = vision_type
            if vt:
                vision["vt_hidden_size"] = vision.get("hidden_size", 64)
            if switch:
                vision["norm_type"] = "layernorm"
        out.append(config)
    return out


@pytest.mark.parametrize(("name", "build"), [case for case in CASES if case.values[0] in MOONVIT])
def test_the_registry_picks_the_family_the_detection_always_picked(tmp_path, name, build):
    for values in _variants(build(tmp_path)):
        family = find_family(values)
        assert family is not None and family.name == reference_family(values), values
        assert claimants(values) == [family.name]


def test_the_shapes_the_catch_alls_take(tmp_path):
    own = _own(tmp_path)
    assert find_family({**own, "vision_config": None}).name == "own"  # type: ignore[union-attr]
    listed = {"model_type": "kimi_vl", "vision_config": [1, 2]}
    assert find_family(listed).name == "kimi-vl"  # type: ignore[union-attr]
    (tmp_path / "listed").mkdir()
    (tmp_path / "listed" / "config.json").write_text(json.dumps(listed))
    with pytest.raises(CheckpointError, match=r"listed/config\.json: vision_config is a list, not an object"):
        read_config(tmp_path / "listed")


@pytest.mark.parametrize(("name", "build"), [case for case in CASES if case.values[0] in MOONVIT])
def test_each_family_warns_once_about_the_keys_it_does_not_read(tmp_path, name, build):
    values = build(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its own config.json: nothing to warn about
        config, family_name = encoder_config_from_json(values, tmp_path / "config.json")
    assert family_name == name
    where = values if name == "own" else values["vision_config"]
    where["num_hiden_layers"] = 3
    with pytest.warns(UserWarning, match=r"config\.json: ignoring keys this package does not read: num_hiden_layers$"):
        assert encoder_config_from_json(values, tmp_path / "config.json") == (config, name)


def test_a_family_registered_later_is_asked_before_the_catch_alls(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))

    def read(values: dict[str, Any], where: Path, names: Any) -> tuple[MoonViTConfig, TowerLayout]:
        return MoonViTConfig.from_dict(values), TowerLayout("own", "")

    toy = Family("toy", MoonViTConfig, lambda values: values.get("model_type") == "toy", read, MoonViT, ("Kimi-VL",))
    register_family(toy)
    assert families()[-2:] == (family_named("kimi-vl"), family_named("own"))
    assert find_family({**_own(tmp_path), "model_type": "toy"}) is toy
    assert find_family(_own(tmp_path)).name == "own"  # type: ignore[union-attr]


# ---- save -> read_config, per family -------------------------------------------------------------


def _same_config(read: Any, written: Any) -> None:
    assert dataclasses.replace(read, **{name: getattr(written, name) for name in RUNTIME}) == written


def _same_weights(loaded: torch.nn.Module, model: torch.nn.Module) -> None:
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


RELEASES = {
    # family: (the tower, its projector or None)
    "kimi-vl": lambda: (tiny_model(), None),
    "kimi-k25": lambda: (tiny_model(init_pos_emb_time=4), None),
    "kimi-k3": lambda: (tiny_k3_model(dtype=torch.float32), None),
    "locateanything": lambda: tiny_locateanything(dtype=torch.float32),
}


@pytest.mark.parametrize("name", sorted(RELEASES))
def test_a_release_round_trips_through_its_spec(tmp_path, name):
    model, projector = RELEASES[name]()
    model.save_pretrained(tmp_path, layout="release", projector=projector)
    values = json.loads((tmp_path / "config.json").read_text())
    family = family_named(name)
    assert isinstance(family, MoonViTFamily) and family.release is not None
    assert (values["model_type"], values["architectures"]) == (family.release[0], [family.release[1]])
    assert find_family(values) is family
    config, layout = read_config(tmp_path)
    _same_config(config, model.config)
    assert layout == TowerLayout("release", family.tower_prefix)
    _same_weights(MoonViT.from_pretrained(tmp_path), model)


def test_own_folders_round_trip_and_never_open_their_tensors_to_read_the_config(tmp_path, monkeypatch):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    import moonvit.weights.checkpoint as checkpoint

    def refuse(folder: Path) -> list[str]:
        raise AssertionError("an own folder's tensor names were read")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "tensor_names", refuse)
        config, layout = read_config(tmp_path)
    _same_config(config, model.config)
    assert layout == TowerLayout("own", "")
    _same_weights(MoonViT.from_pretrained(tmp_path), model)


def test_transformers_kimi_k25_folders_round_trip_in_its_native_names(tmp_path):
    """Written as transformers keeps the tower in memory (its config, q / k rows permuted per head)."""
    values = _kimi_k25_transformers(tmp_path)
    model = tiny_model(init_pos_emb_time=4)
    heads = model.config.num_attention_heads
    tensors = TowerLayout("native", "model.vision_tower.", heads).checkpoint_tensors(model.state_dict())
    (tmp_path / "config.json").write_text(json.dumps(values))
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, tmp_path / "model.safetensors")
    config, layout = read_config(tmp_path)
    assert find_family(values).name == "kimi-k25-transformers"  # type: ignore[union-attr]
    _same_config(config, model.config)
    assert layout == TowerLayout("native", "model.vision_tower.", heads)
    _same_weights(MoonViT.from_pretrained(tmp_path), model)


def test_classic_vit_folders_round_trip(tmp_path):
    model = ClassicViT.from_preset("vit-tiny")
    model.save_pretrained(tmp_path)
    config, _ = read_config(tmp_path)
    assert isinstance(config, ClassicViTConfig)
    _same_config(config, model.config)
    loaded = MoonViT.from_pretrained(tmp_path)
    assert type(loaded) is ClassicViT
    _same_weights(loaded, model)


def test_a_subclass_loads_as_itself(tmp_path):
    class Tagged(MoonViT):
        pass

    tiny_model().save_pretrained(tmp_path)
    assert type(Tagged.from_pretrained(tmp_path)) is Tagged
