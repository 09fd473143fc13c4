"""moonvit.environment: the commands start with a passive OpenMP wait policy; the library sets nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moonvit.environment import command_environment, started_as_command

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("moonvit", "projector.export", "eval.linear_probe", "train", "moonvit.onnx", "moonvit.gguf")


def test_which_command_lines_are_the_package_s_commands():
    python = sys.executable
    assert started_as_command([python, "-m", "projector.export", "--inputs", "x"])
    assert started_as_command([python, "-X", "importtime", "-m", "train", "--smoke"])
    assert started_as_command([python, "/usr/local/bin/moonvit", "--help"])
    assert not started_as_command([python, "-m", "pytest", "tests"])
    assert not started_as_command([python, "script.py", "-m", "train"])  # -m after the script is its own
    assert not started_as_command([python, "-c", "import moonvit"])
    assert not started_as_command([python])


def test_the_user_s_wait_policy_is_kept():
    assert command_environment({}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert command_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}


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
    code = "import os, moonvit; print(os.environ.get('OMP_WAIT_POLICY'))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "None", done.stderr[-2000:]
