"""How a checkpoint folder stores its config and tensors, and reading them with errors that name the file.

Tensors come in safetensors files (``model.safetensors``, or shards listed in
``model.safetensors.index.json``) or, in older fine-tunes, torch pickles (``pytorch_model.bin``, or
shards listed in ``pytorch_model.bin.index.json``); safetensors is preferred where a folder has both.
Either way a :class:`TensorFile` reads names and shapes without touching tensor data, and a tensor's
bytes only when it is asked for:

- safetensors maps the file and reads one tensor at a time;
- a torch pickle in the zip format torch has written since 1.6 is memory-mapped
  (``torch.load(mmap=True)``) with ``weights_only=True`` (no code in the file is run), so the pages
  of tensors that are never read are never loaded either;
- a pickle in torch's legacy (pre-1.6) format cannot be mapped: it is read whole, with a warning
  naming the file and its size (once per file and process: a load reads the file's names, then its
  tensors).

An index's shard names are file names inside the folder: an absolute name, or one that climbs out
with ``..``, is refused before any file is opened.

:func:`write_tensor_files` writes a folder's tensors the same way: one ``model.safetensors``, or
shards and their index past a size, each file atomically, and removes the safetensors files of an
earlier save that the new ones replace (a stale index would otherwise be read in their place).
"""

from __future__ import annotations

import json
import pickle
import warnings
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import torch
from safetensors import SafetensorError, safe_open

from ..files import save_safetensors_atomic, write_text_atomic

