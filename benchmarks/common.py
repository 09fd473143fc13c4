"""What the benchmarks share: the standard packs, FLOP counts, timers, matmul peaks and memory peaks.

Benchmarks are programs, not part of the library; they import this module as
``common`` (``python benchmarks/<name>.py`` puts this folder on the path).
"""

from __future__ import annotations

import argparse
import ctypes
import platform
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from moonvit import MoonViTConfig
from moonvit.cli import dtype_name
from moonvit.model.attention import attention_names
from moonvit.perf import config_flops, matmul_peak, seconds

__all__ = [
    "PACKS",
    "as_thw",
    "bf16_or_fp32",
    "host_line",
    "matmul_peak",
    "mib",
    "model_flops",
    "peak_extra_bytes",
    "relative_error",
    "seconds",
    "write_report",
]

PACKS: dict[str, list[tuple[int, ...]]] = {
    "448x448 (32x32)": [(32, 32)],
    "mixed 4": [(32, 32), (24, 40), (16, 16), (48, 36)],
    "32 small (16x16)": [(16, 16)] * 32,
    "896x896 (64x64)": [(64, 64)],
    "video 4 x 4-frame 448x448": [(4, 32, 32)] * 4,
    "video 4-frame 1080p": [(4, 48, 86)],
}
"""The encoder benchmark's packs: (rows, cols) images and (frames, rows, cols) clips. The video
packs are Kimi-K2.5 chunks: four 4-frame 448x448 clips (4096-patch segments), and one 4-frame
1080p chunk (1920x1080 at 4096 patches per frame: one 16,512-patch attention segment)."""


def as_thw(grids: Sequence[Sequence[int]]) -> torch.Tensor:
    """(N, 3) int64 (t, h, w) rows of (h, w) or (t, h, w) grids."""
    return torch.tensor([(1, *g) if len(g) == 2 else tuple(g) for g in grids], dtype=torch.int64)


def model_flops(grids: Sequence[Sequence[int]], config: MoonViTConfig, depth: int | None = None) -> float:
    """Matmul FLOPs of one forward of a ``config`` tower over (h, w) or (t, h, w) grids
    (see :func:`moonvit.perf.config_flops`), at ``depth`` blocks (default: the config's)."""
    return config_flops([int(torch.tensor(g).prod()) for g in grids], config, depth)


def peak_extra_bytes(fn: Callable[[], object]) -> int | None:
    """Resident memory that one call of ``fn`` adds at its peak, or None where it cannot be read.

    Linux: free memory goes back to the system, the high-water mark is reset,
    and the mark after the call is compared with the resident size before it.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status_bytes("VmRSS")
        fn()
        return _proc_status_bytes("VmHWM") - before
    except (OSError, AttributeError, ValueError):
        return None


def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M)
    if match is None:
        raise ValueError(f"{key} not in /proc/self/status")
    return int(match.group(1)) * 1024


def bf16_or_fp32(text: str) -> str:
    """An argparse type: a dtype spelling (:func:`moonvit.cli.dtype_name`) that names bf16 or fp32,
    the two dtypes the CPU benchmarks time."""
    name = dtype_name(text)
    if name not in ("bf16", "fp32"):
        raise argparse.ArgumentTypeError(f"expected bf16 or fp32, got {text}")
    return name


def add_attn_rows_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--attn``: our attention backends, each timed as a row of its own, interleaved (``auto`` or a
    named backend), ``default`` when none is given."""
    backends = [name for name in attention_names() if name != "auto"]
    parser.add_argument(
        "--attn", nargs="+", choices=["auto", *backends], default=[default], metavar="ATTN",
        help=f"our attention backends, each a row, timed interleaved ({', '.join(['auto', *backends])}; "
        f"default: {default})",
    )  # fmt: skip


def interleaved_times(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each run's ``repeats`` calls under inference mode, one warm-up call each first, the
    runs alternating (so that a noisy neighbour slows every contender alike)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    with torch.inference_mode():
        for run in runs.values():
            run()
        for _ in range(repeats):
            for name, run in runs.items():
                times[name].append(seconds(run))
    return times


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference of two tensors, in float64."""
    return float((a.double() - b.double()).abs().max())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64 on the CPU (``b`` the reference)."""
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f}"


def host_line() -> str:
    """The CPU model and its matrix / vector extensions, from /proc/cpuinfo where there is one."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        found = re.search(r"^model name\s*:\s*(.+)$", info, re.M)
        model = found.group(1).strip() if found else model
        found = re.search(r"^flags\s*:\s*(.+)$", info, re.M)
        flags = set(found.group(1).split()) if found else set()
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")
    present = [flag for flag in wanted if flag in flags]
    return f"{model}; {' '.join(present) or 'no AVX-512 / AMX flags'}"


def write_report(out: Path | None, script: str, argv: Sequence[str] | None, lines: Sequence[str]) -> None:
    """Write ``lines`` (markdown) to ``out``, under the command line that produced them (``argv``:
    the arguments given to the benchmark's ``main``, or None for the process's own); nothing
    when ``out`` is None."""
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])
    out.write_text(f"```\n{command}\n```\n\n" + "\n".join(lines) + "\n")
