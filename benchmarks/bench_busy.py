"""The commands on a shared machine: thread count and OpenMP wait policy, quiet and with every core busy.

Each workload runs in a fresh process (OpenMP reads its wait policy when torch loads), once per
setting, first on a quiet machine and then beside one busy-looping process per core (what other
users' jobs look like to us). A setting is how a command can start:

- ``2 threads, spin``: torch's default on 2 cores, OpenMP's default wait (its threads spin at
  every barrier before they sleep);
- ``2 threads, passive``: the same with ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps);
- ``1 thread``: no OpenMP team at all;
- ``commands' default``: how the package's commands start: torch's thread count, the wait
  policy ``moonvit.environment.command_environment`` chooses by how busy the CPUs are (passive
  on a busy machine, OpenMP's default on a quiet one).

Workloads, each a few seconds quiet: ``heads``, the linear probe's AdamW heads (many small
matmuls: one OpenMP barrier after another) and ``forward``, encoder forwards of a 448x448 image
(large GEMMs).

    python benchmarks/bench_busy.py --out benchmarks/results/bench_busy.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from common import host_line, write_report

REPO = Path(__file__).resolve().parents[1]

WORKLOADS = {
    "heads": """
import torch
from moonvit_eval.probe import ProbeConfig, run_probe
g = torch.Generator().manual_seed(0)
x, y = torch.randn(3000, 256, generator=g), torch.randint(0, 10, (3000,), generator=g)
config = ProbeConfig(learning_rates=(1e-3, 1e-2), weight_decays=(0.0,), epochs=1, min_steps=1500, batch_size=256)
run_probe(x, y, x[:500], 10, config)
""",
    "forward": """
import torch
from moonvit import MoonViT
model = MoonViT.from_preset("small").eval()
pixels, grid = torch.randn(32 * 32, 3, 14, 14), torch.tensor([[1, 32, 32]])
with torch.no_grad():
    for _ in range(3):
        model(pixels, grid)
""",
}

SETTINGS = {
    "2 threads, spin": ({"OMP_WAIT_POLICY": None}, "torch.set_num_threads(2)"),
    "2 threads, passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, "torch.set_num_threads(2)"),
    "1 thread": ({"OMP_WAIT_POLICY": None}, "torch.set_num_threads(1)"),
    "commands' default": (
        "command",
        "import os; print('threads', torch.get_num_threads(), os.environ.get('OMP_WAIT_POLICY', 'spin'), flush=True)",
    ),
}


def burn(stop: float) -> None:
    """Busy-loop until ``time.time()`` passes ``stop``: another user's job."""
    while time.time() < stop:
        pass


def run(workload: str, setting: str) -> tuple[float, str]:
    """Seconds of ``workload`` under ``setting`` in a fresh process (its import excluded), and what it said."""
    env_change, prelude = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if env_change == "command":
        from moonvit.environment import busy_cores, command_environment

        env.update(command_environment(env, busy_cores()))
    else:
        env.update({k: v for k, v in env_change.items() if v is not None})
    code = (
        "import time, torch\n"
        + prelude
        + "\nstart = time.perf_counter()\n"
        + WORKLOADS[workload]
        + "\nprint('seconds', time.perf_counter() - start)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=True
    )
    said = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return float(said["seconds"]), said.get("threads", "")


def measure(workloads: Sequence[str], busy: bool) -> list[str]:
    cores = len(os.sched_getaffinity(0))
    burners = []
    if busy:
        stop = time.time() + 3600
        burners = [multiprocessing.Process(target=burn, args=(stop,), daemon=True) for _ in range(cores)]
        for burner in burners:
            burner.start()
        time.sleep(65)  # the load average the default reads covers a minute
    rows = []
    try:
        for workload in workloads:
            times = {setting: run(workload, setting) for setting in SETTINGS}
            best = min(seconds for seconds, _ in times.values())
            for setting, (seconds, threads) in times.items():
                note = f" ({threads.replace(' ', ' threads, ').lower()})" if threads else ""
                machine = "busy" if busy else "quiet"
                rows.append(f"| {machine} | {workload} | {setting}{note} | {seconds:.2f} | {seconds / best:.2f} |")
    finally:
        for burner in burners:
            burner.terminate()
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    parser.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    args = parser.parse_args(argv)
    lines = [
        f"Host: {host_line()}, {len(os.sched_getaffinity(0))} cores for this process.",
        "",
        "| machine | workload | setting | seconds | x best |",
        "|---|---|---|---:|---:|",
    ]
    for busy in (False, True):
        rows = measure(args.workloads, busy)
        lines += rows
        print("\n".join(rows), flush=True)
    print("\n".join(lines[:1]))
    write_report(args.out, "bench_busy.py", argv, lines)


if __name__ == "__main__":
    main()
