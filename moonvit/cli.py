"""One vocabulary for the package's command lines (``python -m moonvit``, ``projector.export``,
``eval.linear_probe``, the trainer and the benchmarks).

Every program takes the same flags for the same things, with the same spellings,
checks and defaults: ``--dtype`` (``bf16`` / ``fp16`` / ``fp32`` / ``fp64``, the
long names ``bfloat16``, ``float32``, ... accepted and printed short),
``--device`` (``cpu``, ``cuda``, ``cuda:N``, refused at parse time where torch
has no CUDA), ``--threads`` and ``--max-patches-per-pack``. Argument types raise
``argparse.ArgumentTypeError``, so a bad value ends in one usage line and exit
status 2 before any work starts.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from .media.packing import DEFAULT_MAX_PATCHES_PER_PACK

__all__ = [
    "DTYPES",
    "add_budget_argument",
    "add_device_argument",
    "add_dtype_argument",
    "add_threads_argument",
    "apply_threads",
    "device_name",
    "dtype_name",
    "fraction",
    "non_negative_int",
    "output_dir",
    "positive_int",
    "torch_dtype",
]

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
_DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "float64": "fp64",
    "double": "fp64",
}


def dtype_name(text: str) -> str:
    """The canonical short name (``bf16``, ``fp16``, ``fp32``, ``fp64``) of a dtype spelling."""
    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"unknown dtype {text!r}; choose from {', '.join(DTYPES)} (or bfloat16, float16, float32, float64)"
        )
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of any accepted spelling."""
    return DTYPES[dtype_name(name)]


def _int_at_least(text: str, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _int_at_least(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def fraction(text: str) -> float:
    """A number strictly between 0 and 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text}")
    return value


def device_name(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``, refused when torch cannot reach that device here."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; expected cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"--device {text}: this torch build has no usable CUDA device")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"unsupported device {text!r}; expected cpu, cuda or cuda:N")
    return text


def output_dir(text: str) -> Path:
    """A folder to write into: absent (it will be created) or an existing folder, not a file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder")
    return path


def add_dtype_argument(
    parser: argparse.ArgumentParser,
    default: str | None,
    help: str,
    choices: tuple[str, ...] = ("bf16", "fp16", "fp32"),
    flag: str = "--dtype",
) -> None:
    """``--dtype``: any accepted spelling in, the short name out (checked against ``choices``)."""

    def parse(text: str) -> str:
        name = dtype_name(text)
        if name not in choices:
            raise argparse.ArgumentTypeError(f"{flag} {text}: choose from {', '.join(choices)}")
        return name

    parse.__name__ = "dtype"
    shown = f" (default: {default})" if default is not None else ""
    parser.add_argument(flag, type=parse, default=default, metavar="{" + ",".join(choices) + "}", help=help + shown)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device_argument(parser: argparse.ArgumentParser, help: str = "cpu, cuda or cuda:N") -> None:
    """``--device``, defaulting to cuda where there is one."""
    parser.add_argument(
        "--device", type=device_name, default=default_device(), help=f"{help} (default: {default_device()})"
    )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads for this process (default: torch's own choice)."""
    parser.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help=f"torch CPU threads (default: torch's choice, {torch.get_num_threads()} here)",
    )


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU thread count when given; return the count in effect."""
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def add_budget_argument(parser: argparse.ArgumentParser, default: int = DEFAULT_MAX_PATCHES_PER_PACK) -> None:
    """``--max-patches-per-pack``: the patch budget of one encoder forward."""
    parser.add_argument(
        "--max-patches-per-pack",
        type=positive_int,
        default=default,
        help=f"patch budget of one encoder forward; larger images are scaled down to fit (default: {default})",
    )
