"""What a user sees when a command cannot finish: a full disk, Ctrl-C, a command line that leaves out
what it needs. One line each, the exit status a shell expects, and nothing half-written that looks
complete."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import folder_bytes, interruptible, make_checkpoint, run_export, write_images
from safetensors import safe_open

import moonvit_projector.export.run as export_run
from moonvit.files import DiskFullError, save_safetensors_atomic, write_text_atomic
from moonvit_train.checkpoint import save_state
from moonvit_train.config import SMOKE, parse_args

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
HANG_GUARD_S = 300
"""The longest any command here may take on a loaded machine before the test gives up on it."""

FULL_DISK = r"no space left on the disk holding {path} \([0-9.]+ MiB free\): free space and run the same command again"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def command(module: str, *args: str | Path) -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def run(module: str, *args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        command(module, *args), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=HANG_GUARD_S
    )


def last_line(result: subprocess.CompletedProcess | tuple[int, str], status: int) -> str:
    """The last stderr line of a command that must end with ``status`` and print no traceback; the
    only ``error:`` or ``interrupted:`` line (a progress bar may come before it)."""
    code, stderr = (result.returncode, result.stderr) if isinstance(result, subprocess.CompletedProcess) else result
    assert code == status, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert sum(": error: " in line or ": interrupted: " in line for line in lines) == 1, stderr[-3000:]
    return lines[-1]


# ---- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmp_path) -> Iterator[Path]:
    """A 1 MiB tmpfs (Linux, as root; skipped where mounting is not permitted), unmounted afterwards."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root on Linux")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` with one file until about ``leave`` bytes are free; remove the file to free them."""
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


def files_below(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_atomic_writes_into_a_full_disk_raise_one_error_naming_the_file_and_leave_nothing(tiny_disk):
    """Text, safetensors and torch.save (the trainer's state), each failing its own way on a full disk,
    are one DiskFullError naming the target; the temporary is removed and no target appears."""
    fill(tiny_disk, 16 * 1024)
    big = torch.zeros(100_000)
    writes = {
        tiny_disk / "notes.txt": lambda path: write_text_atomic(path, "x" * 100_000),  # OSError ENOSPC
        tiny_disk / "tokens.safetensors": lambda path: save_safetensors_atomic({"x": big}, path),  # SafetensorError
        tiny_disk / "state" / "last.pt": lambda path: save_state(path, {"weights": big}),  # torch's RuntimeError
    }
    for path, write in writes.items():
        with pytest.raises(DiskFullError) as caught:
            write(path)
        assert caught.value.errno == errno.ENOSPC and caught.value.path == path
        assert re.fullmatch(FULL_DISK.format(path=re.escape(str(path))), str(caught.value)), str(caught.value)
    assert files_below(tiny_disk) == {"filler"}


def test_python_m_moonvit_into_a_full_disk_is_one_line_and_writes_nothing(tiny_disk):
    fill(tiny_disk, 16 * 1024)
    out = tiny_disk / "demo"
    result = run("moonvit", "--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--out", out)
    line = last_line(result, 1)
    path = re.escape(str(out / "merged.safetensors"))
    assert re.fullmatch(f"python -m moonvit: error: {FULL_DISK.format(path=path)}", line), line
    assert files_below(tiny_disk) == {"filler"}


def test_the_trainers_state_save_into_a_full_disk_is_one_line(tiny_disk):
    """The state (megabytes for the tiny preset) does not fit: one line naming it, no state file, no
    temporary; the metrics written before it are kept."""
    out = tiny_disk / "run"
    args = ["--objective", "supervised", "--preset", "tiny", "--dataset", "digits", "--steps", "2"]
    args += ["--save-every", "1", "--evals", "0", "--dtype", "fp32", "--resolution", "28", "--batch-patches", "256"]
    result = run("moonvit_train", *args, "--threads", "1", "--no-progress", "--out", out)
    line = last_line(result, 1)
    path = re.escape(str(out / "state" / "last.pt"))
    assert re.fullmatch(f"python -m moonvit_train: error: {FULL_DISK.format(path=path)}", line), line
    assert files_below(out) == {"metrics.jsonl"}


def test_an_export_into_a_full_disk_is_one_line_and_resumes_to_the_same_bytes(tiny_disk, tmp_path, checkpoint):
    """The disk fills in the middle of the export: one line naming the file, no manifest, every shard
    present whole with its part file; with space freed, the same command finishes it, byte for byte
    what an export on a roomy disk writes."""
    write_images(tmp_path / "images", 12, seed=4)
    common = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--shard-size", "2", "--store", "both"]
    run_export(*common, "--out", tmp_path / "reference")
    pages = sum(-(-len(data) // 4096) for data in folder_bytes(tmp_path / "reference").values())
    filler = fill(tiny_disk, pages // 2 * 4096)  # about half of the export fits
    out = tiny_disk / "out"

    line = last_line(run("moonvit_projector.export", *common, "--threads", "1", "--out", out), 1)
    match = re.fullmatch(f"python -m moonvit_projector.export: error: {FULL_DISK.format(path='(.+)')}", line)
    assert match is not None and Path(match.group(1)).parent in (out, out / "parts"), line
    written = files_below(out)
    assert "manifest.jsonl" not in written and not [name for name in written if name.endswith(".tmp")]
    assert "run.json" in written
    shards = {name for name in written if name.startswith("shard-")}
    parts = {name for name in written if name.startswith("parts/")}
    assert 1 <= len(parts) < 6 and shards <= {f"shard-{name[len('parts/shard-') : -5]}.safetensors" for name in parts}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as handle:  # whole: its header and tensors read
            names = handle.keys()
            assert names and all(handle.get_tensor(name).numel() for name in names)

    filler.unlink()
    resumed = run("moonvit_projector.export", *common, "--threads", "1", "--out", out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")


# ---- Ctrl-C ------------------------------------------------------------------------------------


class Started:
    """``python -m module args`` in its own process group (SIGINT at its default: see ``interruptible``),
    its output going to files in ``logs`` (a pipe nobody reads while it runs could fill and block it)."""

    def __init__(self, logs: Path, module: str, *args: str | Path) -> None:
        logs.mkdir(exist_ok=True)
        self.stdout, self.stderr = logs / "stdout.txt", logs / "stderr.txt"
        with self.stdout.open("w") as stdout, self.stderr.open("w") as stderr:
            self.process = subprocess.Popen(
                command(module, *args),
                cwd=REPO,
                env=ENV,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
                preexec_fn=interruptible,
            )

    def interrupt_when(self, started: Callable[[], bool]) -> tuple[int, str]:
        """SIGINT to the group (a terminal's Ctrl-C) once ``started()`` holds; the exit status and
        stderr. The group is killed if it outlives the hang guard."""
        process = self.process
        try:
            deadline = time.monotonic() + HANG_GUARD_S
            while not started():
                assert process.poll() is None, f"it ended before it was interrupted: {self.stderr.read_text()}"
                assert time.monotonic() < deadline, "it did not start"
                time.sleep(0.005)
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=HANG_GUARD_S)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode, self.stderr.read_text()


def test_ctrl_c_in_the_export_is_one_line_naming_the_finished_shards(tmp_path, checkpoint):
    write_images(tmp_path / "images", 120, seed=6)
    common = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--shard-size", "4"]
    out = tmp_path / "out"
    export = Started(tmp_path / "logs", "moonvit_projector.export", *common, "--threads", "1", "--out", out)
    line = last_line(export.interrupt_when((out / "parts" / "shard-000000.json").exists), 130)

    finished = sorted(p.name for p in (out / "parts").glob("*.json"))
    assert not (out / "manifest.jsonl").exists() and not list(out.rglob("*.tmp"))
    count = len(finished)
    shown = "0" if count == 1 else f"0-{count - 1}"  # one rank writes its shards in order
    assert line == (
        f"python -m moonvit_projector.export: interrupted: {count} of 30 shards finished in {out} ({shown}), "
        "each whole; "
        "the same command resumes with the rest"
    )
    assert 1 <= count < 30
    summary = run_export(*common, "--out", out)
    assert summary["images_this_run"] == 120 - 4 * count  # the finished shards are kept, not redone


def test_ctrl_c_on_the_ray_engine_goes_through_the_same_handler(tmp_path, checkpoint, monkeypatch, capsys):
    """The Ray engine's driver, interrupted after a shard: the same line (no Ray needed: the engine stops
    where it would start encoding)."""
    write_images(tmp_path / "images", 4)
    out = tmp_path / "out"

    def interrupted_on_ray(shards, layout, planned, models, run, *args, **kwargs):
        export_run.export_rank(shards[:1], layout, planned, models, run, False)  # one shard finished
        raise KeyboardInterrupt

    monkeypatch.setattr(export_run, "export_on_ray", interrupted_on_ray)
    args = ["--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--shard-size", "2", "--out", out]
    with pytest.raises(SystemExit) as exit_info:
        try:
            run_export(*args, "--engine", "ray", "--device", "cpu")
        except KeyboardInterrupt:
            pytest.fail("Ctrl-C on the Ray engine passed the command's handler")
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m moonvit_projector.export: interrupted: 1 of 2 shards finished in {out} (0), each whole; "
        "the same command resumes with the rest"
    )


def test_ctrl_c_in_python_m_moonvit_is_one_line_and_writes_nothing(tmp_path):
    """Interrupted while it reads an image (a named pipe nobody writes yet: it waits there)."""
    pipe = tmp_path / "slow.png"
    os.mkfifo(pipe)
    out = tmp_path / "out"
    args = ["--preset", "tiny", "--dtype", "fp32", "--threads", "1", "--images", pipe, "--out", out]
    demo = Started(tmp_path / "logs", "moonvit", *args)
    writer: list[int] = []
    opened: list[float] = []

    def reading() -> bool:
        """The command waits in its read of the pipe. A writer's non-blocking open succeeds once it opens the
        pipe to read; then Pillow seeks (the pipe cannot) before it reads the whole file, and a SIGINT that
        lands inside that seek is lost in CPython (the seek's own error replaces the KeyboardInterrupt), so
        the signal waits until the kernel shows the command in the pipe's read."""
        if not writer:
            try:
                writer.append(os.open(pipe, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as error:
                assert error.errno == errno.ENXIO
                return False
            opened.append(time.monotonic())
        try:
            waiting_in = Path(f"/proc/{demo.process.pid}/wchan").read_text()
        except OSError:
            waiting_in = ""
        if waiting_in in ("", "0"):  # a kernel that does not say: a second is far past the seek
            return time.monotonic() - opened[0] > 1.0
        return "pipe" in waiting_in

    try:
        line = last_line(demo.interrupt_when(reading), 130)
    finally:
        for descriptor in writer:
            os.close(descriptor)
    assert line == (
        "python -m moonvit: interrupted: nothing was written (the outputs are written once every input is encoded)"
    )
    assert not out.exists()


def test_ctrl_c_in_the_onnx_export_is_one_line_and_leaves_no_graph(tmp_path, checkpoint):
    pytest.importorskip("onnx")
    out = tmp_path / "onnx" / "encoder.onnx"
    export = Started(tmp_path / "logs", "moonvit.onnx", "--checkpoint", checkpoint, "--out", out, "--no-check")
    # its first line says the export starts (it takes seconds): interrupted in it
    line = last_line(export.interrupt_when(lambda: export.stdout.read_text().startswith("exporting")), 130)
    assert line == f"python -m moonvit.onnx: interrupted: nothing was written to {out}"
    assert not out.parent.exists() or list(out.parent.iterdir()) == []


# ---- command lines -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, missing",
    [
        ("moonvit_train", "--objective, --out, --preset or --checkpoint, --dataset (or --smoke alone, a quick check)"),
        ("moonvit_projector.export", "--inputs, --checkpoint, --out"),
        ("moonvit.onnx", "--checkpoint, --out"),
        ("moonvit.gguf", "--checkpoint, --out"),
        ("moonvit_eval.linear_probe", "--dataset"),
        ("moonvit_eval.pictures", "--checkpoint"),
        ("moonvit_eval.feature_maps", "--checkpoint"),
    ],
)
def test_missing_required_arguments_are_one_line_with_where_to_look(module, missing):
    result = run(module)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        f"python -m {module}: error: the following arguments are required: {missing}; see python -m {module} --help"
    ]


def test_smoke_alone_is_a_whole_run_of_the_tiny_preset_on_digits(tmp_path, monkeypatch, capsys):
    from moonvit_train.loop import main

    config = parse_args(["--smoke"])
    assert (config.run.objective, config.model.preset, config.data.dataset) == ("supervised", "tiny", "digits")
    assert config.run.out == Path("runs/smoke") and config.run.steps == SMOKE["steps"]
    assert config.data.resolution == (28, 28) and config.data.batch_patches == 1024
    assert "--preset tiny" in capsys.readouterr().out
    # a given value is kept: a smoke run on another dataset keeps its resolution
    config = parse_args(["--smoke", "--dataset", "fashion-mnist", "--out", str(tmp_path / "fm")])
    assert config.data.resolution == (56, 112) and config.run.out == tmp_path / "fm"
    assert capsys.readouterr().out == "python -m moonvit_train --smoke: --objective supervised --preset tiny\n"

    monkeypatch.chdir(tmp_path)
    previous = torch.get_num_threads()
    try:
        results = main(["--smoke", "--steps", "3", "--evals", "0", "--threads", "1", "--no-progress"])
    finally:
        torch.set_num_threads(previous)
    assert results["steps"] == 3 and (tmp_path / "runs" / "smoke" / "checkpoint" / "model.safetensors").is_file()
    assert capsys.readouterr().out.startswith(
        "python -m moonvit_train --smoke: --objective supervised --out runs/smoke --preset tiny --dataset digits "
        "--resolution 28 --batch-patches 1024\n"
    )
