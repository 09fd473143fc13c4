"""scripts/demo.sh: --help, runs one after another with other arguments into the same folder, and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import folder_bytes, interruptible
from PIL import Image

REPO = Path(__file__).resolve().parents[1]


def demo_env(out: Path, probes: bool) -> dict[str, str]:
    """The environment of a demo run into ``out``, without the Fashion-MNIST probe."""
    return {
        **os.environ,
        "MOONVIT_DEMO_OUT": str(out),
        "MOONVIT_DEMO_FASHION_MNIST": "0",
        "MOONVIT_DEMO_PROBES": "1" if probes else "0",
    }


def demo(out: Path, *args: str | Path, probes: bool = False) -> subprocess.CompletedProcess:
    """One demo run into ``out``. The Fashion-MNIST probe (about 80 s) is always left out here (the
    shipped checkpoints' tests cover it); the digits probes (about 25 s each on 2 idle cores) only
    run with ``probes``. The timeout is a hang guard for a loaded 2-core machine, not a speed check."""
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh"), *map(str, args)],
        cwd=REPO,
        env=demo_env(out, probes),
        capture_output=True,
        text=True,
        timeout=1800 if probes else 900,
    )


def test_help_prints_the_arguments_and_runs_nothing(tmp_path):
    for flag in ("--help", "-h"):
        result = demo(tmp_path / "out", "--preset", "tiny", flag)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("usage: bash scripts/demo.sh")
        assert "--checkpoint" in result.stdout and "--max-patches-per-pack" in result.stdout
        assert "moonvit 0.1.0:" not in result.stdout and not (tmp_path / "out").exists()


def test_the_flags_the_demo_sets_are_refused(tmp_path):
    for args in (["--out", "x"], ["--save-images=x"], ["--ou", "x"], ["--save-c", "x"]):
        result = demo(tmp_path / "out", *args)
        assert result.returncode == 2 and "is set by the demo" in result.stderr
        assert not (tmp_path / "out").exists()


def consistent(out: Path, probes: bool = False) -> dict:
    """The folder holds one run: the summary, the saved images, the checkpoint and the export agree
    (and, with ``probes``, the three digits probes ran)."""
    summary = json.loads((out / "summary.json").read_text())
    saved = sorted(entry["saved_as"] for entry in summary["images"])
    assert sorted(p.relative_to(out / "images").as_posix() for p in (out / "images").rglob("*.png")) == saved
    manifest = [json.loads(line) for line in (out / "export" / "manifest.jsonl").read_text().splitlines()]
    assert sorted(line["id"] for line in manifest) == saved
    config = json.loads((out / "checkpoint" / "config.json").read_text())
    width = {"tiny": 64, "small": 384}[summary["source"].split()[1]]
    assert config["hidden_size"] == width
    if probes:
        for name in ("fm-supervised", "fm-mae", "fm-mae-ft"):
            assert json.loads((out / "probe" / f"digits-{name}" / "results.json").read_text())["top1"] > 0.85
    else:
        assert not (out / "probe").exists()
    assert not Path(f"{out}.previous").exists()
    return summary


@pytest.mark.slow
def test_runs_with_other_arguments_each_leave_one_whole_run(tmp_path):
    out = tmp_path / "demo"
    first = demo(out, "--preset", "tiny", "--dtype", "fp32", probes=True)
    assert first.returncode == 0, first.stderr[-3000:]
    assert consistent(out, probes=True)["dtype"] == "fp32"

    for folder, colour in (("a", (200, 30, 30)), ("b", (30, 200, 30))):
        (tmp_path / folder).mkdir()
        Image.new("RGB", (90, 60), colour).save(tmp_path / folder / "photo.png")
    second = demo(
        out, "--preset", "tiny", "--dtype", "bf16", "--images", tmp_path / "a/photo.png", tmp_path / "b/photo.png"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    summary = consistent(out)
    assert summary["dtype"] == "bf16" and [e["image"] for e in summary["images"]] == ["a/photo.png", "b/photo.png"]

    before = folder_bytes(out)
    failed = demo(out, "--preset", "tiny", "--images", tmp_path / "missing.png")
    assert failed.returncode == 2 and "missing.png does not exist" in failed.stderr
    assert "left as the previous run wrote it" in failed.stderr
    assert folder_bytes(out) == before


@pytest.mark.slow
def test_ctrl_c_keeps_the_steps_that_finished_and_puts_the_previous_run_back(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "previous.txt").write_text("the previous run")
    # its own process group, so the Ctrl-C reaches the script and its running step, as from a terminal;
    # the output goes to files (a pipe nobody reads while the demo runs would fill and block it)
    logs = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with logs[0].open("w") as stdout_file, logs[1].open("w") as stderr_file:
        process = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "demo.sh"), "--preset", "tiny"],
            cwd=REPO,
            env=demo_env(out, probes=True),
            stdout=stdout_file,
            stderr=stderr_file,
            start_new_session=True,
            preexec_fn=interruptible,
        )
    try:
        first_probe = out / "probe" / "digits-fm-mae" / "results.json"
        deadline = time.monotonic() + 1200  # a hang guard for a loaded 2-core machine
        while not first_probe.exists():
            assert process.poll() is None, logs[1].read_text()[-3000:]
            assert time.monotonic() < deadline, "the first probe did not finish"
            time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    stdout, stderr = logs[0].read_text(), logs[1].read_text()
    partial = Path(f"{out}.interrupted")
    assert process.returncode == 130, stderr[-3000:]
    assert "demo.sh: interrupted during the digits probe of" in stderr
    assert f"kept in {partial}, and {out} is left as the previous run wrote it" in stderr
    assert [p.name for p in out.iterdir()] == ["previous.txt"] and not Path(f"{out}.previous").exists()
    # the finished steps: the encoding, the export and the first probe, whose figures are printed
    assert (partial / "summary.json").is_file() and (partial / "export" / "manifest.jsonl").is_file()
    assert json.loads((partial / "probe" / "digits-fm-mae" / "results.json").read_text())["top1"] > 0.85
    assert "digits-fm-mae" in stdout.split("linear probes of the shipped checkpoints, test top-1:")[1]

    # the next run replaces the interrupted one's folder too
    again = demo(out, "--preset", "tiny")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not partial.exists() and consistent(out)
