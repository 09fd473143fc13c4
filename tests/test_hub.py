"""Hub ids through huggingface_hub, offline, against a cache laid out as huggingface_hub lays it out.

The machines that run these tests have no hub access: every test runs in offline mode
(``HF_HUB_OFFLINE``) against a cache written here file by file in huggingface_hub's layout
(``models--owner--name/{refs/main, blobs/<etag>, snapshots/<commit>/<file> -> blob,
.no_exist/<commit>/<file>}``), which ``huggingface_hub.scan_cache_dir`` is asked to accept.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants  # a lazy submodule: imported before the fixtures patch it
import pytest
import torch
from helpers import (
    LOCATEANYTHING_SHARDS,
    randomize_,
    tiny_k3_model,
    tiny_k3_projector,
    tiny_locateanything,
    tiny_model,
    write_k3_release_folder,
    write_kimi_vl_folder,
    write_locateanything_folder,
)
from PIL import Image
from safetensors.torch import save_file

from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor
from moonvit.weights.hub import is_hub_id, source_label
from moonvit_projector import MoonViTProjector, ProjectorConfig

REPO_ID = "moonshotai/Kimi-VL-A3B-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXT = 48
SHARDS = {  # which tensors each shard holds, as in a release: the tower spread over two shards
    "model-00001-of-00004.safetensors": "vision_even+embed",
    "model-00002-of-00004.safetensors": "vision_odd",
    "model-00003-of-00004.safetensors": "projector+lm_head",
    "model-00004-of-00004.safetensors": "language_model",
}


def kimi_vl_repo(folder: Path, encoder: MoonViT, projector: MoonViTProjector) -> dict[str, Path]:
    """A Kimi-VL-shaped repository's files: config, index, four shards, preprocessor config."""
    folder.mkdir(parents=True, exist_ok=True)
    c = encoder.config
    config = {
        "model_type": "kimi_vl",
        "vision_config": {
            "model_type": "moonvit",
            "patch_size": c.patch_size,
            "num_attention_heads": c.num_attention_heads,
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "merge_kernel_size": list(c.merge_kernel_size),
        },
        "text_config": {"hidden_size": TEXT},
    }
    vision = {f"vision_tower.{k}": v.contiguous() for k, v in encoder.state_dict().items()}
    names = sorted(vision)
    tensors = {
        "model-00001-of-00004.safetensors": {k: vision[k] for k in names[::2]}
        | {"language_model.model.embed_tokens.weight": torch.randn(100, TEXT)},
        "model-00002-of-00004.safetensors": {k: vision[k] for k in names[1::2]},
        "model-00003-of-00004.safetensors": {
            f"multi_modal_projector.{k}": v.contiguous() for k, v in projector.state_dict().items()
        }
        | {"language_model.lm_head.weight": torch.randn(100, TEXT)},
        "model-00004-of-00004.safetensors": {"language_model.model.layers.0.mlp.weight": torch.randn(TEXT, TEXT)},
    }
    files = {"config.json": folder / "config.json"}
    files["config.json"].write_text(json.dumps(config))
    weight_map = {}
    for name, content in tensors.items():
        save_file(content, folder / name)
        files[name] = folder / name
        weight_map.update(dict.fromkeys(content, name))
    files["model.safetensors.index.json"] = folder / "model.safetensors.index.json"
    files["model.safetensors.index.json"].write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    MoonViTImageProcessor(in_token_limit=16384).save_pretrained(folder)
    files["preprocessor_config.json"] = folder / "preprocessor_config.json"
    return files


