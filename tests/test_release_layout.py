"""Saving a tower and its projector in their release's layout: read back exactly by this package's
loaders, under the names and config keys of the release folders the test helpers write, and (K2.5)
by transformers' own Kimi_K25ForConditionalGeneration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import (
    k3_release_config,
    locateanything_config,
    locateanything_tensors,
    random_pack,
    randomize_,
    tiny_k3_model,
    tiny_k3_projector,
    tiny_locateanything,
    tiny_model,
    write_k3_release_folder,
    write_k25_release_folder,
    write_k25_transformers_folders,
    write_kimi_vl_folder,
)
from safetensors import safe_open

from moonvit import MoonViT, MoonViTImageProcessor, preset_config
from moonvit.weights.formats import TowerLayout
from moonvit.weights.release import save_release
from moonvit.weights.storage import INDEX_FILE, SINGLE_FILE, tensor_names
from moonvit_projector import MoonViTProjector, ProjectorConfig


def kimi_projector(model: MoonViT, text_hidden_size: int = 32, seed: int = 3) -> MoonViTProjector:
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, text_hidden_size))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in projector.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype))
    return projector.to(model.dtype).eval()


def kimi_vl_pair():
    model = tiny_model(seed=1, dtype=torch.float64)
    return model, kimi_projector(model)


def k25_pair():
    model = randomize_(MoonViT(preset_config("tiny", init_pos_emb_time=4)), seed=2).double().eval()
    return model, kimi_projector(model)


def k3_pair():
    model = tiny_k3_model(seed=3)
    return model, tiny_k3_projector(model)


PAIRS = {"kimi-vl": kimi_vl_pair, "kimi-k25": k25_pair, "kimi-k3": k3_pair, "locateanything": tiny_locateanything}


def reference_folder(family: str, folder: Path, model: MoonViT, projector: MoonViTProjector) -> tuple[set[str], dict]:
    """The tower and projector tensor names, and the config.json, of the helpers' release folder for
    ``family`` (the language model's stand-in tensors left out)."""
    if family == "kimi-vl":
        # the helper writes the tower alone; the projector's names are Kimi-VL's multi_modal_projector.*
        projector_names = {f"multi_modal_projector.{m}.{k}" for m in ("pre_norm", "linear_1", "linear_2")
                           for k in ("weight", "bias")}  # fmt: skip
        write_kimi_vl_folder(folder, model, text_hidden_size=projector.config.text_hidden_size)
        return set(tensor_names(folder)) | projector_names, json.loads((folder / "config.json").read_text())
    if family == "kimi-k25":
        write_k25_release_folder(folder, model, projector)
        names = set(tensor_names(folder))
    elif family == "kimi-k3":
        write_k3_release_folder(folder, model, projector)
        names = set(tensor_names(folder))
    else:
        names = set(locateanything_tensors(model, projector))
        return names, locateanything_config(model, projector.config.text_hidden_size)
    return {name for name in names if not name.startswith("language_model.")}, json.loads(
        (folder / "config.json").read_text()
    )


def outputs(model: MoonViT, projector: MoonViTProjector) -> tuple[torch.Tensor, torch.Tensor]:
    pixels, grids = random_pack([(4, 6), (2, 2)], dtype=model.dtype)
    with torch.no_grad():
        out = model(pixels, grids)
        return out.last_hidden_state, projector(out.merged)


@pytest.mark.parametrize("family", sorted(PAIRS))
def test_a_release_layout_save_loads_back_exactly_under_the_releases_names(tmp_path, family):
    model, projector = PAIRS[family]()
    model.save_pretrained(tmp_path / "saved", layout="release", projector=projector)

    loaded = MoonViT.from_pretrained(tmp_path / "saved")
    loaded_projector = MoonViTProjector.from_pretrained(tmp_path / "saved")
    assert loaded.config == model.config and loaded_projector.config == projector.config
    for mine, theirs in ((model, loaded), (projector, loaded_projector)):
        state = theirs.state_dict()
        assert state.keys() == mine.state_dict().keys()
        for name, tensor in mine.state_dict().items():
            assert state[name].dtype == tensor.dtype and torch.equal(state[name], tensor), name
    for ours, back in zip(outputs(model, projector), outputs(loaded, loaded_projector)):
        assert torch.equal(ours, back)

    names, config = reference_folder(family, tmp_path / "reference", model, projector)
    assert set(tensor_names(tmp_path / "saved")) == names
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert (saved["model_type"], saved["architectures"]) == (config["model_type"], config["architectures"])
    vision = saved["vision_config"]
    assert vision == {key: config["vision_config"][key] for key in vision}  # the release's keys and values
    assert saved["text_config"]["hidden_size"] == projector.config.text_hidden_size
    assert not (tmp_path / "saved" / "projector_config.json").exists()


def test_the_k3_config_is_the_releases_with_no_eps_key():
    model, projector = k3_pair()
    from moonvit.weights.release import release_config

    config = release_config(model.config, projector.config, "kimi-k3")
    reference = k3_release_config(model, projector.config.text_hidden_size)["vision_config"]
    assert config["vision_config"] == reference  # every key the release has, none it lacks


def test_a_large_save_is_sharded_with_an_index_and_a_later_save_replaces_it(tmp_path):
    model, projector = k25_pair()
    folder = tmp_path / "saved"
    MoonViTImageProcessor.kimi_k25().save_pretrained(folder)
    assert save_release(folder, model, projector, max_shard_bytes=200_000) == "kimi-k25"
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert not (folder / SINGLE_FILE).exists()
    total = 0
    for shard in shards:
        with safe_open(folder / shard, framework="pt") as f:
            sizes = [f.get_tensor(name).numel() * 8 for name in f.keys()]  # noqa: SIM118
        assert sum(sizes) <= 200_000 or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total
    loaded = MoonViT.from_pretrained(folder)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert MoonViTImageProcessor.from_pretrained(folder) == MoonViTImageProcessor.kimi_k25()

    # this package's layout over it: the index and its shards go, the projector's own files come
    other = tiny_model(seed=7, dtype=torch.float64, init_pos_emb_time=4)
    other.save_pretrained(folder, projector=projector)
    assert sorted(p.name for p in folder.glob("*.safetensors*")) == ["model.safetensors", "projector.safetensors"]
    assert torch.equal(
        MoonViT.from_pretrained(folder).encoder.blocks[0].wqkv.weight, other.encoder.blocks[0].wqkv.weight
    )
    # and the release layout again, in one file: the projector's own files, which would shadow it, go
    model.save_pretrained(folder, layout="release", projector=projector)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    assert all(torch.equal(MoonViT.from_pretrained(folder).state_dict()[k], v) for k, v in model.state_dict().items())


def test_the_native_layout_is_written_as_transformers_permutes_it(tmp_path):
    """The exact inverse of the loader's map, RoPE row permutation and q / k / v split included:
    equal, bit for bit, to the tensors transformers itself holds (its PermuteForRope)."""
    model, projector = k25_pair()
    model, projector = model.float(), projector.float()
    native = write_k25_transformers_folders(tmp_path, model, projector)["native"]
    layout = TowerLayout("native", "model.vision_tower.", model.config.num_attention_heads)
    ours = layout.checkpoint_tensors(model.state_dict())
    with safe_open(native / "model.safetensors", framework="pt") as f:
        theirs = {name: f.get_tensor(name) for name in f.keys() if name.startswith("model.vision_tower.")}  # noqa: SIM118
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_transformers_loads_a_k25_release_save(tmp_path):
    """transformers' Kimi_K25ForConditionalGeneration reads the saved release folder through its own
    conversion (renames, q / k / v split, RoPE permutation): its tower and projector are ours."""
    pytest.importorskip("transformers.models.kimi_k25.modeling_kimi_k25")
    from helpers import k25_full_model, tiny_k25_config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    model, projector = k25_pair()
    model, projector = model.float(), projector.float()
    model.save_pretrained(tmp_path, layout="release", projector=projector)
    config = tiny_k25_config(projector.config.text_hidden_size)
    full, info = Kimi_K25ForConditionalGeneration.from_pretrained(tmp_path, config=config, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(name.startswith(("model.language_model.", "lm_head.")) for name in info["missing_keys"])
    reference = k25_full_model(model, projector).model
    for module in ("vision_tower", "mm_projector"):
        expected = getattr(reference, module).state_dict()
        for name, tensor in getattr(full.model, module).state_dict().items():
            assert torch.equal(tensor, expected[name]), f"{module}.{name}"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"rope_theta": 5000.0}, r"rope_theta 5000.0 reads back as 10000.0"),
        ({"layer_norm_eps": 1e-6}, r"layer_norm_eps 1e-06 reads back as 1e-05"),
    ],
)
def test_a_setting_the_release_has_no_key_for_is_refused(tmp_path, change, message):
    model = MoonViT(preset_config("tiny", **change))
    with pytest.raises(ValueError, match=f"a kimi-vl release's config.json cannot hold this model: {message}"):
        model.save_pretrained(tmp_path, layout="release")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize(
    "tower, projector_type, message",
    [
        ({"init_pos_emb_time": 4}, "mlp1", r"no release holds a kimi-k25 tower with a 'mlp1' projector"),
        ({}, "mlp2x_gelu", r"no release holds a kimi-vl tower with a 'mlp2x_gelu' projector"),
    ],
)
def test_a_projector_no_release_pairs_with_the_tower_is_refused(tmp_path, tower, projector_type, message):
    model = MoonViT(preset_config("tiny", **tower))
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, 32, projector_type=projector_type))
    with pytest.raises(ValueError, match=message):
        model.save_pretrained(tmp_path, layout="release", projector=projector)
    with pytest.raises(ValueError, match="layout 'hf': expected one of own, release"):
        model.save_pretrained(tmp_path, layout="hf")
