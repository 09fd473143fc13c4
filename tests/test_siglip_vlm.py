"""The SigLIP towers inside VLM and VLA folders, read through the one loader as SigLIP towers.

- transformers' ``PaliGemmaForConditionalGeneration``, ``Gemma3ForConditionalGeneration`` (without and with
  the MAP head its ``vision_config`` may ask for) and ``PI0ForConditionalGeneration``, tiny and random, as
  their ``save_pretrained`` writes them, against the model's own vision tower run image by image
  (``interpolate_pos_encoding=True``) on a pack of the native, larger, smaller and odd-sided grids, float64;
- the same towers in the hub's (transformers 4's) names, ``vision_tower.vision_model.*``, and under
  ``model.``; LeRobot's π0 / π0.5 policy folders (``"type"``, tensors under
  ``[model.]paligemma_with_expert.paligemma.model.vision_tower.vision_model.``);
- the loader's contract: the language model's (and projector's) shard never opened, a hub repository
  fetching its vision shard alone, missing tensors named, folders without a tower or with two refused,
  vision configs that are not SigLIP's refused by name, the released configs' towers.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import normal_images, patch_pack, randomise_
from safetensors.torch import load_file, save_file
from test_hub import offline, requested, write_hub_cache  # noqa: F401 (fixtures)
from test_siglip import GRIDS, PATCH, SIDE, VISION, write_sharded
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    PaliGemmaConfig,
    PaliGemmaForConditionalGeneration,
    PI0Config,
    PI0ForConditionalGeneration,
    PreTrainedModel,
)

from moonvit import CheckpointError, MoonViT
from moonvit.families import family_of, find_family
from moonvit.families.vit import ClassicViT
from moonvit.weights.checkpoint import read_config

FLOAT64 = dict(rtol=0.0, atol=1e-12)  # the parity bound against float64 references (errors about 4e-15: ERRORS)
ERRORS: dict[str, float] = {}
"""The largest error each comparison measured, by folder and output: the module's figures."""

TOKENS = dict(vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
IMAGE_TOKEN = 63


def vision(head: bool = False) -> dict[str, Any]:
    """The tiny SigLIP tower's ``vision_config``: a 4 x 4 table of 8 px patches (PaliGemma's has no head)."""
    return dict(VISION, model_type="siglip_vision_model", image_size=SIDE * PATCH, vision_use_head=head)


def gemma_text(model_type: str = "gemma") -> dict[str, Any]:
    return dict(
        model_type=model_type, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, **TOKENS,
    )  # fmt: skip


def paligemma_config() -> PaliGemmaConfig:
    return PaliGemmaConfig(
        vision_config=vision(), text_config=gemma_text(), projection_dim=32, image_token_index=IMAGE_TOKEN,
        vocab_size=TOKENS["vocab_size"],
    )  # fmt: skip


def gemma3_config(head: bool) -> Gemma3Config:
    text = dict(gemma_text("gemma3_text"), sliding_window=8)
    # 4 tokens per image: Gemma 3's 2 x 2 average pool over the 4 x 4 grid
    return Gemma3Config(
        vision_config=vision(head), text_config=text, mm_tokens_per_image=4, image_token_index=IMAGE_TOKEN,
        boi_token_index=61, eoi_token_index=62,
    )  # fmt: skip


def pi0_config() -> PI0Config:
    vlm = dict(paligemma_config().to_dict(), model_type="paligemma")
    expert = dict(gemma_text(), hidden_size=16, intermediate_size=32, head_dim=8)
    return PI0Config(vlm_config=vlm, dit_config=expert)


REFERENCES: dict[str, Callable[[], PreTrainedModel]] = {
    "PaliGemma": lambda: PaliGemmaForConditionalGeneration(paligemma_config()),
    "Gemma3": lambda: Gemma3ForConditionalGeneration(gemma3_config(head=False)),
    "Gemma3-head": lambda: Gemma3ForConditionalGeneration(gemma3_config(head=True)),
    "PI0": lambda: PI0ForConditionalGeneration(pi0_config()),
}


def vision_tower(model: PreTrainedModel) -> torch.nn.Module:
    """The VLM's own vision tower (a ``SiglipVisionModel``)."""
    inner = model.model
    return inner.vlm.vision_tower if hasattr(inner, "vlm") else inner.vision_tower


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, tuple[PreTrainedModel, Path]]:
    """Each reference model (float64, random, eval, SDPA) and the folder its ``save_pretrained`` wrote."""
    out = {}
    for name, build in REFERENCES.items():
        model = randomise_(build().to(torch.float64)).eval()
        model.set_attn_implementation("sdpa")
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (model, folder)
    return out