def write_hub_cache(
    cache: Path, repo_id: str, files: dict[str, Path], *, missing: tuple[str, ...] = (), commit: str = COMMIT
) -> Path:
    """Put ``files`` into ``cache`` as huggingface_hub does, and record ``missing`` as known absent.

    Blobs are named by their etag: the sha256 of LFS files (safetensors), the git blob sha1 of
    others; snapshot entries are relative symlinks to them. Returns the snapshot folder.
    """
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes()
        if name.endswith(".safetensors"):
            etag = hashlib.sha256(data).hexdigest()
        else:
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        blob = repo / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for name in missing:
        marker = repo / ".no_exist" / commit / name
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    return snapshot


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """Offline mode and an empty cache folder, as HF_HUB_OFFLINE=1 HF_HUB_CACHE=... would set them."""
    cache = tmp_path / "hub-cache"
    cache.mkdir()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def models():
    encoder = tiny_model()
    torch.manual_seed(3)
    projector = randomize_(MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, TEXT)), seed=4)  # type: ignore[arg-type]
    return encoder, projector.eval()


@pytest.fixture
def requested(monkeypatch):
    """The file names the loaders ask huggingface_hub for (the calls pass through)."""
    names: list[str] = []
    download = huggingface_hub.hf_hub_download

    def spy(repo_id, filename, **kwargs):
        names.append(filename)
        return download(repo_id, filename, **kwargs)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", spy)
    return names


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_the_cache_here_is_one_huggingface_hub_accepts(tmp_path, models):
    files = kimi_vl_repo(tmp_path / "repo", *models)
    write_hub_cache(tmp_path / "cache", REPO_ID, files)
    info = huggingface_hub.scan_cache_dir(tmp_path / "cache")
    assert not info.warnings
    (repo,) = info.repos
    (revision,) = repo.revisions
    assert repo.repo_id == REPO_ID and revision.commit_hash == COMMIT and revision.refs == {"main"}
    assert {f.file_name for f in revision.files} == set(files)


def test_the_tower_loads_from_its_shards_alone(tmp_path, offline, models, requested):
    encoder, projector = models
    files = kimi_vl_repo(tmp_path / "repo", encoder, projector)
    tower_files = ("config.json", "model.safetensors.index.json", *list(SHARDS)[:2])
    write_hub_cache(offline, REPO_ID, {name: files[name] for name in tower_files})  # no projector, no LM shard
    loaded = MoonViT.from_pretrained(REPO_ID)
    assert same_weights(loaded, encoder)
    assert sorted(requested) == sorted(tower_files)


def test_the_projector_loads_from_its_shard_alone(tmp_path, offline, models, requested):
    encoder, projector = models
    files = kimi_vl_repo(tmp_path / "repo", encoder, projector)
    needed = ("config.json", "model.safetensors.index.json", "model-00003-of-00004.safetensors")
    write_hub_cache(offline, REPO_ID, {name: files[name] for name in needed})
    loaded = MoonViTProjector.from_pretrained(REPO_ID)
    assert same_weights(loaded, projector)
    assert set(requested) == {"projector_config.json", *needed}  # projector_config.json: not cached, no error


def test_the_processor_reads_its_config_from_the_cache(tmp_path, offline, models):
    files = kimi_vl_repo(tmp_path / "repo", *models)
    write_hub_cache(offline, REPO_ID, {"preprocessor_config.json": files["preprocessor_config.json"]})
    assert MoonViTImageProcessor.from_pretrained(REPO_ID).in_token_limit == 16384


def test_a_processor_config_known_absent_gives_the_defaults_and_an_unknown_one_is_an_error(tmp_path, offline, models):
    files = kimi_vl_repo(tmp_path / "repo", *models)
    write_hub_cache(
        offline, "owner/without", {"config.json": files["config.json"]}, missing=("preprocessor_config.json",)
    )
    assert MoonViTImageProcessor.from_pretrained("owner/without") == MoonViTImageProcessor()
    write_hub_cache(offline, "owner/unknown", {"config.json": files["config.json"]})
    with pytest.raises(CheckpointError, match=r"preprocessor_config\.json of hub repository owner/unknown is not in"):
        MoonViTImageProcessor.from_pretrained("owner/unknown")


