"""Files and folders: atomic writes (a temporary name, then a rename), hashes, what a path is, and the
media files below a folder."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = [
    "DiskFullError",
    "atomic_path",
    "disk_full_error",
    "files_below",
    "folder_problem",
    "save_safetensors_atomic",
    "sha256_file",
    "skipped_line",
    "write_text_atomic",
]


class DiskFullError(OSError):
    """A write that ran out of room: no space left on the disk (``ENOSPC``) or the user's quota used
    up (``EDQUOT``). Its text is the one line a command prints: the path being written, the space
    left on its disk, and what to do."""

    def __init__(self, path: str | os.PathLike | None, code: int = errno.ENOSPC) -> None:
        super().__init__(code, os.strerror(code), None if path is None else str(path))
        self.path = None if path is None else Path(path)
        self.code = code

    def __reduce__(self) -> tuple[type[DiskFullError], tuple[Path | None, int]]:
        return DiskFullError, (self.path, self.code)

    def __str__(self) -> str:
        what = "no space left" if self.code == errno.ENOSPC else "the disk quota is used up"
        where = (
            "on a disk this command writes to"
            if self.path is None
            else f"on the disk holding {self.path} ({_free_space(self.path)} free)"
        )
        return f"{what} {where}: free space and run the same command again"


_FULL_CODES = (errno.ENOSPC, errno.EDQUOT)
_FULL_MESSAGES = {
    "unexpected pos": errno.ENOSPC,  # torch.save's zip writer when a write comes up short
    "PytorchStreamWriter failed writing file": errno.ENOSPC,
    os.strerror(errno.ENOSPC): errno.ENOSPC,  # safetensors' and other libraries' wrapped OS errors
    os.strerror(errno.EDQUOT): errno.EDQUOT,
}


def disk_full_error(error: BaseException, path: str | os.PathLike | None = None) -> DiskFullError | None:
    """``error`` as a :class:`DiskFullError` when it is a write that ran out of room (an ``OSError``
    with ``ENOSPC`` or ``EDQUOT``, ``torch.save``'s ``RuntimeError`` on a short write, safetensors'
    error wrapping ``ENOSPC``), else None. ``path``: the file being written, where ``error`` names none."""
    if isinstance(error, DiskFullError):
        return error
    if isinstance(error, OSError) and error.errno in _FULL_CODES:
        return DiskFullError(error.filename or path, error.errno)
    if isinstance(error, OSError):
        return None
    text = str(error)
    code = next((code for message, code in _FULL_MESSAGES.items() if message in text), None)
    return None if code is None else DiskFullError(path, code)


def _free_space(path: Path) -> str:
    """The space left on the disk holding ``path`` (its nearest existing folder), in MiB."""
    folder = next((p for p in (path, *path.parents) if p.exists()), None)
    if folder is None:
        return "unknown space"
    free = shutil.disk_usage(folder).free / 2**20
    return f"{free:.1f} MiB" if free < 10 else f"{free:.0f} MiB"


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``.

    The temporary's name is unique (``tempfile.mkstemp`` in the target's folder), so writers of
    one target in several threads or processes never move each other's file away: the last
    rename wins, and each reader sees one whole version. The file ends with the mode a plain
    ``open(path, "w")`` gives (``0o666`` less the umask), whatever the writer did to the
    temporary (``mkstemp`` and safetensors' own temporary are private). A crash (or an
    exception) leaves ``path`` as it was, at worst with a stray ``.<name>.*.tmp`` file beside it.

    Raises:
        DiskFullError: the disk (or the quota) ran out of room while writing, in whatever form
            the writer reported it; the temporary is removed first, and ``path`` is as it was.
    """
    target = Path(path)
    try:
        descriptor, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as error:
        _raise_if_full(error, target)
        raise
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        os.chmod(temporary, 0o666 & ~_umask())
        os.replace(temporary, target)
    except Exception as error:
        temporary.unlink(missing_ok=True)  # before the free space is measured
        _raise_if_full(error, target)
        raise
    finally:
        temporary.unlink(missing_ok=True)


def _raise_if_full(error: Exception, path: Path) -> None:
    """Raise ``error`` as a :class:`DiskFullError` naming ``path`` (not a temporary) when it is a full disk's."""
    full = disk_full_error(error)
    if full is not None and full.path != path:
        raise DiskFullError(path, full.code) from error


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (Linux); else set
    and restored at once."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as temporary:
        temporary.write_text(text)


def save_safetensors_atomic(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors`` save of contiguous copies of ``tensors`` to ``path``, atomically."""
    with atomic_path(path) as temporary:
        save_file(
            {name: tensor.detach().contiguous() for name, tensor in tensors.items()},
            temporary,
            metadata={"format": "pt", **(metadata or {})},
        )


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be used as a folder (``"does not exist"``, ``"is a file, not a folder"``), or None."""
    target = Path(path)
    if target.is_dir():
        return None
    return "is a file, not a folder" if target.exists() else "does not exist"


def files_below(folder: str | os.PathLike, extensions: Collection[str]) -> tuple[list[Path], dict[str, int]]:
    """Every file below ``folder`` (recursively) whose lower-cased ending is in ``extensions``, sorted by
    path relative to the folder, and the other files counted by ending ("" for none)."""
    root = Path(folder)
    files = [p for p in root.rglob("*") if p.is_file()]
    chosen = sorted((p for p in files if p.suffix.lower() in extensions), key=lambda p: p.relative_to(root).as_posix())
    others = Counter(p.suffix.lower() for p in files if p.suffix.lower() not in extensions)
    return chosen, dict(others)


def skipped_line(skipped: dict[str, int]) -> str:
    """``3 files skipped for their extension (.txt 2, .json 1)``, or "" when none were."""
    if not skipped:
        return ""
    ordered = sorted(skipped.items(), key=lambda item: (-item[1], item[0]))  # most first, then by name
    counts = ", ".join(f"{ext or '(none)'} {n}" for ext, n in ordered)
    return f"{sum(skipped.values())} files skipped for their extension ({counts})"
