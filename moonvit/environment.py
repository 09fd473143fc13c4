"""What the package's commands set in their process environment before torch loads.

OpenMP reads its wait policy once, when torch's library loads. Its default lets a thread that
waits at a barrier spin for a while before it sleeps. On a quiet machine that saves a wake-up
between one small op and the next (the probe's AdamW heads run 1.8x slower with passive waiting);
on cores other jobs use, the spinning threads burn the time slices the work needs (the same heads
ran 5x slower spinning than waiting passively beside a busy loop per core; ``python
benchmarks/bench_busy.py`` measures both). So a command of this package (``python -m moonvit``,
``python -m moonvit_projector.export``, ``python -m moonvit_eval.linear_probe``,
``python -m moonvit_train``, ... and the
``moonvit`` script) looks, before torch loads, at how busy its CPUs are over a moment
(``/proc/stat``): where other processes keep half a core or more of them busy, it starts with
``OMP_WAIT_POLICY=PASSIVE``. A variable the user set is kept, and a
program that imports the library keeps its own environment: nothing is read or set there.

This module imports nothing heavy: ``moonvit/__init__.py`` runs it before anything loads torch.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence

__all__ = [
    "BUSY_CORES",
    "COMMAND_PACKAGES",
    "busy_cores",
    "command_environment",
    "prepare_command_environment",
    "started_as_command",
]

COMMAND_PACKAGES = ("moonvit", "moonvit_projector", "moonvit_eval", "moonvit_train", "projector", "eval", "train")
"""The top-level packages whose modules are this package's commands (``python -m NAME``)."""

BUSY_CORES = 0.5
"""Cores' worth of other processes' work on this process's CPUs from which a command waits passively."""


def busy_cores(seconds: float = 0.2) -> float | None:
    """How many of this process's CPUs other processes kept busy over ``seconds``, from the kernel's
    per-CPU counters (this process sleeps meanwhile); None where there are none (not Linux)."""
    cpus = {f"cpu{n}" for n in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None

    def counters() -> tuple[int, int] | None:
        busy = total = 0
        try:
            with open("/proc/stat") as stat:
                for line in stat:
                    name, *values = line.split()
                    if not name.startswith("cpu") or name == "cpu" or (cpus is not None and name not in cpus):
                        continue
                    ticks = [int(v) for v in values[:8]]  # user nice system idle iowait irq softirq steal
                    total += sum(ticks)
                    busy += sum(ticks) - ticks[3] - ticks[4]
        except (OSError, ValueError, IndexError):
            return None
        return (busy, total) if total else None

    before = counters()
    time.sleep(seconds)
    after = counters()
    if before is None or after is None or after[1] <= before[1]:
        return None
    cores = len(cpus) if cpus is not None else os.cpu_count() or 1
    return cores * (after[0] - before[0]) / (after[1] - before[1])


def command_environment(env: Mapping[str, str], busy: float | None) -> dict[str, str]:
    """The variables a command sets where ``env`` (the user's) does not, given ``busy`` cores of its
    CPUs in other processes' use (:func:`busy_cores`): a passive OpenMP wait policy on a busy machine."""
    if "OMP_WAIT_POLICY" in env or busy is None or busy < BUSY_CORES:
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


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
    if "torch" in sys.modules or "OMP_WAIT_POLICY" in os.environ or not started_as_command():
        return
    os.environ.update(command_environment(os.environ, busy_cores()))


prepare_command_environment()