def test_a_shard_missing_from_the_cache_is_named(tmp_path, offline, models):
    files = kimi_vl_repo(tmp_path / "repo", *models)
    write_hub_cache(offline, REPO_ID, {name: files[name] for name in ("config.json", "model.safetensors.index.json")})
    with pytest.raises(CheckpointError) as error:
        MoonViT.from_pretrained(REPO_ID)
    message = str(error.value)
    assert message.startswith(f"{REPO_ID} is not a local path, and as a hub id:")
    assert "model-00001-of-00004.safetensors" in message and "HF_HUB_OFFLINE is set" in message


def test_an_uncached_repository_and_a_non_id_are_named(tmp_path, offline):
    with pytest.raises(CheckpointError, match=r"config\.json of hub repository owner/absent is not in the hub cache"):
        MoonViT.from_pretrained("owner/absent")
    with pytest.raises(CheckpointError, match="checkpoint folder nowhere/at/all does not exist"):
        MoonViT.from_pretrained("nowhere/at/all")


def test_a_single_file_repository_in_this_package_s_format(tmp_path, offline, models):
    encoder, projector = models
    encoder.save_pretrained(tmp_path / "own")
    projector.save_pretrained(tmp_path / "own")
    files = {p.name: p for p in (tmp_path / "own").iterdir()}
    write_hub_cache(offline, "me/own", files, missing=("model.safetensors.index.json",))
    assert same_weights(MoonViT.from_pretrained("me/own"), encoder)
    assert same_weights(MoonViTProjector.from_pretrained("me/own"), projector)


def test_a_repository_of_torch_pickles_loads_from_its_tower_shards(tmp_path, offline, models, requested):
    """An older fine-tune with pytorch_model*.bin shards only: the safetensors files known absent,
    the tower's .bin shards fetched, the language model's not."""
    encoder, _ = models
    folder = write_kimi_vl_folder(
        tmp_path / "bin", encoder, sharded=True, storage="bin", other_tensors={"lm.weight": torch.zeros(8, 8)}
    )
    tower = ("config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00003.bin")
    tower += ("pytorch_model-00002-of-00003.bin",)
    absent = ("model.safetensors.index.json", "model.safetensors")
    write_hub_cache(offline, "me/old", {name: folder / name for name in tower}, missing=absent)
    assert same_weights(MoonViT.from_pretrained("me/old"), encoder)
    assert sorted(requested) == sorted([*tower, *absent])


def test_a_k3_release_loads_tower_and_projector_from_their_shards(tmp_path, offline, requested):
    encoder = tiny_k3_model(dtype=torch.float32)
    projector = tiny_k3_projector(encoder)
    folder = write_k3_release_folder(tmp_path / "k3", encoder, projector)
    files = {p.name: p for p in folder.iterdir() if p.name != "model-00003-of-00003.safetensors"}  # no LLM shard
    write_hub_cache(offline, "moonshotai/Kimi-K3", files)
    assert same_weights(MoonViT.from_pretrained("moonshotai/Kimi-K3"), encoder)
    assert same_weights(MoonViTProjector.from_pretrained("moonshotai/Kimi-K3"), projector)
    assert MoonViTImageProcessor.from_pretrained("moonshotai/Kimi-K3").in_token_limit == 65536
    assert "model-00003-of-00003.safetensors" not in requested


def test_a_locateanything_release_loads_tower_projector_and_processor_without_its_language_model(
    tmp_path, offline, requested
):
    encoder, projector = tiny_locateanything(dtype=torch.float32)
    folder = write_locateanything_folder(tmp_path / "la", encoder, projector)
    files = {p.name: p for p in folder.iterdir() if p.name != LOCATEANYTHING_SHARDS[1]}  # no LLM shard
    write_hub_cache(offline, "nvidia/LocateAnything-3B", files)
    assert same_weights(MoonViT.from_pretrained("nvidia/LocateAnything-3B"), encoder)
    assert same_weights(MoonViTProjector.from_pretrained("nvidia/LocateAnything-3B"), projector)
    assert MoonViTImageProcessor.from_pretrained("nvidia/LocateAnything-3B") == MoonViTImageProcessor.locateanything()
    assert LOCATEANYTHING_SHARDS[1] not in requested


