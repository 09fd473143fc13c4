"""Files and folders: atomic writes (a temporary name, then a rename), hashes, and what a path is."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["atomic_path", "folder_problem", "save_safetensors_atomic", "sha256_file", "write_text_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is renamed over ``path``.

    A crash (or an exception) leaves ``path`` as it was, at worst with a stray
    ``.tmp`` file beside it, which the next write replaces.
    """
    target = Path(path)
    temporary = target.with_name(f"{target.name}.tmp")
    try:
        yield temporary
        os.replace(temporary, target)
    finally:
        temporary.unlink(missing_ok=True)


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
