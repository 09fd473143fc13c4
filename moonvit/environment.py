"""What the package's commands set in their process environment before torch loads.

OpenMP reads its wait policy once, when torch's library loads. Its default lets a thread that
waits at a barrier spin for a while before it sleeps: on a quiet machine that saves a wake-up,
on a machine whose cores other jobs use it burns their time slices, and a command with 2 threads
on 2 busy cores ran many times slower than with 1 (``benchmarks/bench_busy.py`` measures it). So
a command of this package (``python -m moonvit``, ``python -m projector.export``, ``python -m
eval.linear_probe``, ``python -m train``, ... and the ``moonvit`` script) starts with
``OMP_WAIT_POLICY=PASSIVE`` unless the user set the variable. A program that imports the library
keeps its own environment: nothing is set there.

This module imports nothing heavy: ``moonvit/__init__.py`` runs it before anything loads torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["COMMAND_PACKAGES", "command_environment", "prepare_command_environment", "started_as_command"]

COMMAND_PACKAGES = ("moonvit", "projector", "eval", "train")
"""The top-level packages whose modules are this package's commands (``python -m NAME``)."""


def command_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The variables a command sets where ``env`` (the user's) does not: the OpenMP wait policy."""
    return {} if "OMP_WAIT_POLICY" in env else {"OMP_WAIT_POLICY": "PASSIVE"}


def started_as_command(argv: Sequence[str] | None = None) -> bool:
    """Whether the interpreter's command line (``sys.orig_argv``) runs one of the package's
    commands: ``python [options] -m PACKAGE[.module] ...`` or the ``moonvit`` script."""
    args = list(getattr(sys, "orig_argv", []) if argv is None else argv)[1:]
    while args:
        arg = args.pop(0)
        if arg == "-m":
            return bool(args) and args[0].split(".")[0] in COMMAND_PACKAGES
        if arg == "-c" or arg == "-":
            return False
        if arg in ("-X", "-W", "--check-hash-based-pycs"):  # the interpreter's options that take a value
            args = args[1:]
        elif not arg.startswith("-"):  # the script: what follows is its own
            return os.path.basename(arg) == "moonvit"
    return False


def prepare_command_environment() -> None:
    """Set :func:`command_environment` in ``os.environ`` when this process is one of the commands
    and torch has not loaded yet (later, OpenMP would not read it)."""
    if "torch" not in sys.modules and started_as_command():
        os.environ.update(command_environment(os.environ))


prepare_command_environment()
