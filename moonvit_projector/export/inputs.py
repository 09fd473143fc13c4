"""What ``--inputs`` names: the images (and videos) of the collection, their ids, in a fixed order."""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moonvit import IMAGE_EXTENSIONS
from moonvit.files import files_below, skipped_line
from moonvit.media.video import VIDEO_EXTENSIONS
from moonvit.names import display_ids, recorded_path, text_bytes

from .settings import ExportError

__all__ = ["InputImage", "Inputs", "listing_sha256", "read_inputs", "scan_inputs"]


@dataclass(frozen=True)
class InputImage:
    """One image of the collection: its id (unique) and the file path to read."""

    id: str
    path: str


@dataclass(frozen=True)
class Inputs:
    """What ``--inputs`` names: the images, and the files of a folder skipped for their extension
    (lower-cased extension, "" for none -> count)."""

    images: list[InputImage]
    skipped: dict[str, int]

    def skipped_line(self) -> str:
        """``3 files skipped for their extension (.txt 2, .json 1)``, or "" when none were."""
        return skipped_line(self.skipped)


def scan_inputs(path: Path) -> Inputs:
    """The images named by ``--inputs``, in a deterministic order.

    - a folder: every file below it whose extension is in ``moonvit.IMAGE_EXTENSIONS`` (or
      ``VIDEO_EXTENSIONS``), sorted by relative path (the id); other files are counted by extension;
    - one image or video file (by its extension): that input alone, its file name the id;
    - a ``.jsonl`` file: one ``{"id": ..., "path": ...}`` object per line;
    - any other file: a text list, one path per line (the id is the line as written).

    Paths are made absolute; relative ones in a list are resolved against the list's folder.
    Blank lines are skipped.

    Raises:
        ExportError: the path does not exist, it names no image (the skipped files counted), a
            JSONL line lacks ``id`` / ``path``, a text list holds binary data, or ids repeat.
    """
    path = path.absolute()
    skipped: dict[str, int] = {}
    if path.is_dir():
        images, skipped = _folder_inputs(path)
    elif path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS:
        images = [InputImage(display_ids([path.name])[0], str(path))]
    elif path.is_file():
        images = _jsonl_inputs(path) if path.suffix.lower() == ".jsonl" else _text_inputs(path)
    else:
        raise ExportError(f"--inputs {path} is neither a folder nor a file")
    inputs = Inputs(images, skipped)
    if not images:
        extensions = " ".join(sorted(IMAGE_EXTENSIONS))
        detail = f": {inputs.skipped_line()}; image extensions are {extensions}" if skipped else ""
        raise ExportError(f"--inputs {path} names no images{detail}")
    _check_unique_ids(images, path)
    return inputs


def read_inputs(path: Path) -> list[InputImage]:
    """The images (and videos) of :func:`scan_inputs`."""
    return scan_inputs(path).images


def _folder_inputs(folder: Path) -> tuple[list[InputImage], dict[str, int]]:
    files, skipped = files_below(folder, IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    # the id is text of JSON and of prompts: a name that is not UTF-8 is shown escaped, apart from
    # any other file's (moonvit.names.display_ids)
    ids = display_ids([p.relative_to(folder).as_posix() for p in files])
    return [InputImage(name, str(p)) for name, p in zip(ids, files)], skipped


def _text_inputs(file: Path) -> list[InputImage]:
    # a list of file names: bytes that are not UTF-8 are kept as Python keeps them in names
    content = file.read_bytes()
    if b"\0" in content:  # no file name holds a NUL byte: an image or other binary file, not a list
        extensions = " ".join(sorted(IMAGE_EXTENSIONS | VIDEO_EXTENSIONS))
        raise ExportError(
            f"--inputs {file} is not a text list of paths (it holds binary data); --inputs takes a folder, "
            f"an image or video file ({extensions}), a text file of paths or a .jsonl"
        )
    text = content.decode("utf-8", errors="surrogateescape")
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return [InputImage(name, str(file.parent / line)) for name, line in zip(display_ids(lines), lines)]


def _jsonl_inputs(file: Path) -> list[InputImage]:
    images = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            images.append(InputImage(str(record["id"]), str(file.parent / recorded_path(record))))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ExportError(f"{file}:{number}: expected a JSON object with 'id' and 'path' ({error!r})") from error
    return images


def _check_unique_ids(images: Sequence[InputImage], source: Path) -> None:
    counts = collections.Counter(image.id for image in images)
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise ExportError(f"--inputs {source} repeats the ids {repeated[:5]}{' ...' if len(repeated) > 5 else ''}")


def listing_sha256(images: Sequence[InputImage]) -> str:
    """The hash of the input listing (each ``id<TAB>path``, in order) that ``run.json`` records."""
    return hashlib.sha256(text_bytes("\n".join(f"{image.id}\t{image.path}" for image in images))).hexdigest()
