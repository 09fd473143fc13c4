"""`python -m moonvit_projector.export`: tokens, failures, resume after SIGKILL, torchrun, reruns."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    assert_close_across_shapes,
    folder_bytes,
    make_checkpoint,
    run_export,
    with_threads,
    write_images,
)
from PIL import Image
from safetensors import safe_open

import moonvit
import moonvit_projector.export.run as export_run
from moonvit import MoonViT, MoonViTImageProcessor
from moonvit.files import sha256_file
from moonvit.model.attention import resolve_attn_implementation
from moonvit.runs import compute_facts
from moonvit_projector import MoonViTProjector, ProjectorConfig
from moonvit_projector.dataset import VisualTokenDataset
from moonvit_projector.export import ExportError, InputImage, read_inputs, split_balanced

REPO = Path(__file__).resolve().parents[1]


# ---- builders --------------------------------------------------------------------------------


def export_command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "moonvit_projector.export", *map(str, args), "--threads", "1"]


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]


def failures(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]


def tokens_by_id(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    dataset = VisualTokenDataset(out)
    return {item["id"]: item for item in (dataset[i] for i in range(len(dataset)))}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


# ---- tokens ----------------------------------------------------------------------------------


def test_exported_tokens_equal_the_encoder_and_projector_run_directly(tmp_path, checkpoint):
    paths = write_images(tmp_path / "images", 7)
    out = tmp_path / "out"
    summary = run_export(
        "--inputs",
        tmp_path / "images",
        "--checkpoint",
        checkpoint,
        "--out",
        out,
        "--store",
        "both",
        "--dtype",
        "fp32",
        "--shard-size",
        "3",
        "--max-patches-per-pack",
        "150",
    )
    assert summary["images"] == 7 and summary["failed"] == 0

    encoder = MoonViT.from_pretrained(checkpoint).eval()
    projector = MoonViTProjector.from_pretrained(checkpoint)
    processor = MoonViTImageProcessor.from_pretrained(checkpoint)
    lines = manifest(out)
    # Input order: sorted relative paths, the subfolder included.
    assert [line["id"] for line in lines] == sorted(p.relative_to(tmp_path / "images").as_posix() for p in paths)
    assert {line["shard"] for line in lines} == {
        "shard-000000.safetensors",
        "shard-000001.safetensors",
        "shard-000002.safetensors",
    }
    exported = tokens_by_id(out)
    for line in lines:
        batch = processor([line["path"]])
        with torch.no_grad():
            merged = encoder(batch.pixel_values, batch.grid_hws).merged
            projected = projector(merged)
        width, height = Image.open(line["path"]).size
        assert line["size"] == [width, height]
        assert line["grid_hw"] == batch.grid_hws[0].tolist()
        assert line["num_tokens"] == merged.shape[0]
        item = exported[line["id"]]
        assert item["merged"].shape == (merged.shape[0], 4, 64) and item["projected"].shape == (merged.shape[0], 32)
        torch.testing.assert_close(item["merged"], merged, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(item["projected"], projected, rtol=1e-5, atol=1e-5)
    assert any(line["resized"] != line["size"] for line in lines)  # some went over in_token_limit
    run = json.loads((out / "run.json").read_text())
    assert run["store"] == ["merged", "projected"] and run["dtype"] == "fp32"
    assert run["processor"]["in_token_limit"] == 64 and len(run["checkpoint"]["sha256"]) == 64


def test_default_export_stores_bf16_projected_tokens(tmp_path, checkpoint):
    write_images(tmp_path / "images", 2)
    run_export("--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out")
    with safe_open(tmp_path / "out" / "shard-000000.safetensors", framework="pt") as shard:
        assert list(shard.keys()) == ["projected"]
        assert shard.get_tensor("projected").dtype == torch.bfloat16


def export_error(capsys, *args: str | Path, status: int = 1, threads: int = 1) -> str:
    """Run an export that must fail: its last stderr line (no traceback)."""
    with pytest.raises(SystemExit) as exit_info:
        run_export(*args, threads=threads)
    assert exit_info.value.code == status
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_merged_only_needs_no_projector(tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "ckpt", projector=False)
    write_images(tmp_path / "images", 2)
    common = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint]
    run_export(*common, "--out", tmp_path / "merged", "--store", "merged")
    assert set(tokens_by_id(tmp_path / "merged")["img001.png"]) == {"id", "grid_hw", "grid_thw", "merged"}
    assert export_error(capsys, *common, "--out", tmp_path / "projected").endswith(
        "(use --store merged to export without a projector)"
    )


def test_projector_from_reads_the_projector_of_another_folder(tmp_path, capsys):
    """A tower saved without a projector exports projected tokens through ``--projector-from``'s: the same
    tokens and weights hash as one folder holding both, run.json naming where the projector came from."""
    tower = make_checkpoint(tmp_path / "tower", projector=False)
    both = make_checkpoint(tmp_path / "both")  # the same encoder and the same projector
    write_images(tmp_path / "images", 3)
    common = ["--inputs", tmp_path / "images", "--dtype", "fp32"]
    run_export(*common, "--checkpoint", tower, "--projector-from", both, "--out", tmp_path / "from")
    run_export(*common, "--checkpoint", both, "--out", tmp_path / "one")
    given, one = (json.loads((tmp_path / name / "run.json").read_text())["checkpoint"] for name in ("from", "one"))
    assert given["sha256"] == one["sha256"] and given["projector_from"] == str(both.resolve())
    assert "projector_from" not in one
    ours, reference = tokens_by_id(tmp_path / "from"), tokens_by_id(tmp_path / "one")
    assert ours.keys() == reference.keys()
    assert all(torch.equal(ours[key]["projected"], reference[key]["projected"]) for key in ours)

    line = export_error(capsys, *common, "--checkpoint", tower, "--projector-from", tower, "--out", tmp_path / "x")
    assert line.startswith(f"python -m moonvit_projector.export: error: --projector-from {tower}: ")
    narrow = tmp_path / "narrow"
    MoonViTProjector(ProjectorConfig(vision_hidden_size=32, text_hidden_size=16)).save_pretrained(narrow)
    line = export_error(capsys, *common, "--checkpoint", tower, "--projector-from", narrow, "--out", tmp_path / "x")
    assert "its projector takes 32-wide patches merged 2x2, the encoder of --checkpoint" in line
    assert "gives 64-wide ones merged 2x2" in line
    line = export_error(capsys, *common, "--checkpoint", tower, "--projector-from", both, "--store", "merged",
                        "--out", tmp_path / "x")  # fmt: skip
    assert line.endswith("--projector-from is for projected tokens; --store merged stores none")
    line = export_error(capsys, *common, "--checkpoint", tower, "--out", tmp_path / "x")
    assert "--projector-from DIR_OR_HUB_ID reads one from another folder" in line
    line = export_error(capsys, *common, "--checkpoint", tower, "--projector-from", tmp_path / "nowhere",
                        "--out", tmp_path / "x", status=2)  # fmt: skip
    assert "argument --projector-from: " in line and "does not exist" in line


# ---- inputs ----------------------------------------------------------------------------------


def test_text_and_jsonl_inputs_resolve_against_their_folder(tmp_path, checkpoint):
    paths = write_images(tmp_path / "images", 3)
    (tmp_path / "list.txt").write_text(f"images/img002.jpg\n\n{paths[1]}\nimages/nested/img000.jpg\n")
    records = [{"id": "cat", "path": "images/img001.png"}, {"id": 7, "path": str(paths[2])}]
    (tmp_path / "list.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run_export("--inputs", tmp_path / "list.txt", "--checkpoint", checkpoint, "--out", tmp_path / "txt")
    run_export("--inputs", tmp_path / "list.jsonl", "--checkpoint", checkpoint, "--out", tmp_path / "jsonl")

    txt, jsonl = manifest(tmp_path / "txt"), manifest(tmp_path / "jsonl")
    assert [line["id"] for line in txt] == ["images/img002.jpg", str(paths[1]), "images/nested/img000.jpg"]
    assert [line["path"] for line in txt] == [str(paths[2]), str(paths[1]), str(paths[0])]
    assert [line["id"] for line in jsonl] == ["cat", "7"]
    assert [line["path"] for line in jsonl] == [str(paths[1]), str(paths[2])]
    a, b = tokens_by_id(tmp_path / "txt"), tokens_by_id(tmp_path / "jsonl")
    # the same image in packs of three and of two: float error apart
    assert_close_across_shapes(a[str(paths[1])]["projected"], b["cat"]["projected"])


def test_one_image_or_video_file_is_one_input_named_by_its_file_name(tmp_path, checkpoint):
    """``--inputs photo.png`` (any case of an image or video extension) is that input alone, its id the
    file name as a folder would show it, not a list of paths read from its bytes."""
    (photo,) = write_images(tmp_path / "in", 2)[1:]
    (tmp_path / "CLIP.MP4").write_bytes(b"not read when listed")
    assert read_inputs(tmp_path / "CLIP.MP4") == [InputImage("CLIP.MP4", str(tmp_path / "CLIP.MP4"))]
    odd = tmp_path / os.fsdecode(b"caf\xe9.png")  # not UTF-8: shown escaped, as in a folder
    shutil.copy(photo, odd)
    assert read_inputs(odd) == [InputImage("caf\\xe9.png", str(odd))]

    summary = run_export("--inputs", photo, "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert summary["images"] == 1 and summary["failed"] == 0
    assert [line["id"] for line in manifest(tmp_path / "out")] == [photo.name]
    alone, in_folder = tokens_by_id(tmp_path / "out"), tokens_by_id(_folder_export(tmp_path, photo, checkpoint))
    assert torch.equal(alone[photo.name]["projected"], in_folder[photo.name]["projected"])


def _folder_export(tmp_path: Path, photo: Path, checkpoint: Path) -> Path:
    """The export of a folder holding ``photo`` alone."""
    (tmp_path / "folder").mkdir()
    shutil.copy(photo, tmp_path / "folder" / photo.name)
    run_export("--inputs", tmp_path / "folder", "--checkpoint", checkpoint, "--out", tmp_path / "folder-out")
    return tmp_path / "folder-out"


def test_a_list_that_is_not_text_is_one_error_naming_the_file(tmp_path, checkpoint, capsys):
    """An image under an extension that is not an image's is not read as a list of binary paths."""
    (photo,) = write_images(tmp_path / "in", 2)[1:]
    shutil.copy(photo, tmp_path / "photo.heic")
    args = ["--inputs", tmp_path / "photo.heic", "--checkpoint", checkpoint, "--out", tmp_path / "o"]
    line = export_error(capsys, *args)
    assert line.startswith(
        f"python -m moonvit_projector.export: error: --inputs {tmp_path / 'photo.heic'} is not a text list of paths "
        "(it holds binary data); --inputs takes a folder, an image or video file (.avi .bmp "
    )
    assert "\\udc" not in line and "PNG" not in line and not (tmp_path / "o").exists()


