"""Unique, readable names for inputs: output keys and file names that never collide."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Sequence
from pathlib import PurePosixPath

__all__ = ["path_keys", "unique_names"]


def path_keys(paths: Sequence[str | os.PathLike]) -> list[str]:
    """One key per path, all different: the path relative to the folder the paths share.

    ``a/x.png`` and ``b/x.png`` stay apart as ``a/x.png`` and ``b/x.png``; files of one folder
    keep their bare names; the same file given twice becomes ``x.png`` and ``x~2.png``.
    """
    if not paths:
        return []
    absolute = [os.path.abspath(path) for path in paths]
    common = os.path.commonpath([os.path.dirname(path) for path in absolute])
    return unique_names([PurePosixPath(*os.path.relpath(path, common).split(os.sep)).as_posix() for path in absolute])


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