def tower_outputs(model: PreTrainedModel, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One image through the VLM's vision tower: (h * w, D) patch rows, (D,) pooler output or None."""
    with torch.no_grad():
        out = vision_tower(model)(pixel_values=image.unsqueeze(0), interpolate_pos_encoding=True)
    return out.last_hidden_state[0], None if out.pooler_output is None else out.pooler_output[0]


def record(key: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Assert ``actual`` within :data:`FLOAT64` of ``expected``; keep the largest error under ``key``."""
    assert actual.shape == expected.shape, (key, actual.shape, expected.shape)
    ERRORS[key] = max(ERRORS.get(key, 0.0), float((actual - expected).abs().max()))
    torch.testing.assert_close(actual, expected, **FLOAT64, msg=key)


def check_parity(ours: ClassicViT, reference: PreTrainedModel, key: str) -> None:
    """One packed call over :data:`GRIDS` against the reference tower image by image: patch rows, and
    pooled (the MAP head's output, or the mean of the patch rows without a head)."""
    images = normal_images(GRIDS, PATCH)
    pixels, grids = patch_pack(images, PATCH)
    with torch.no_grad():
        out = ours(pixels, grids)
    lengths = [h * w for h, w in grids.tolist()]
    for i, (rows, image) in enumerate(zip(out.last_hidden_state.split(lengths), images)):
        want_rows, want_pooled = tower_outputs(reference, image)
        record(f"{key}/patches", rows, want_rows)
        record(f"{key}/pooled", out.pooled[i], want_rows.mean(0) if want_pooled is None else want_pooled)


def same_tower(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# ---- float64 parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REFERENCES))
def test_vlm_folders_load_their_vision_tower_and_match_it_image_by_image(folders, name):
    reference, folder = folders[name]
    ours = MoonViT.from_pretrained(folder, dtype=torch.float64)
    assert isinstance(ours, ClassicViT) and ours.dtype == torch.float64
    assert family_of(ours.config).name == "siglip"  # type: ignore[union-attr]
    head = name.endswith("-head")
    assert ours.config.pool == ("map" if head else "avg") and (ours.attn_pool is not None) == head
    assert (ours.config.grid_side, ours.config.pos_emb_rule, ours.config.num_prefix_tokens) == (
        SIDE,
        "transformers",
        0,
    )
    check_parity(ours, reference, name)


# ---- the names a folder may use ----------------------------------------------------------------


def rewrite(folder: Path, target: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Path:
    """A copy of ``folder`` whose tensors are ``edit(tensors)``."""
    target.mkdir(parents=True)
    (target / "config.json").write_text((folder / "config.json").read_text())
    save_file(edit(load_file(folder / "model.safetensors")), target / "model.safetensors")
    return target


def renamed(old: str, new: str) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """An edit that turns the names starting with ``old`` into ones starting with ``new``."""
    return lambda tensors: {(new + n[len(old) :] if n.startswith(old) else n): t for n, t in tensors.items()}


@pytest.mark.parametrize("name", ["PaliGemma", "Gemma3-head"])
@pytest.mark.parametrize(
    "root", ["vision_tower.vision_model.", "model.vision_tower.", "model.vision_tower.vision_model."]
)
def test_the_hub_s_and_in_memory_names_load_the_same_tower(folders, tmp_path, name, root):
    """transformers 5 writes ``vision_tower.*``; the hub and transformers 4 keep ``vision_tower.vision_model.*``;
    a state dict saved as it is in memory has ``model.`` before either."""
    _, folder = folders[name]
    other = rewrite(folder, tmp_path / "other", renamed("vision_tower.", root))
    names = load_file(other / "model.safetensors")
    assert (
        f"{root}embeddings.patch_embedding.weight" in names
        and "vision_tower.embeddings.patch_embedding.weight" not in names
    )
    _, layout = read_config(other)
    assert (layout.prefix, layout.base) == (root, root)
    assert same_tower(MoonViT.from_pretrained(other), MoonViT.from_pretrained(folder))


LEROBOT_ROOT = "paligemma_with_expert.paligemma.model.vision_tower."


@pytest.mark.parametrize(("kind", "outer"), [("pi0", ""), ("pi05", "model.")])
def test_lerobot_policy_folders_load_the_paligemma_tower(folders, tmp_path, kind, outer):
    """LeRobot's policy folder: its ``config.json`` has the policy's ``type`` and no tower keys (the sizes
    here from this package's ``vision_config``); its tensors the hub's names (``vision_model.`` kept), under
    ``model.`` where LeRobot's own ``save_pretrained`` wrote the policy."""
    reference, folder = folders["PI0"]
    assert any(n.startswith(LEROBOT_ROOT) for n in load_file(folder / "model.safetensors"))  # transformers' save
    target = rewrite(folder, tmp_path / kind, renamed(LEROBOT_ROOT, f"{outer}{LEROBOT_ROOT}vision_model."))
    policy = {
        "type": kind, "paligemma_variant": "gemma_2b", "action_expert_variant": "gemma_300m", "chunk_size": 50,
        "image_resolution": [SIDE * PATCH, SIDE * PATCH], "vision_config": vision(),
    }  # fmt: skip
    (target / "config.json").write_text(json.dumps(policy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # LeRobot's own keys are not the tower's: nothing to warn about
        ours = MoonViT.from_pretrained(target, dtype=torch.float64)
    assert find_family(policy).name == "siglip"  # type: ignore[union-attr]
    assert read_config(target)[1].prefix == f"{outer}{LEROBOT_ROOT}vision_model."
    assert same_tower(ours, MoonViT.from_pretrained(folder, dtype=torch.float64))
    check_parity(ours, reference, f"LeRobot-{kind}")


# ---- the loader's contract ---------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REFERENCES))
def test_the_language_model_s_shard_is_never_opened(folders, tmp_path, name):
    _, folder = folders[name]
    tensors = load_file(folder / "model.safetensors")
    tower = LEROBOT_ROOT if name == "PI0" else "vision_tower."
    others = [n for n in tensors if not n.startswith(tower)]
    assert any("language_model." in n for n in others) and any("multi_modal_projector." in n for n in others)
    write_sharded(tmp_path, tensors, folder / "config.json", tower)
    # garbled, then gone: neither is noticed, as the shard is never opened
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not a safetensors file")
    garbled = MoonViT.from_pretrained(tmp_path, dtype=torch.float64)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    assert same_tower(MoonViT.from_pretrained(tmp_path, dtype=torch.float64), garbled)
    assert same_tower(garbled, MoonViT.from_pretrained(folder, dtype=torch.float64))


def test_a_hub_paligemma_fetches_its_vision_shard_alone(folders, tmp_path, offline, requested):  # noqa: F811
    """Before its index is fetched the folder's names are not known: the hub's root (``vision_tower.``) is
    what the fetch asks for, and the hub's transformers 4 names start with it."""
    _, folder = folders["PaliGemma"]
    hub_names = renamed("vision_tower.", "vision_tower.vision_model.")(load_file(folder / "model.safetensors"))
    write_sharded(tmp_path / "repo", hub_names, folder / "config.json", "vision_tower.")
    write_hub_cache(offline, "google/paligemma-tiny-test", {p.name: p for p in (tmp_path / "repo").iterdir()})
    loaded = MoonViT.from_pretrained("google/paligemma-tiny-test", dtype=torch.float64)
    assert same_tower(loaded, MoonViT.from_pretrained(folder, dtype=torch.float64))
    assert "model-00001-of-00002.safetensors" in requested
    assert "model-00002-of-00002.safetensors" not in requested  # the language model's shard


def test_missing_and_stray_tower_tensors_are_named(folders, tmp_path):
    _, folder = folders["PaliGemma"]
    missing = rewrite(
        folder,
        tmp_path / "missing",
        lambda t: {n: v for n, v in t.items() if n != "vision_tower.post_layernorm.weight"},
    )
    with pytest.raises(CheckpointError, match=r"missing \['vision_tower\.post_layernorm\.weight'\]"):
        MoonViT.from_pretrained(missing)
    # the head the config says is not there
    _, headed = folders["Gemma3-head"]
    heads = {n: v for n, v in load_file(headed / "model.safetensors").items() if n.startswith("vision_tower.head.")}
    stray = rewrite(folder, tmp_path / "stray", lambda t: {**t, **heads})
    with pytest.raises(CheckpointError, match=r"unexpected 11 tensors: vision_tower\.head\.attention\.in_proj_bias"):
        MoonViT.from_pretrained(stray)


def test_folders_without_a_tower_or_with_two_are_refused(folders, tmp_path):
    _, folder = folders["Gemma3"]
    none = rewrite(folder, tmp_path / "none", lambda t: {n: v for n, v in t.items() if "vision_tower" not in n})
    with pytest.raises(CheckpointError, match=r"model_type 'gemma3': no SigLIP vision tower among its tensors"):
        MoonViT.from_pretrained(none)
    two = rewrite(
        folder,
        tmp_path / "two",
        lambda t: {**t, **{k: v.clone() for k, v in renamed("vision_tower.", "model.vision_tower.")(t).items()}},
    )
    with pytest.raises(CheckpointError, match=r"several vision towers, under model\.vision_tower\., vision_tower\."):
        MoonViT.from_pretrained(two)


# ---- config.json -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"model_type": "gemma3", "vision_config": {"model_type": "clip_vision_model"}},
            r"model_type 'gemma3': vision_config model_type 'clip_vision_model' is not a SigLIP vision model's",
        ),
        ({"model_type": "paligemma"}, r"model_type 'paligemma': vision_config \(the SigLIP tower's keys\) is missing"),
        ({"model_type": "pi0", "vlm_config": None}, r"model_type 'pi0': vlm_config \(its PaliGemma config\) is None"),
        ({"type": "pi0", "image_resolution": 224}, r"image_resolution 224 is not a \[height, width\] pair"),
        (
            {"model_type": "paligemma", "vision_config": {"hidden_act": "quick_gelu"}},
            r"hidden_act 'quick_gelu' is not supported",
        ),
    ],
)
def test_configs_the_family_cannot_read_are_named(tmp_path, values, message):
    assert find_family(values).name == "siglip"  # type: ignore[union-attr]  # not the Kimi-VL catch-all
    (tmp_path / "config.json").write_text(json.dumps(values))
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        read_config(tmp_path)


SO400M = dict(hidden_size=1152, intermediate_size=4304, num_attention_heads=16, num_hidden_layers=27, patch_size=14)
PALIGEMMA_3B_VISION = {
    **SO400M, "model_type": "siglip_vision_model", "num_image_tokens": 256, "projection_dim": 2048,
    "projector_hidden_act": "gelu_fast", "vision_use_head": False, "torch_dtype": "float32",
}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "grid_side"),
    [
        # google/paligemma-3b-pt-224: no image_size (224), the projector's keys beside the tower's
        ({"model_type": "paligemma", "vision_config": PALIGEMMA_3B_VISION}, 16),
        # google/gemma-3-4b-it: 896 px, a 64 x 64 table
        ({"model_type": "gemma3", "vision_config": {**SO400M, "image_size": 896, "vision_use_head": False}}, 64),
        # LeRobot's policies: PaliGemma's tower at image_resolution (pi0_fast's stays at 224)
        ({"type": "pi0", "paligemma_variant": "gemma_2b", "chunk_size": 50}, 16),
        ({"type": "pi05", "image_resolution": [448, 448]}, 32),
        ({"type": "pi0_fast", "image_resolution": [448, 448]}, 16),
    ],
)
def test_the_released_configs_give_paligemma_s_tower(tmp_path, values, grid_side):
    family = find_family(values)
    assert family is not None and family.name == "siglip"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config, layout = family.read(values, tmp_path / "config.json", ())
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (1152, 27, 4304)
    assert (config.grid_side, config.patch_size, config.pool, config.hidden_act) == (grid_side, 14, "avg", "gelu_tanh")
    # no names yet (a hub repository before its index): the root the hub's names start with
    assert layout.prefix == ("vision_tower." if "model_type" in values else LEROBOT_ROOT)
