"""`python -m moonvit_projector.export`: each image encoded once (duplicates in a run, and ``--cache``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, run_export, write_images

import moonvit_projector.export.shards as shards_module
from moonvit import MoonViTImageProcessor
from moonvit.encode import encode_processed
from moonvit_projector.dataset import VisualTokenDataset


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def tokens_by_id(out: Path) -> dict[str, dict]:
    dataset = VisualTokenDataset(out)
    return {item["id"]: item for item in (dataset[i] for i in range(len(dataset)))}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The number of images each encoder forward of the export took."""
    calls: list[int] = []

    def counting(encoder, processed, **kwargs):
        result = encode_processed(encoder, processed, **kwargs)
        calls.append(len(result.items))
        return result

    monkeypatch.setattr(shards_module, "encode_processed", counting)
    return calls


@pytest.fixture
def images(tmp_path) -> Path:
    """Four images and two copies of the first (one in a later shard with --shard-size 2)."""
    folder = tmp_path / "images"
    paths = write_images(folder, 4)
    shutil.copyfile(paths[0], folder / "zz_copy.jpg")
    shutil.copyfile(paths[0], folder / "a_copy.jpg")
    return folder


def test_copies_of_an_image_are_encoded_once(checkpoint, images, tmp_path, encoded):
    out = tmp_path / "out"
    summary = run_export("--inputs", images, "--checkpoint", checkpoint, "--out", out, "--shard-size", "2")
    assert sum(encoded) == 4 == summary["encoded_this_run"]  # 6 files, 4 contents
    assert summary["duplicates_this_run"] == 2 and summary["records"] == 6
    records = {record["id"]: record for record in manifest(out)}
    first = records["nested/img000.jpg"]
    for copy in ("a_copy.jpg", "zz_copy.jpg"):
        assert records[copy]["path"] == str(images / copy)
        assert {k: v for k, v in records[copy].items() if k not in ("id", "path")} == {
            k: v for k, v in first.items() if k not in ("id", "path")
        }  # the same shard and offset: one copy of the rows
    tokens = tokens_by_id(out)
    assert torch.equal(tokens["a_copy.jpg"]["projected"], tokens["nested/img000.jpg"]["projected"])
    assert torch.equal(tokens["zz_copy.jpg"]["projected"], tokens["nested/img000.jpg"]["projected"])
    # the first copy in the listing ("a_copy.jpg" sorts first) is the one encoded: the later
    # copy in shard 1 reads shard 0's rows
    assert first["shard"] == "shard-000000.safetensors"


def test_cache_reuses_tokens_and_misses_on_other_settings(checkpoint, images, tmp_path, encoded):
    cache = tmp_path / "cache"
    base = ["--inputs", images, "--checkpoint", checkpoint, "--cache", cache, "--store", "both"]
    first = run_export(*base, "--out", tmp_path / "a")
    assert first["cache_reused_this_run"] == 0 and sum(encoded) == 4
    entries = sorted(cache.rglob("*.safetensors"))
    assert len(entries) == 4

    encoded.clear()
    second = run_export(*base, "--out", tmp_path / "b")
    assert second["cache_reused_this_run"] == 4 and sum(encoded) == 0
    assert (tmp_path / "a" / "shard-000000.safetensors").read_bytes() == (
        tmp_path / "b" / "shard-000000.safetensors"
    ).read_bytes()
    assert (tmp_path / "a" / "manifest.jsonl").read_bytes() == (tmp_path / "b" / "manifest.jsonl").read_bytes()
    assert (tmp_path / "a" / "run.json").read_bytes() == (tmp_path / "b" / "run.json").read_bytes()
    # --cache is not run-defining: the same --out resumes without it
    plain = ["--inputs", images, "--checkpoint", checkpoint, "--store", "both"]
    assert run_export(*plain, "--out", tmp_path / "b")["images_this_run"] == 0

    encoded.clear()
    other_dtype = run_export(*base, "--out", tmp_path / "c", "--dtype", "fp32")
    assert other_dtype["cache_reused_this_run"] == 0 and sum(encoded) == 4

    limited = tmp_path / "ckpt-limit"
    shutil.copytree(checkpoint, limited)
    MoonViTImageProcessor(in_token_limit=32).save_pretrained(limited)
    encoded.clear()
    other_limit = run_export(*base[:2], "--checkpoint", limited, *base[4:], "--out", tmp_path / "d")
    assert other_limit["cache_reused_this_run"] == 0 and sum(encoded) == 4
    assert len(list(cache.iterdir())) == 3  # one folder per settings


def test_a_damaged_cache_entry_is_encoded_again(checkpoint, images, tmp_path, encoded):
    cache = tmp_path / "cache"
    base = ["--inputs", images, "--checkpoint", checkpoint, "--cache", cache]
    run_export(*base, "--out", tmp_path / "a")
    entry = sorted(cache.rglob("*.safetensors"))[0]
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF  # one bit of the tokens
    entry.write_bytes(bytes(data))
    truncated = sorted(cache.rglob("*.safetensors"))[1]
    truncated.write_bytes(truncated.read_bytes()[:20])
    encoded.clear()
    summary = run_export(*base, "--out", tmp_path / "b")
    assert summary["cache_corrupt_this_run"] == 2 and summary["cache_reused_this_run"] == 2 and sum(encoded) == 2
    assert (tmp_path / "a" / "shard-000000.safetensors").read_bytes() == (
        tmp_path / "b" / "shard-000000.safetensors"
    ).read_bytes()
    encoded.clear()
    assert run_export(*base, "--out", tmp_path / "c")["cache_reused_this_run"] == 4  # rewritten


def test_the_cache_key_holds_everything_the_tokens_depend_on(checkpoint, images, tmp_path):
    """Each of run.json's token settings changes the cache folder; where the tokens go does not."""
    from moonvit_projector.export.cache import TOKEN_SETTINGS, TokenCache, cache_settings

    run_export("--inputs", images, "--checkpoint", checkpoint, "--out", tmp_path / "out")
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    digest = TokenCache(tmp_path, cache_settings(run)).digest
    changed = {
        "moonvit_version": "0.0.0",
        "models": {**run["models"], "encoder": {**run["models"]["encoder"], "rope_theta": 1.0}},
        "compute": {**run["compute"], "host": {**run["compute"]["host"], "pillow": "0.0"}},
        "checkpoint": {**run["checkpoint"], "sha256": "0" * 64},
        "arguments": {**run["arguments"], "max_patches_per_pack": 64},
    }
    assert set(TOKEN_SETTINGS) <= set(run) and {"moonvit_version", "models", "compute"} <= set(TOKEN_SETTINGS)
    for key, value in changed.items():
        assert TokenCache(tmp_path, cache_settings({**run, key: value})).digest != digest, key
    elsewhere = {**run, "inputs": {"path": "/elsewhere", "count": 1, "sha256": "0"}, "video_processor": {}}
    assert (
        TokenCache(tmp_path, cache_settings({**elsewhere, "checkpoint": {**run["checkpoint"], "path": "x"}})).digest
        == digest
    )
