"""The programs' old package names (``train``, ``eval``, ``projector``) keep working for a release, as
the new packages themselves (moonvit.renamed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RENAMED = {"train": "moonvit_train", "eval": "moonvit_eval", "projector": "moonvit_projector"}


def python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_old_imports_are_the_new_modules_with_one_warning():
    code = """
import pickle, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import train.config, eval.probe, projector.export.cli
    from projector.export import ExportRun
    from train.plan import Resolution
import moonvit_train.config, moonvit_eval.probe, moonvit_projector.export
assert train.config is moonvit_train.config and eval.probe is moonvit_eval.probe
assert ExportRun is moonvit_projector.export.ExportRun and Resolution.__module__ == "moonvit_train.plan"
import sys
assert sys.modules["train"] is moonvit_train and sys.modules["projector.export.cli"] is moonvit_projector.export.cli
# a pickle made before the rename names the old module: it loads as the new class
old = pickle.dumps(Resolution(56, 56, 4096), protocol=0).replace(b"moonvit_train.plan", b"train.plan")
assert type(pickle.loads(old)) is Resolution
print(sorted(str(w.message).split(" is now")[0] for w in caught if w.category is FutureWarning))
"""
    done = python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[\"the package 'eval'\", \"the package 'projector'\", \"the package 'train'\"]"


@pytest.mark.parametrize("module", ["train", "eval.linear_probe", "projector.export"])
def test_python_m_with_an_old_name_runs_the_new_command(module):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    new = RENAMED[module.split(".")[0]] + module[len(module.split(".")[0]) :]
    assert done.stdout.startswith(f"usage: python -m {new} ")
    assert f"the package '{module.split('.')[0]}' is now '{RENAMED[module.split('.')[0]]}'" in done.stderr
