"""moonvit.environment: the commands wait passively on a busy machine; the library sets nothing."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moonvit.environment import busy_cores, command_environment, started_as_command

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("moonvit", "moonvit_projector.export", "moonvit_eval.linear_probe", "train", "moonvit.onnx", "moonvit.gguf")


def test_which_command_lines_are_the_package_s_commands():
    python = sys.executable
    assert started_as_command([python, "-m", "moonvit_projector.export", "--inputs", "x"])
    assert started_as_command([python, "-X", "importtime", "-m", "moonvit_train", "--smoke"])
    assert started_as_command([python, "/usr/local/bin/moonvit", "--help"])
    assert not started_as_command([python, "-m", "pytest", "tests"])
    assert not started_as_command([python, "script.py", "-m", "moonvit_train"])  # -m after the script is its own
    assert not started_as_command([python, "-c", "import moonvit"])
    assert not started_as_command([python])


def test_a_busy_machine_waits_passively_a_quiet_one_keeps_openmp_s_default():
    assert command_environment({}, busy=1.4) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert command_environment({}, busy=0.1) == {} and command_environment({}, busy=None) == {}
    assert command_environment({"OMP_WAIT_POLICY": "ACTIVE"}, busy=2.0) == {}  # the user's choice


def _burn(stop: float) -> None:
    while time.time() < stop:
        pass


def test_busy_cores_sees_another_process_s_work():
    cpus = sorted(os.sched_getaffinity(0))
    context = multiprocessing.get_context("spawn")
    burner = context.Process(target=_burn, args=(time.time() + 120,), daemon=True)
    burner.start()
    try:
        deadline = time.time() + 60
        busy = 0.0
        while busy < 0.7 and time.time() < deadline:  # the burner's interpreter starting, then spinning
            busy = busy_cores(0.3) or 0.0
        assert 0.7 <= busy <= len(cpus) + 0.01
    finally:
        burner.kill()


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_sets_it_before_torch_loads(command):
    """OpenMP reads the variable when torch's library loads: the environment module must come first."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", command, "--help"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    imported = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert imported.index("moonvit.environment") < imported.index("torch")


def test_a_program_importing_the_library_keeps_its_environment():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import os, moonvit; print(os.environ.get('OMP_WAIT_POLICY'))"  # even on a busy machine
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "None", done.stderr[-2000:]
