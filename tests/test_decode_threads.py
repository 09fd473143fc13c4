"""Decoding in background threads (``--workers``) leaves the process's warning filters alone:
``warnings.catch_warnings`` swaps one list for the whole process, which is not safe from threads."""

from __future__ import annotations

import threading
import warnings

import pytest
from PIL import Image

from moonvit.cli import one_line_warnings
from moonvit.media.image import ImageTooLargeError, load_image
from moonvit.prefetch import prefetch


def test_decode_threads_never_enter_catch_warnings(tmp_path, monkeypatch):
    paths = []
    for i in range(6):
        paths.append(tmp_path / f"{i}.png")
        Image.new("RGB", (8 + i, 8)).save(paths[-1])
    entered: list[str] = []
    original = warnings.catch_warnings

    class Spy(original):  # type: ignore[misc, valid-type]
        def __enter__(self):
            entered.append(threading.current_thread().name)
            return super().__enter__()

    monkeypatch.setattr(warnings, "catch_warnings", Spy)
    sizes = [image.size for _, image in prefetch(paths, load_image, workers=3)]
    assert sizes == [(8 + i, 8) for i in range(6)]
    assert entered == []  # no worker swapped the filters
    load_image(paths[0])
    assert entered == ["MainThread"]  # the main thread still turns the bomb warning into the error


def test_a_bomb_in_a_decode_thread_is_one_error_under_a_command_line(tmp_path, monkeypatch):
    path = tmp_path / "wide.png"
    Image.new("RGB", (15, 10)).save(path)  # 150 px: Pillow warns between 1x and 2x its limit
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as printed:
        warnings.simplefilter("always")  # any warning would be recorded, repeats included
        with one_line_warnings(), pytest.raises(ImageTooLargeError, match=r"wide\.png.*MAX_IMAGE_PIXELS"):
            list(prefetch([path, path], load_image, workers=2))
    assert [str(w.message) for w in printed] == []  # the error alone, no warning printed on top
    assert warnings.filters == before
