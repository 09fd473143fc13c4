"""The "same run?" check: which settings differ between a run's recorded description and this command's.

A program records what defines its output (``run.json`` of ``python -m moonvit_projector.export``, the
trainer's resume state) and, when started again into the same folder, compares the record with
what this command would write. The comparison is by dotted key (``arguments.dtype``) over JSON-like
values, so that the message names each differing setting with both values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import PIL
import torch

from .model.linear import cpu_has_bf16_arithmetic, cpu_units

__all__ = ["ABSENT", "Difference", "compute_facts", "differences", "describe_differences", "host_facts"]

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


def host_facts(device: torch.device) -> dict[str, Any]:
    """What a forward's and a decode's bytes depend on in the host itself, as this process sees it:
    the CPU's bf16 arithmetic and matrix units (the bf16 linears widen to float32 without the
    former, and oneDNN picks its bf16 kernels by both; None off the CPU) and Pillow, which decodes
    and resizes."""
    on_cpu = device.type == "cpu"
    return {
        "bf16_arithmetic": cpu_has_bf16_arithmetic() if on_cpu else None,
        "amx": cpu_units()[0] if on_cpu else None,
        "pillow": PIL.__version__,
    }


def compute_facts(device: torch.device) -> dict[str, Any]:
    """What a run's numbers depend on beyond its arguments and weights: the threads per process in
    effect, torch's version, the device type, on the CPU the kernel level torch dispatches to, and
    the :func:`host_facts`. JSON types only, so it compares equal to a record read back."""
    return {
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device_type": device.type,
        "cpu_capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        "host": host_facts(device),
    }
