"""The "same run?" check: which settings differ between a run's recorded description and this command's.

A program records what defines its output (``run.json`` of ``python -m projector.export``, the
trainer's resume state) and, when started again into the same folder, compares the record with
what this command would write. The comparison is by dotted key (``arguments.dtype``) over JSON-like
values, so that the message names each differing setting with both values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ABSENT", "Difference", "differences", "describe_differences"]

ABSENT = "(absent)"
"""The value shown for a key that one side lacks."""

Difference = tuple[str, Any, Any]
"""(dotted key, value before, value after)."""


def differences(before: Any, after: Any, key: str = "", *, absent: Any = ABSENT) -> list[Difference]:
    """(dotted key, value before, value after) for every leaf that differs between two JSON values.

    Dicts are compared key by key (sorted), recursively; any other value as a whole. A key that one
    side lacks stands for ``absent`` there (so with ``absent=None`` a missing key equals a None).
    """
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        return [
            change
            for name in sorted(before.keys() | after.keys())
            for change in differences(
                before.get(name, absent), after.get(name, absent), f"{key}.{name}" if key else name, absent=absent
            )
        ]
    return [] if before == after else [(key, before, after)]


def describe_differences(
    changes: Sequence[Difference], template: str = "{key}: {before!r} there, {after!r} now", separator: str = "; "
) -> str:
    """Each difference through ``template`` (fields ``key``, ``before``, ``after``), joined by ``separator``."""
    return separator.join(template.format(key=key, before=before, after=after) for key, before, after in changes)
