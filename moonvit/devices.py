"""Checking that a device can be used here, before any work is done on it.

``torch.device("cuda")`` is accepted on every build; the failure comes later, deep inside
the first copy, as "Torch not compiled with CUDA enabled". :func:`check_device` says it up
front, for the loaders (``from_pretrained``) and the command lines (``--device``) alike.
"""

from __future__ import annotations

import torch

__all__ = ["check_device"]


def check_device(device: torch.device | str) -> torch.device:
    """``device`` as a ``torch.device``, refused where this torch cannot reach it.

    Raises:
        ValueError: an unknown device string, ``cuda`` on a build or machine without a
            usable CUDA device, or ``cuda:N`` past the visible devices.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; expected cpu, cuda or cuda:N") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: this torch build has no usable CUDA device")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    return resolved
