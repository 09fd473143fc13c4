"""File names that are not valid UTF-8 (``caf\\xe9.png`` from a Latin-1 system) go through every
command line: read, printed escaped, recorded as valid UTF-8 with their bytes beside them.

Python decodes such a name to a lone surrogate (``'caf\\udce9.png'``); pytest's captured stdout is
UTF-8 and strict, as a terminal's usually is, so a name printed as it is fails these tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import make_checkpoint, run_export
from PIL import Image
from safetensors.torch import load_file

from moonvit.names import display_ids, display_name, path_keys, path_record, recorded_path, text_bytes

LATIN1 = b"caf\xe9.png"
"""A name in Latin-1: ``\\xe9`` alone is not UTF-8."""
SHOWN = "caf\\xe9.png"
"""How it is shown and keyed: the byte as an escape."""


def write_image(folder: Path, name: bytes, seed: int) -> str:
    """A small noise PNG at ``folder / name`` (bytes); returns its path as Python names it."""
    path = os.path.join(os.fsencode(folder), name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    with open(path, "wb") as file:
        Image.fromarray(pixels).save(file, format="PNG")
    return os.fsdecode(path)


@pytest.fixture
def latin1_classes(tmp_path) -> Path:
    """A folder named in Latin-1 with two class folders (one of them named in Latin-1), each with an
    image named in Latin-1 and five plain ones."""
    root = tmp_path / os.fsdecode(b"d\xe9ta")
    for label, folder in enumerate((b"plain", b"caf\xe9")):
        for i in range(6):
            write_image(root, folder + b"/" + (LATIN1 if i == 0 else b"%d.png" % i), seed=10 * label + i)
    return root


def test_names_are_shown_escaped_and_recorded_losslessly():
    name = os.fsdecode(b"/data/" + LATIN1)
    assert display_name(name) == "/data/" + SHOWN and display_name("/data/café.png") == "/data/café.png"
    assert display_name("x\ud800") == "x\\ud800"  # a surrogate no file name decodes to
    record = path_record(name)
    assert record == {"path": "/data/" + SHOWN, "path_hex": (b"/data/" + LATIN1).hex()}
    assert recorded_path(json.loads(json.dumps(record, ensure_ascii=False))) == name
    assert path_record("/data/café.png") == {"path": "/data/café.png"}  # valid names as they were
    assert text_bytes(name) == b"/data/" + LATIN1 and text_bytes("café") == "café".encode()
    assert path_keys([name, os.fsdecode(b"/data/b.png")]) == [SHOWN, "b.png"]


def test_the_main_command_line(latin1_classes, tmp_path, capsys):
    from moonvit.__main__ import main

    args = ["--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--images", str(latin1_classes / "plain")]
    main([*args, "--out", str(tmp_path / "out"), "--save-images", str(tmp_path / "saved")])
    printed = capsys.readouterr().out
    assert f"\n{SHOWN} " in printed and "6 items" in printed
    assert SHOWN in load_file(tmp_path / "out" / "merged.safetensors")  # a key safetensors takes
    summary = json.loads((tmp_path / "out" / "summary.json").read_text(encoding="utf-8"))
    entry = next(entry for entry in summary["images"] if entry["image"] == SHOWN)
    assert Path(recorded_path(entry)).read_bytes() == (latin1_classes / os.fsdecode(b"plain/" + LATIN1)).read_bytes()
    assert (tmp_path / "saved" / SHOWN).is_file()


def test_the_export(latin1_classes, tmp_path, capsys):
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    summary = run_export("--inputs", latin1_classes, "--checkpoint", checkpoint, "--out", tmp_path / "out")
    assert summary["images"] == 12 and summary["failed"] == 0
    assert "exported 12 images" in capsys.readouterr().out
    lines = [json.loads(line) for line in (tmp_path / "out" / "manifest.jsonl").read_text("utf-8").splitlines()]
    line = next(line for line in lines if line["id"] == f"caf\\xe9/{SHOWN}")
    assert line["path"] == display_name(str(latin1_classes)) + f"/caf\\xe9/{SHOWN}"
    assert os.fsencode(recorded_path(line)) == os.path.join(os.fsencode(latin1_classes), b"caf\xe9/" + LATIN1)
    with open(recorded_path(line), "rb") as file:  # the record leads back to the file
        assert hashlib.sha256(file.read()).hexdigest() == line["sha256"]
    assert all("path_hex" in line for line in lines)  # every path runs through the Latin-1 folder
    assert {"plain/1.png", f"plain/{SHOWN}"} <= {line["id"] for line in lines}  # ids are relative to it


def test_a_latin1_name_and_a_name_spelled_as_its_escape_are_two_inputs(tmp_path):
    """``caf\\xe9.png`` in Latin-1 and a UTF-8 name spelled with the escape's characters are two
    files: two ids (the valid name keeps its own), in a folder and in a list."""
    folder = tmp_path / "images"
    latin1 = write_image(folder, LATIN1, seed=1)
    spelled = write_image(folder, SHOWN.encode(), seed=2)
    assert display_ids([os.fsdecode(LATIN1), SHOWN, SHOWN]) == ["caf\\xe9~2.png", SHOWN, SHOWN]
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"images/" + LATIN1 + b"\nimages/" + SHOWN.encode() + b"\n")
    for inputs, prefix in ((folder, ""), (listing, "images/")):
        out = tmp_path / f"out-{inputs.name}"
        summary = run_export("--inputs", inputs, "--checkpoint", checkpoint, "--out", out)
        assert summary["images"] == 2 and summary["failed"] == 0
        lines = {json.loads(line)["id"]: json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()}
        assert set(lines) == {prefix + SHOWN, prefix + "caf\\xe9~2.png"}
        assert recorded_path(lines[prefix + SHOWN]) == spelled
        assert recorded_path(lines[prefix + "caf\\xe9~2.png"]) == latin1


def test_the_linear_probe(latin1_classes, tmp_path, capsys):
    from moonvit_eval.linear_probe import main

    args = ["--preset", "tiny", "--random-init", "--dataset", f"imagefolder:{latin1_classes}", "--short-side", "28"]
    args += ["--no-baseline", "--min-steps", "5", "--lrs", "0.01", "--weight-decays", "0", "--logreg-Cs", "0.1"]
    main([*args, "--threads", "1", "--out", str(tmp_path / "run")])
    assert "| mean | adamw |" in capsys.readouterr().out
    saved = json.loads((tmp_path / "run" / "results.json").read_text(encoding="utf-8"))
    assert sorted(saved["dataset"]["classes"]) == ["caf\\xe9", "plain"]


def test_the_trainer_with_a_bad_image_left_out(latin1_classes, tmp_path, capsys):
    from moonvit_train.loop import main

    (latin1_classes / os.fsdecode(b"plain/bad\xe9.png")).write_bytes(b"")  # unreadable, and named in Latin-1
    args = ["--objective", "supervised", "--preset", "tiny", "--dataset", f"imagefolder:{latin1_classes}"]
    args += ["--threads", "1", "--no-progress", "--resolution", "28", "--smoke", "--steps", "2", "--evals", "0"]
    previous = torch.get_num_threads()
    try:
        with pytest.warns(UserWarning, match=r"left out 1 unreadable images \(the first: .*plain/bad\\xe9\.png: "):
            results = main([*args, "--skip-bad-images", "--out", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(previous)
    (skipped,) = results["skipped_images"]
    assert skipped["path"].endswith("plain/bad\\xe9.png") and recorded_path(skipped).endswith("bad\udce9.png")
    saved = json.loads((tmp_path / "run" / "results.json").read_text(encoding="utf-8"))
    assert saved["skipped_images"] == [skipped]
    assert (tmp_path / "run" / "curves.png").is_file()
    capsys.readouterr()