__all__ = [
    "BIN_FILE",
    "BIN_INDEX_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "CheckpointError",
    "DEFAULT_MAX_SHARD_BYTES",
    "TensorFile",
    "open_tensor_file",
    "read_json",
    "read_weight_map",
    "tensor_files",
    "tensor_names",
    "weight_files",
    "write_tensor_files",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
WEIGHT_FILES = ((INDEX_FILE, SINGLE_FILE), (BIN_INDEX_FILE, BIN_FILE))
"""(index, single file) of each storage, in order of preference."""
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""The largest shard :func:`write_tensor_files` writes by default (transformers' 5 GB)."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it stands."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; anything else is a :class:`CheckpointError` naming the file."""
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err
    except UnicodeDecodeError as err:
        raise CheckpointError(f"{path} is not a text file: {err}") from err
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} holds a JSON {type(values).__name__}, not an object")
    return values


# ---- one file of tensors ------------------------------------------------------------------------


class TensorFile(Protocol):
    """The tensors of one file: names and shapes without reading data, a tensor's data on demand."""

    def keys(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor ``name`` (it may view the file's mapping: copy it to keep it)."""
        ...


class _Safetensors:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def keys(self) -> list[str]:
        return list(self.handle.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle.get_slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return self.handle.get_slice(name)[:1].dtype  # one row: the dtype, without the tensor

    def tensor(self, name: str) -> torch.Tensor:
        return self.handle.get_tensor(name)


class _TorchPickle:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def keys(self) -> list[str]:
        return list(self.state)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.state[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.state[name].dtype

    def tensor(self, name: str) -> torch.Tensor:
        return self.state[name]


@contextmanager
def open_tensor_file(path: Path) -> Iterator[TensorFile]:
    """The tensors of a safetensors file or a torch pickle (by its ending: ``.bin``, ``.pt``, ``.pth``).

    Raises:
        CheckpointError: a truncated or corrupt file, a pickle holding more than a flat dict of
            tensors (it is not unpickled), or an unreadable file; the message names it.
    """
    if path.suffix in _PICKLE_SUFFIXES:
        yield _TorchPickle(_load_pickle(path))
        return
    try:
        with safe_open(path, framework="pt") as handle:
            yield _Safetensors(handle)
    except SafetensorError as err:
        raise CheckpointError(f"cannot read {path}: {err} (a truncated or corrupt safetensors file)") from err
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    """A torch pickle's flat dict of tensors, memory-mapped where its format allows."""
    try:
        try:
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # a truncated zip, say: the legacy path would fail too
                raise
            size = path.stat().st_size
            _warn_legacy_pickle_once(path, size)
            state = torch.load(path, map_location="cpu", mmap=False, weights_only=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{path} holds objects other than tensors, which are not unpickled (weights_only): "
            f"{str(err).splitlines()[0]}; save its state_dict alone, or as safetensors"
        ) from err
    except (RuntimeError, EOFError, ValueError) as err:
        raise CheckpointError(f"cannot read {path}: {err} (a truncated or corrupt torch file)") from err
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        kind = type(state).__name__ if not isinstance(state, dict) else "a dict holding more than tensors"
        raise CheckpointError(f"{path} holds {kind}, not a flat dict of tensors (a state_dict)")
    return state


_warned_legacy: set[tuple[str, int, int]] = set()
"""Legacy pickles already warned about, by (resolved path, size, modification time)."""


def _warn_legacy_pickle_once(path: Path, size: int) -> None:
    """Warn that a legacy pickle is read whole, once per file: one load reads it up to three times
    (its names for the family, its names per prefix, its tensors), which is one fact to the user.
    A file rewritten since (another size or modification time) is warned about again."""
    stat = path.stat()
    key = (str(path.resolve()), size, stat.st_mtime_ns)
    if key in _warned_legacy:
        return
    _warned_legacy.add(key)
    warnings.warn(
        f"{path} is in torch's legacy (pre-1.6) pickle format, which cannot be memory-mapped: it is read "
        f"whole ({size / 2**20:.0f} MiB) to take its vision tensors; re-save it as safetensors to load "
        "only those",
        stacklevel=5,
    )


# ---- a folder's files ------------------------------------------------------------------------------


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of an index file."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to file names")
    for file_name in sorted(set(weight_map.values())):
        # A shard is a file of the folder: a name that is absolute or climbs out with ".." would
        # open (or fetch) a file the checkpoint does not own. Backslashes count as separators too.
        parts = PurePosixPath(file_name.replace("\\", "/")).parts
        if not parts or parts[0] == "/" or ".." in parts:
            raise CheckpointError(
                f"{index} names the shard {file_name!r}, which is not a file inside the checkpoint folder"
            )
    return weight_map


def weight_files(folder: Path) -> tuple[Path | None, Path | None]:
    """(index, single file) of the folder's preferred storage that is present; (None, None) without any."""
    for index, single in WEIGHT_FILES:
        if (folder / index).is_file():
            return folder / index, None
        if (folder / single).is_file():
            return None, folder / single
    return None, None


def tensor_names(folder: Path) -> list[str]:
    """Every tensor name of a folder, from its index (no shard opened) or its single file's header;
    none when it has neither (yet)."""
    index, single = weight_files(folder)
    if index is not None:
        return list(read_weight_map(index))
    if single is not None:
        with open_tensor_file(single) as f:
            return f.keys()
    return []


def tensor_files(folder: Path, prefix: str | tuple[str, ...]) -> dict[Path, list[str]]:
    """Map each tensor file that holds tensors under ``prefix`` (or any of several) to those names."""
    index, single = weight_files(folder)
    if index is not None:
        files: dict[Path, list[str]] = defaultdict(list)
        for name, file_name in read_weight_map(index).items():
            if name.startswith(prefix):
                files[folder / file_name].append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which is not in {folder}")
        return dict(files)
    if single is None:
        raise CheckpointError(f"{folder} has none of {SINGLE_FILE}, {INDEX_FILE}, {BIN_FILE}, {BIN_INDEX_FILE}")
    with open_tensor_file(single) as f:
        return {single: [name for name in f.keys() if name.startswith(prefix)]}  # noqa: SIM118 (a TensorFile, not a dict)


# ---- writing -----------------------------------------------------------------------------------------


def write_tensor_files(
    folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES
) -> list[str]:
    """Write ``tensors`` into ``folder`` as safetensors: one :data:`SINGLE_FILE` up to
    ``max_shard_bytes`` (None: always), else ``model-0000k-of-0000n.safetensors`` shards of at most
    that size each (a larger tensor alone in its shard), in the given order, and :data:`INDEX_FILE`
    (``metadata.total_size``, ``weight_map``) written last.

    Each file is written atomically; then the safetensors files of an earlier save that this one
    does not rewrite (a single file, an index and its shards) are removed. Returns the names of the
    files written, the index last.
    """
    folder.mkdir(parents=True, exist_ok=True)
    old = _safetensors_files(folder)
    shards = _shard_groups(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_safetensors_atomic(tensors, folder / SINGLE_FILE)
        written = [SINGLE_FILE]
    else:
        written = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
        weight_map = {}
        for file_name, names in zip(written, shards):
            save_safetensors_atomic({name: tensors[name] for name in names}, folder / file_name)
            weight_map.update(dict.fromkeys(names, file_name))
        total = sum(_nbytes(tensor) for tensor in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_text_atomic(folder / INDEX_FILE, json.dumps(index, indent=2) + "\n")
        written.append(INDEX_FILE)
    for stale in sorted(old - set(written), key=lambda name: name != INDEX_FILE):  # the index first
        (folder / stale).unlink(missing_ok=True)
    return written


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _shard_groups(tensors: dict[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """The names of ``tensors`` in order, cut into runs of at most ``max_bytes`` each (one run: None)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = _nbytes(tensor)
        if max_bytes is not None and groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _safetensors_files(folder: Path) -> set[str]:
    """The safetensors storage a folder holds now: its single file, its index and the index's shards."""
    found = {name for name in (SINGLE_FILE, INDEX_FILE) if (folder / name).is_file()}
    if INDEX_FILE in found:
        found |= {name for name in set(read_weight_map(folder / INDEX_FILE).values()) if (folder / name).is_file()}
    return found
