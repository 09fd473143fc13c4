"""moonvit.files: atomic writes under concurrent writers, and the modes written files get."""

from __future__ import annotations

import multiprocessing
import os
import stat
import threading

import pytest
import torch
from safetensors.torch import load_file

from moonvit.files import atomic_path, save_safetensors_atomic, write_text_atomic

WRITES = 60


def _write_versions(target: str, writer: int, count: int) -> None:
    """Write ``count`` whole versions of ``target``, each a line repeated (a torn file shows)."""
    for k in range(count):
        write_text_atomic(target, f"writer {writer} version {k}\n" * 200)


def _is_whole_version(text: str) -> bool:
    lines = text.splitlines()
    return len(lines) == 200 and len(set(lines)) == 1 and lines[0].startswith("writer ")


def test_threads_writing_one_file_never_move_each_others_temporary(tmp_path):
    target = tmp_path / "settings.json"
    errors: list[BaseException] = []

    def write(writer: int) -> None:
        try:
            _write_versions(str(target), writer, WRITES)
        except BaseException as error:  # collected: an error in a thread would otherwise pass unseen
            errors.append(error)

    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors[:3]
    assert _is_whole_version(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]  # no temporary left behind


def test_processes_writing_one_file_never_crash_and_leave_a_whole_version(tmp_path):
    target = tmp_path / "settings.json"
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_versions, args=(str(target), writer, WRITES)) for writer in range(4)]
    for worker in workers:
        worker.start()
    try:
        for worker in workers:
            worker.join(timeout=240)
        assert [worker.exitcode for worker in workers] == [0] * len(workers)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    assert _is_whole_version(target.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["settings.json"]


@pytest.fixture
def umask():
    """Set the process's umask for the test, restored after."""
    previous = os.umask(0o022)
    yield os.umask
    os.umask(previous)


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_follow_the_umask(tmp_path, umask, mask):
    umask(mask)
    expected = 0o666 & ~mask
    save_safetensors_atomic({"x": torch.arange(4)}, tmp_path / "tokens.safetensors")
    write_text_atomic(tmp_path / "run.json", "{}\n")
    with atomic_path(tmp_path / "state.pt") as temporary:
        torch.save({"step": 1}, temporary)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"tokens.safetensors": expected, "run.json": expected, "state.pt": expected}
    assert torch.equal(load_file(tmp_path / "tokens.safetensors")["x"], torch.arange(4))


def test_an_export_and_a_saved_checkpoint_are_readable_by_others(tmp_path, umask):
    """Token shards on shared storage and checkpoint folders: every file 0644 under umask 022."""
    from helpers import make_checkpoint, run_export, write_images

    umask(0o022)
    checkpoint = make_checkpoint(tmp_path / "ckpt")
    write_images(tmp_path / "images", 3)
    run_export("--inputs", tmp_path / "images", "--checkpoint", checkpoint, "--out", tmp_path / "out")
    files = [p for folder in ("ckpt", "out") for p in (tmp_path / folder).rglob("*") if p.is_file()]
    assert {p.suffix for p in files} >= {".safetensors", ".json", ".jsonl"}
    assert {p.relative_to(tmp_path).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {
        p.relative_to(tmp_path).as_posix(): oct(0o644) for p in files
    }