def test_a_local_folder_wins_over_a_hub_id(tmp_path, offline, monkeypatch, models):
    encoder, _ = models
    encoder.save_pretrained(tmp_path / "moonshotai" / "Kimi-VL-A3B-Instruct")
    monkeypatch.chdir(tmp_path)
    assert same_weights(MoonViT.from_pretrained(REPO_ID), encoder)  # nothing in the cache: it is local
    assert source_label(REPO_ID) == str(tmp_path / REPO_ID)


def test_without_huggingface_hub_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(CheckpointError, match=r'pip install "moonvit\[hub\]"'):
        MoonViT.from_pretrained("owner/name")


@pytest.mark.parametrize(
    "text, is_id",
    [
        ("moonshotai/Kimi-VL-A3B-Instruct", True),
        ("owner/name.v2", True),
        ("name", False),
        ("a/b/c", False),
        ("./a/b", False),
        ("/abs/path", False),
        ("owner/../x", False),
        ("owner--x/name", False),
    ],
)
def test_hub_ids_are_owner_slash_name(text, is_id):
    assert is_hub_id(text) is is_id
    assert is_hub_id(Path("owner/name")) is False  # a Path is always local


def test_the_command_lines_take_a_hub_id_with_hf_hub_offline(tmp_path, models):
    encoder, projector = models
    files = kimi_vl_repo(tmp_path / "repo", encoder, projector)
    cache = tmp_path / "cache"
    write_hub_cache(cache, REPO_ID, {n: p for n, p in files.items() if n != "model-00004-of-00004.safetensors"})
    Image.new("RGB", (56, 28), (30, 60, 90)).save(tmp_path / "a.png")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    out = tmp_path / "out"
    main_job = [sys.executable, "-m", "moonvit", "--checkpoint", REPO_ID, "--images", str(tmp_path / "a.png")]
    subprocess.run([*main_job, "--out", str(out / "main")], env=env, check=True, capture_output=True)
    assert json.loads((out / "main" / "summary.json").read_text())["source"] == REPO_ID
    (tmp_path / "list.txt").write_text("a.png\n")
    export = [
        sys.executable,
        "-m",
        "moonvit_projector.export",
        "--checkpoint",
        REPO_ID,
        "--inputs",
        str(tmp_path / "list.txt"),
    ]
    export += ["--out", str(out / "export"), "--store", "both", "--threads", "1"]
    result = subprocess.run(export, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    run = json.loads((out / "export" / "run.json").read_text())
    assert run["checkpoint"]["path"] == REPO_ID and run["processor"]["in_token_limit"] == 16384
    trainer = [sys.executable, "-m", "moonvit_train", "--objective", "supervised", "--checkpoint", REPO_ID, "--smoke"]
    trainer += ["--dataset", "digits", "--steps", "2", "--evals", "0", "--threads", "1", "--out", str(out / "train")]
    result = subprocess.run([*trainer, "--no-progress", "--peak-tflops", "1"], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((out / "train" / "results.json").read_text())["args"]["checkpoint"] == REPO_ID


def test_a_transformers_vit_repository_loads_its_family_s_tower(tmp_path, offline, requested):
    """google/vit-base-patch16-224's layout (config.json model_type "vit", model.safetensors in the hub's
    names, a classifier head beside the tower): the hub id gives the classic-ViT tower, head and all."""
    from transformers import ViTConfig, ViTForImageClassification

    from moonvit.families.vit import ClassicViT

    torch.manual_seed(0)
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32, num_labels=3
    )
    ViTForImageClassification(config).save_pretrained(tmp_path / "vit")
    files = {p.name: p for p in (tmp_path / "vit").iterdir()}
    write_hub_cache(offline, "google/vit-tiny-test", files, missing=("model.safetensors.index.json",))
    loaded = MoonViT.from_pretrained("google/vit-tiny-test")
    assert isinstance(loaded, ClassicViT) and loaded.head is not None and loaded.head.out_features == 3
    assert "model.safetensors" in requested
