r"""Unique, readable names for inputs: output keys and file names that never collide, and file names
as text that every output takes.

A file name need not be valid UTF-8 (``caf\xe9.png`` written by a Latin-1 system): Python decodes
its stray bytes to lone surrogates (``'caf\udce9.png'``), which UTF-8 output (a terminal, a JSON file
read by other tools, a safetensors header) refuses. Such a name is

- shown and used as a key in its :func:`display_name` (``caf\xe9.png``, the byte as a ``\xNN``
  escape; every valid name is its own display name);
- recorded losslessly where a record must lead back to the file: :func:`path_record` writes the
  display name under ``path`` and, only for such a name, the name's bytes in hex under
  ``path_hex``; :func:`recorded_path` reads either back;
- hashed through :func:`text_bytes` (the bytes of the name, as valid names always were).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import PurePosixPath

__all__ = ["display_ids", "display_name", "path_keys", "path_record", "recorded_path", "text_bytes", "unique_names"]


def display_name(name: str | os.PathLike[str]) -> str:
    """``name`` as valid UTF-8 text: each byte of a file name that is not UTF-8 (a surrogate from
    Python's decoding) as a ``\\xNN`` escape, any other lone surrogate as ``\\uXXXX``; valid text unchanged."""
    text = os.fspath(name)
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name decodes to: escape it as it is
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def display_ids(names: Sequence[str]) -> list[str]:
    r"""One id per name, as text: its :func:`display_name`, where distinct names never share one.

    A name that is not UTF-8 (``caf\udce9.png``) displays as another, valid name may be spelled
    (``caf\xe9.png`` with a backslash): the valid name keeps its own spelling and the other one
    becomes ``caf\xe9~2.png`` (:func:`unique_names`). The same name given twice keeps one id, for
    the caller to refuse or accept as a repeat.
    """
    distinct = list(dict.fromkeys(names))
    ordered = sorted(distinct, key=lambda name: display_name(name) != name)  # stable: valid names first
    ids = dict(zip(ordered, unique_names([display_name(name) for name in ordered])))
    return [ids[name] for name in names]


def text_bytes(text: str) -> bytes:
    """The UTF-8 bytes of ``text``, a file name's undecodable bytes restored as they were: what to
    hash (the same bytes as ``text.encode()`` wherever that works)."""
    return text.encode("utf-8", "surrogateescape")


def path_record(path: str | os.PathLike[str], key: str = "path") -> dict[str, str]:
    """``{key: display name}``, plus ``{key + "_hex": the name's bytes in hex}`` when the display name
    is not the name itself: a JSON record that leads back to the file (:func:`recorded_path`)."""
    text = os.fspath(path)
    shown = display_name(text)
    return {key: shown} if shown == text else {key: shown, f"{key}_hex": os.fsencode(text).hex()}


def recorded_path(record: dict[str, object], key: str = "path") -> str:
    """The file name a :func:`path_record` record stands for, exactly (from ``key + "_hex"`` when
    there is one)."""
    raw = record.get(f"{key}_hex")
    return os.fsdecode(bytes.fromhex(raw)) if isinstance(raw, str) else str(record[key])


def path_keys(paths: Sequence[str | os.PathLike]) -> list[str]:
    """One key per path, all different: the path relative to the folder the paths share, as its
    :func:`display_name` (a key is text of a safetensors header and of JSON).

    ``a/x.png`` and ``b/x.png`` stay apart as ``a/x.png`` and ``b/x.png``; files of one folder
    keep their bare names; the same file given twice becomes ``x.png`` and ``x~2.png``.
    """
    if not paths:
        return []
    absolute = [os.path.abspath(path) for path in paths]
    common = os.path.commonpath([os.path.dirname(path) for path in absolute])
    relative = [PurePosixPath(*os.path.relpath(path, common).split(os.sep)).as_posix() for path in absolute]
    return unique_names([display_name(name) for name in relative])


def unique_names(names: Sequence[str]) -> list[str]:
    """``names`` in order, each repeat renamed ``stem~k.suffix`` (k = 2, 3, ...) to a name that is
    neither used nor among ``names``; first occurrences are kept as they are."""
    given = Counter(names)
    used: set[str] = set()
    result = []
    for name in names:
        if name in used:  # a repeat: the first stem~k.suffix that is neither used nor given later
            path, k = PurePosixPath(name), 2
            while (name := path.with_name(f"{path.stem}~{k}{path.suffix}").as_posix()) in used or name in given:
                k += 1
        used.add(name)
        result.append(name)
    return result