def test_inputs_with_repeated_ids_or_bad_lines_are_refused(tmp_path):
    (tmp_path / "twice.txt").write_text("a.png\nb.png\na.png\n")
    with pytest.raises(ExportError, match="repeats the ids \\['a.png'\\]"):
        read_inputs(tmp_path / "twice.txt")
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "path": "a.png"}\n{"path": "b.png"}\n')
    with pytest.raises(ExportError, match="bad.jsonl:2: expected a JSON object with 'id' and 'path'"):
        read_inputs(tmp_path / "bad.jsonl")
    (tmp_path / "ok.txt").write_text("a.png\n")
    assert read_inputs(tmp_path / "ok.txt") == [InputImage("a.png", str(tmp_path / "a.png"))]
    with pytest.raises(ExportError, match="neither a folder nor a file"):
        read_inputs(tmp_path / "missing")


def test_bad_files_are_listed_with_reasons_and_the_rest_exported(tmp_path, checkpoint):
    images = tmp_path / "images"
    good = write_images(images, 3)
    (images / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(200))
    (images / "empty.jpg").write_bytes(b"")
    (images / "notes.png").write_text("not an image at all")
    (images / "readme.txt").write_text("ignored: not an image extension")
    whole = good[1].read_bytes()
    (images / "truncated.png").write_bytes(whole[: len(whole) // 2])
    summary = run_export("--inputs", images, "--checkpoint", checkpoint, "--out", tmp_path / "out")

    assert summary["images"] == 3 and summary["failed"] == 4
    assert [line["id"] for line in manifest(tmp_path / "out")] == ["img001.png", "img002.jpg", "nested/img000.jpg"]
    reasons = {line["id"]: line["reason"] for line in failures(tmp_path / "out")}
    assert set(reasons) == {"corrupt.png", "empty.jpg", "notes.png", "truncated.png"}
    assert "cannot open image file" in reasons["empty.jpg"] and "cannot open image file" in reasons["notes.png"]
    assert "truncated" in reasons["truncated.png"]
    assert all(str(images / name) in reason for name, reason in reasons.items())
    assert summary["skipped"] == {".txt": 1}


def test_the_summary_counts_failures_apart_and_gives_the_start_up_and_the_steady_rate(tmp_path, checkpoint, capsys):
    write_images(tmp_path / "in", 4)
    (tmp_path / "in" / "broken.png").write_bytes(b"nope")
    (tmp_path / "in" / "empty.jpg").write_bytes(b"")
    summary = run_export("--inputs", tmp_path / "in", "--checkpoint", checkpoint, "--shard-size", "1",
                         "--out", tmp_path / "out")  # fmt: skip
    assert (summary["images_this_run"], summary["exported_this_run"], summary["failed_this_run"]) == (6, 4, 2)
    assert summary["first_pack_s"] > 0 and summary["steady_items_per_s"] > 0  # one pack a shard: 3 after the first
    printed = capsys.readouterr().out.splitlines()[-1]
    assert printed.startswith("exported 4 images, 2 failed")
    assert "this run processed 6 images (4 exported, 2 failed) into" in printed
    start = re.search(r"; first pack after (\d+\.\d) s, then (\d+\.\d) images/s; ", printed)
    assert start is not None, printed
    assert float(start.group(1)) == round(summary["first_pack_s"], 1)
    assert float(start.group(2)) == round(summary["steady_items_per_s"], 1)


def test_the_summary_counts_images_and_videos_apart(tmp_path, capsys):
    """One image and one clip of two chunks: one image and one video, not three images."""
    pytest.importorskip("av")
    from helpers import tiny_model, write_video

    checkpoint = make_checkpoint(tmp_path / "ckpt")
    tiny_model(init_pos_emb_time=4).save_pretrained(checkpoint)  # a tower with a temporal table
    write_images(tmp_path / "in", 1)
    write_video(tmp_path / "in" / "clip.mkv", 30, 10.0, size=(40, 30))  # 6 sampled frames: chunks of 4 and 2
    summary = run_export("--inputs", tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert [line["id"] for line in manifest(tmp_path / "out")] == ["clip.mkv#0", "clip.mkv#1", "nested/img000.jpg"]
    assert (summary["images"], summary["videos"], summary["video_chunks"], summary["records"]) == (1, 1, 2, 3)
    printed = capsys.readouterr().out
    assert "exported 1 image, 1 video (2 chunks), 0 failed" in printed
    assert "this run processed 3 images and video chunks (3 exported, 0 failed) into" in printed
    assert re.search(r"\(\d+\.\d items/s, \d+ tokens/s; first pack after \d+\.\d s(, then \S+ items/s)?; ", printed)


@pytest.mark.parametrize(
    "files, message",
    [
        ({}, r"names no images$"),
        (
            {"a.txt": "x", "b.txt": "x", "c.json": "{}", "noext": "x", "sub/d.heic": "x"},
            r"names no images: 5 files skipped for their extension \(\.txt 2, \(none\) 1, \.heic 1, \.json 1\); "
            r"image extensions are \.bmp .*\.webp$",
        ),
    ],
)
def test_an_input_folder_without_images_is_an_error(tmp_path, checkpoint, capsys, files, message):
    (tmp_path / "in").mkdir()
    for name, text in files.items():
        (tmp_path / "in" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "in" / name).write_text(text)
    line = export_error(capsys, "--inputs", tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert re.search(message, line), line
    assert not (tmp_path / "out").exists()


def test_an_empty_list_is_an_error(tmp_path, checkpoint, capsys):
    (tmp_path / "list.txt").write_text("\n\n")
    line = export_error(
        capsys, "--inputs", tmp_path / "list.txt", "--checkpoint", checkpoint, "--out", tmp_path / "out"
    )
    assert line.endswith("list.txt names no images")


def test_skipped_files_are_reported_beside_the_images(tmp_path, checkpoint, capsys):
    write_images(tmp_path / "in", 2)
    (tmp_path / "in" / "labels.csv").write_text("a,b\n")
    (tmp_path / "in" / "scan.heic").write_bytes(b"x")
    summary = run_export("--inputs", tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert summary["images"] == 2 and summary["skipped"] == {".csv": 1, ".heic": 1}
    assert "2 files skipped for their extension (.csv 1, .heic 1)" in capsys.readouterr().out


def test_inputs_none_of_which_can_be_exported_are_an_error(tmp_path, checkpoint, capsys):
    (tmp_path / "in").mkdir()
    for name in ("a.png", "b.jpg"):
        (tmp_path / "in" / name).write_text("not an image")
    args = ["--inputs", tmp_path / "in", "--checkpoint", checkpoint]
    line = export_error(capsys, *args, "--out", tmp_path / "out")
    assert "none of the 2 inputs can be exported: cannot open image file" in line
    # Headers that plan but pixels that do not decode: the run ends, and says nothing was exported.
    (tmp_path / "half").mkdir()
    noise = np.random.default_rng(0).integers(0, 256, (40, 60, 3), dtype=np.uint8)
    Image.fromarray(noise).save(tmp_path / "half" / "cut.png")
    whole = (tmp_path / "half" / "cut.png").read_bytes()
    (tmp_path / "half" / "cut.png").write_bytes(whole[: len(whole) // 2])
    line = export_error(capsys, "--inputs", tmp_path / "half", "--checkpoint", checkpoint, "--out", tmp_path / "o2")
    assert line.endswith(f"no image could be exported: the reasons are in {tmp_path / 'o2' / 'failures.jsonl'}")
    assert len(failures(tmp_path / "o2")) == 1


def test_a_budget_below_one_token_is_refused_at_parse_time(tmp_path, checkpoint, capsys):
    write_images(tmp_path / "in", 1)
    args = ["--inputs", tmp_path / "in", "--checkpoint", checkpoint, "--out", tmp_path / "out"]
    line = export_error(capsys, *args, "--max-patches-per-pack", "3", status=2)
    assert "expected a patch budget of at least 4" in line


def test_side_limit_mode_is_a_flag(tmp_path, checkpoint, capsys):
    (tmp_path / "in").mkdir()
    Image.new("RGB", (8000, 10)).save(tmp_path / "in" / "strip.png")  # 0 patches tall: never budget-scaled
    args = ["--inputs", tmp_path / "in", "--checkpoint", checkpoint]
    line = export_error(capsys, *args, "--out", tmp_path / "refused")
    assert "2x572 patch grid" in line and "--side-limit-mode resize" in line
    run_export(*args, "--out", tmp_path / "resized", "--side-limit-mode", "resize")
    (entry,) = manifest(tmp_path / "resized")
    assert entry["grid_hw"] == [2, 512] and entry["resized"] == [7168, 8]
    run = json.loads((tmp_path / "resized" / "run.json").read_text())
    assert run["arguments"]["side_limit_mode"] == run["processor"]["side_limit_mode"] == "resize"


def test_split_balanced_gives_contiguous_ranges_of_about_equal_cost():
    assert split_balanced([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_balanced([10, 1, 1, 1, 1, 1, 5], 2) == [range(0, 1), range(1, 7)]
    ranges = split_balanced([3, 0, 2, 7, 1], 3)
    assert [i for r in ranges for i in r] == [0, 1, 2, 3, 4]
    assert split_balanced([1], 3) == [range(0, 1), range(1, 1), range(1, 1)]


# ---- reruns and resume -----------------------------------------------------------------------


def test_rerunning_a_finished_export_changes_nothing(tmp_path, checkpoint):
    write_images(tmp_path / "images", 5)
    args = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out", "--shard-size", "2"]
    run_export(*args)
    before = folder_bytes(tmp_path / "out")
    summary = run_export(*args)
    assert folder_bytes(tmp_path / "out") == before
    assert summary["images"] == 5 and summary["images_this_run"] == 0


def test_other_arguments_into_the_same_folder_are_refused_naming_each_difference(tmp_path, checkpoint, capsys):
    write_images(tmp_path / "images", 2)
    args = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out"]
    run_export(*args)
    before = folder_bytes(tmp_path / "out")
    line = export_error(capsys, *args, "--dtype", "fp32")
    # compute.attention may differ between the two as well (OpenVINO's is taken for bf16 only)
    assert "holds an export with other settings (arguments.dtype: 'bf16' there, 'fp32' now; " in line
    assert "; dtype: 'bf16' there, 'fp32' now; from " in line
    assert "use the same arguments to resume, or another --out" in line
    line = export_error(capsys, *args, "--shard-size", "7")
    assert "(arguments.shard_size: 1000 there, 7 now; from " in line
    line = export_error(capsys, *args, "--side-limit-mode", "resize")
    assert "arguments.side_limit_mode: None there, 'resize' now; processor.side_limit_mode: 'error' there" in line
    line = export_error(capsys, *args[:-1], tmp_path / "out", threads=2)
    assert "compute.threads: 1 there, 2 now" in line
    assert folder_bytes(tmp_path / "out") == before


def test_run_json_records_what_the_bytes_depend_on(tmp_path, checkpoint):
    write_images(tmp_path / "images", 1)
    run_export("--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out", threads=2)
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    attention = resolve_attn_implementation("auto", torch.device("cpu"), torch.bfloat16)
    assert run["compute"] == {**with_threads(compute_facts, torch.device("cpu")), "threads": 2, "attention": attention}
    assert set(run["compute"]["host"]) == {"bf16_arithmetic", "amx", "pillow"}
    assert run["compute"]["attention"] in ("openvino", "sdpa")
    assert run["arguments"]["threads"] == 2 and run["checkpoint"]["path"] == str(checkpoint.resolve())
    configs = [MoonViT.from_pretrained(checkpoint).config, MoonViTProjector.from_pretrained(checkpoint).config]
    assert [run["models"][name] for name in ("encoder", "projector")] == json.loads(
        json.dumps([config.to_dict() for config in configs])
    )
    assert run["moonvit_version"] == moonvit.__version__


def test_attn_is_part_of_the_run(tmp_path, checkpoint, capsys):
    write_images(tmp_path / "images", 2)
    args = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out"]
    run_export(*args, "--attn", "eager")
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert run["compute"]["attention"] == "eager" and run["arguments"]["attn"] == "eager"
    assert run["models"]["encoder"]["attn_implementation"] == "eager"
    line = export_error(capsys, *args, "--attn", "sdpa")
    assert "arguments.attn: 'eager' there, 'sdpa' now" in line and "compute.attention: 'eager' there" in line


def test_the_same_tensors_under_another_config_are_another_run(tmp_path, checkpoint, capsys):
    """A config.json change that leaves every tensor as it is (here the head count) gives other
    tokens: a finished --out is refused, and a shared --cache encodes again, never serving the
    first model's tokens."""
    write_images(tmp_path / "images", 3)
    cache = tmp_path / "cache"
    args = ["--inputs", tmp_path / "images", "--cache", cache]
    first = run_export(*args, "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert first["encoded_this_run"] == 3

    other = tmp_path / "other-heads"
    shutil.copytree(checkpoint, other)
    config = json.loads((other / "config.json").read_text())
    assert config["num_attention_heads"] == 4
    (other / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    line = export_error(capsys, *args, "--checkpoint", other, "--out", tmp_path / "out")
    assert "models.encoder.num_attention_heads: 4 there, 8 now" in line

    second = run_export(*args, "--checkpoint", other, "--out", tmp_path / "out-other")
    assert second["cache_reused_this_run"] == 0 and second["encoded_this_run"] == 3
    old, new = (VisualTokenDataset(tmp_path / name) for name in ("out", "out-other"))
    assert not torch.equal(old[0]["projected"], new[0]["projected"])
    assert len(list(cache.iterdir())) == 2  # one folder per model


def test_an_image_replaced_after_planning_is_not_stored_under_its_old_hash(tmp_path, checkpoint, monkeypatch):
    """The hash and the pixels come from one read: a file replaced between planning and decoding
    fails with its reason (the same size, other pixels), nothing is cached under the old content's
    hash, and the next run encodes the new content."""
    paths = write_images(tmp_path / "images", 3)
    target = sorted(paths)[0]
    cache = tmp_path / "cache"
    real_plan_all = export_run.plan_all

    def plan_then_replace(*args, **kwargs):
        planned = real_plan_all(*args, **kwargs)
        with Image.open(target) as image:
            size, kind = image.size, image.format
        Image.new("RGB", size, (200, 30, 90)).save(target, format=kind)
        return planned

    monkeypatch.setattr(export_run, "plan_all", plan_then_replace)
    args = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--cache", cache]
    summary = run_export(*args, "--out", tmp_path / "out")
    assert summary["records"] == 2 and summary["failed"] == 1
    (failure,) = [json.loads(line) for line in (tmp_path / "out" / "failures.jsonl").read_text().splitlines()]
    assert failure["path"] == str(target) and "changed after it was planned" in failure["reason"]
    stored = {entry.stem for entry in cache.rglob("*.safetensors")}
    assert sha256_file(target) not in stored and len(stored) == 2

    monkeypatch.setattr(export_run, "plan_all", real_plan_all)
    again = run_export(*args, "--out", tmp_path / "again")
    assert again["records"] == 3 and again["cache_reused_this_run"] == 2 and again["encoded_this_run"] == 1
    assert sha256_file(target) in {entry.stem for entry in cache.rglob("*.safetensors")}


def test_a_decoded_image_whose_grid_is_not_the_planned_one_is_refused(tmp_path, checkpoint):
    """A file replaced by an image of another size between its header read and its decoding."""
    from moonvit.encode import process_pack
    from moonvit.media.packing import Pack, plan_pack_item

    path = tmp_path / "a.png"
    Image.new("RGB", (60, 40)).save(path)
    processor = MoonViTImageProcessor.from_pretrained(checkpoint)
    item = plan_pack_item(0, str(path), processor, 4096)
    Image.new("RGB", (120, 40)).save(path)
    _, grids, items, failures = process_pack(processor, Pack((item,)), skip_errors=True)
    assert items == () and len(grids) == 0
    rows, cols = item.plan.grid_hw
    assert "it changed after it was planned" in failures[item.key] and f"planned at {rows}x{cols}" in failures[item.key]


def test_a_cache_shared_by_processes_starting_at_once(tmp_path, checkpoint):
    """Two exports (as torchrun ranks or two jobs sharing a cache) creating one fresh cache at the
    same time: both finish, with the same tokens, and the cache holds each image once."""
    write_images(tmp_path / "images", 4)
    cache = tmp_path / "cache"
    common = ["--inputs", str(tmp_path / "images"), "--checkpoint", str(checkpoint), "--cache", str(cache)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "moonvit_projector.export", *common, "--out", str(tmp_path / f"out{k}"),
             "--threads", "1"],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in range(3)
    ]  # fmt: skip
    try:
        results = [run.communicate(timeout=400) for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert [run.returncode for run in runs] == [0, 0, 0], [err[-1500:] for _, err in results]
    assert folder_bytes(tmp_path / "out0") == folder_bytes(tmp_path / "out1") == folder_bytes(tmp_path / "out2")
    assert len(list(cache.rglob("*.safetensors"))) == 4 and len(list(cache.rglob("settings.json"))) == 1
    assert not list(cache.rglob("*.tmp"))


@pytest.mark.slow
def test_an_export_killed_by_sigkill_resumes_to_the_uninterrupted_result(tmp_path, checkpoint):
    write_images(tmp_path / "images", 40, seed=3)
    common = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--shard-size", "4"]
    out = tmp_path / "out"
    process = subprocess.Popen(
        export_command(*common, "--out", out), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while not (out / "parts" / "shard-000000.json").exists():
            assert process.poll() is None and time.monotonic() < deadline, "the export ended before it was killed"
            time.sleep(0.005)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (out / "manifest.jsonl").exists()
    finished_before = {p.name for p in (out / "parts").glob("*.json")}
    assert 1 <= len(finished_before) < 10

    summary = run_export(*common, "--out", out)
    assert summary["images_this_run"] <= 40 - 4 * len(finished_before)  # finished shards are not redone
    run_export(*common, "--out", tmp_path / "reference")

    lines = manifest(out)
    assert sorted(line["id"] for line in lines) == sorted({line["id"] for line in lines})
    assert len(lines) == 40 and lines == manifest(tmp_path / "reference")
    assert not list(out.rglob("*.tmp"))
    for shard in out.glob("shard-*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            assert f.get_tensor("projected").shape[1] == 32
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")


# ---- torchrun --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_torchrun_export_equals_one_process(tmp_path, checkpoint):
    write_images(tmp_path / "images", 12, seed=5)
    (tmp_path / "images" / "broken.jpg").write_bytes(b"nope")
    common = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--shard-size", "3", "--store", "both"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        *export_command(*common, "--out", tmp_path / "two")[1:],
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported 12 images, 1 failed" in result.stdout
    run_export(*common, "--out", tmp_path / "one")

    assert manifest(tmp_path / "two") == manifest(tmp_path / "one")
    assert failures(tmp_path / "two") == failures(tmp_path / "one")
    assert folder_bytes(tmp_path / "two") == folder_bytes(tmp_path / "one")


def test_help_lists_the_options():
    result = subprocess.run(
        [sys.executable, "-m", "moonvit_projector.export", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    for option in (
        "--inputs",
        "--checkpoint",
        "--out",
        "--store",
        "--dtype",
        "--max-patches-per-pack",
        "--shard-size",
        "--device",
        "--threads",
        "torchrun",
    ):
        assert option in result.stdout
