"""Reading and writing MoonViT checkpoints.

Two layouts are read from a local folder (or a Hugging Face hub id, fetched by
:mod:`.hub` into its cache first, only the files needed):

- Kimi-VL's: ``config.json`` with a ``vision_config`` and tensors named
  ``vision_tower.<name>``, usually sharded beside a large language model
  (``model.safetensors.index.json``). Only the shards that hold vision tensors
  are opened, and only those tensors are read.
- This project's own (also MoonViT-SO-400M's standalone layout): ``config.json``
  with the encoder fields at the top level and unprefixed tensor names in
  ``model.safetensors``.

Module names in :class:`~moonvit.model.encoder.MoonViT` equal Kimi-VL's names without
the ``vision_tower.`` prefix, so no renaming is involved.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open

from ..devices import check_device
from ..files import folder_problem, save_safetensors_atomic
from ..model.config import DictConfig, MoonViTConfig
from .config_keys import warn_unread_keys

if TYPE_CHECKING:
    from ..model.encoder import MoonViT
    from .hub import HubSnapshot

KIMI_VL_PREFIX = "vision_tower."
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it stands."""


C = TypeVar("C", bound=DictConfig)

# Keys of Kimi-VL's vision_config that the projector reads (projector.model), not the encoder.
PROJECTOR_KEYS_IN_VISION_CONFIG = ("mm_projector_type", "projector_hidden_act", "projector_ln_eps", "mm_hidden_size")


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


def config_from_file(cls: type[C], values: dict[str, Any], path: Path, also_read: Iterable[str] = ()) -> C:
    """``cls.from_dict(values)``, read from the file ``path``: keys it does not read are named in
    a warning, and invalid values raise :class:`CheckpointError` naming the file."""
    warn_unread_keys(path, values, {*(f.name for f in dataclasses.fields(cls)), *also_read})  # type: ignore[arg-type]
    try:
        return cls.from_dict(values)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: {err}") from err


def read_config(folder: Path) -> tuple[MoonViTConfig, str]:
    """The encoder config of a checkpoint folder, and the prefix of its tensor names."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    values = read_json(path)
    if "vision_config" in values:
        vision = values["vision_config"]
        if not isinstance(vision, dict):
            raise CheckpointError(f"{path}: vision_config is a {type(vision).__name__}, not an object")
        config = config_from_file(MoonViTConfig, vision, path, also_read=PROJECTOR_KEYS_IN_VISION_CONFIG)
        return config, KIMI_VL_PREFIX
    return config_from_file(MoonViTConfig, values, path), ""


@contextmanager
def open_tensor_file(path: Path) -> Iterator[Any]:
    """``safe_open(path)``, its failures (a truncated or corrupt file) a :class:`CheckpointError` naming it."""
    try:
        with safe_open(path, framework="pt") as handle:
            yield handle
    except SafetensorError as err:
        raise CheckpointError(f"cannot read {path}: {err} (a truncated or corrupt safetensors file)") from err
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err}") from err


def read_weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a safetensors index file."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise CheckpointError(f"{index} has no weight_map of tensor names to file names")
    return weight_map


def tensor_files(folder: Path, prefix: str) -> dict[Path, list[str]]:
    """Map each safetensors file that holds tensors under ``prefix`` to those names."""
    index = folder / INDEX_FILE
    if index.is_file():
        files: dict[Path, list[str]] = defaultdict(list)
        for name, file_name in read_weight_map(index).items():
            if name.startswith(prefix):
                files[folder / file_name].append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which is not in {folder}")
        return dict(files)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with open_tensor_file(single) as f:
        return {single: [name for name in f.keys() if name.startswith(prefix)]}  # noqa: SIM118 (a safe_open handle, not a dict)


def checkpoint_folder(source: str | os.PathLike, fetch: Callable[[HubSnapshot], None]) -> Path:
    """The local folder of a loader's ``path`` argument, refused with a :class:`CheckpointError`
    when it is not one. A hub id (``owner/name``) that is not a local path is fetched into the hub
    cache with ``fetch`` (see :mod:`.hub`)."""
    from .hub import resolve_pretrained  # .hub builds on this module

    folder = resolve_pretrained(source, fetch)
    problem = folder_problem(folder)
    if problem is not None:
        hint = " (pass the checkpoint folder that holds it)" if folder.exists() else ""
        raise CheckpointError(f"checkpoint folder {folder} {problem}{hint}")
    return folder


def fetch_encoder_files(snapshot: HubSnapshot) -> None:
    """From a hub repository: config.json, then the tensor files holding the encoder's tensors."""
    _, prefix = read_config(snapshot.file("config.json").parent)
    snapshot.tensors(prefix)


def load_pretrained(
    cls: type[MoonViT],
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "auto",
) -> MoonViT:
    """Build ``cls`` from a checkpoint folder or hub id, reading only the vision tensors (see
    :func:`assign_from_files`)."""
    if device is not None:
        device = check_device(device)
    folder = checkpoint_folder(path, fetch_encoder_files)
    config, prefix = read_config(folder)
    config.attn_implementation = attn_implementation
    with torch.device("meta"):
        model = cls(config)
    return assign_from_files(model, tensor_files(folder, prefix), lambda name: prefix + name, folder, dtype, device)


M = TypeVar("M", bound=nn.Module)


def assign_from_files(
    model: M,
    files: dict[Path, list[str]],
    checkpoint_name: Callable[[str], str],
    folder: Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> M:
    """Give a model built on the meta device its parameters from safetensors files.

    Args:
        model: built under ``torch.device("meta")``.
        files: each file and the checkpoint names to take from it; together they
            must be exactly the model's parameters.
        checkpoint_name: the checkpoint's name of each state-dict entry.
        dtype: defaults to the checkpoint dtype of the model's first matrix.

    Only the listed tensors are read, one copy each, so peak memory is about
    one copy of the model. Returns the model in eval mode.

    Raises:
        CheckpointError: tensors missing, unexpected or of the wrong shape, all named.
    """
    params = model.state_dict()
    model_name = {checkpoint_name(name): name for name in params}
    found = {name for names in files.values() for name in names}
    missing, unexpected = sorted(set(model_name) - found), sorted(found - set(model_name))
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not match the {type(model).__name__} config: "
            + "; ".join(
                [*count_mismatches(found, set(model_name)), *name_lists(missing=missing, unexpected=unexpected)]
            )
        )
    wrong_shape = []
    for file, names in files.items():
        with open_tensor_file(file) as f:
            for name in names:
                shape, wanted = tuple(f.get_slice(name).get_shape()), tuple(params[model_name[name]].shape)
                if shape != wanted:
                    wrong_shape.append(f"{name}: {shape}, expected {wanted}")
    if wrong_shape:
        shown = "; ".join(wrong_shape[:3]) + ("; ..." if len(wrong_shape) > 3 else "")
        raise CheckpointError(
            f"{folder} has {len(wrong_shape)} tensors of the wrong shape for the config (are its widths "
            f"those of the checkpoint?): {shown}"
        )

    if dtype is None:
        first_matrix = checkpoint_name(next(name for name, p in params.items() if p.ndim >= 2))
        file = next(file for file, names in files.items() if first_matrix in names)
        with open_tensor_file(file) as f:
            dtype = f.get_slice(first_matrix)[:1].dtype
    # safetensors maps the file lazily; copy each tensor out so the model never
    # aliases the file (which a later save to the same folder would overwrite).
    state: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        with open_tensor_file(file) as f:
            for name in names:
                state[model_name[name]] = f.get_tensor(name).to(device=device or "cpu", dtype=dtype, copy=True)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


_NUMBERED = re.compile(r"^(?P<stem>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")
_LISTED = 6  # name lists up to this long are given in full


def count_mismatches(found: set[str], wanted: set[str]) -> list[str]:
    """One line per run of numbered modules (``encoder.blocks.N.*``) whose count differs, e.g.
    ``encoder.blocks: the checkpoint has 2, the config says 27``."""

    def counts(names: set[str]) -> dict[str, int]:
        indices: dict[str, set[str]] = defaultdict(set)
        for name in names:
            if match := _NUMBERED.match(name):
                indices[match["stem"]].add(match["index"])
        return {stem: len(values) for stem, values in indices.items()}

    have, want = counts(found), counts(wanted)
    return [
        f"{stem}: the checkpoint has {have.get(stem, 0)}, the config says {want.get(stem, 0)}"
        for stem in sorted(have.keys() | want.keys())
        if have.get(stem, 0) != want.get(stem, 0)
    ]


def name_lists(**lists: list[str]) -> list[str]:
    """``missing [...]``-style lines for non-empty name lists; long ones summarised by module run."""
    return [f"{label} {summarise_names(names)}" for label, names in lists.items() if names]


def summarise_names(names: list[str]) -> str:
    """``['a', 'b']`` for a few names; for many, the count and each run of numbered modules
    collapsed: ``250 tensors: encoder.blocks.{2..26}.* (250)``."""
    if len(names) <= _LISTED:
        return str(sorted(names))
    runs: dict[str, set[int]] = defaultdict(set)
    sizes: Counter[str] = Counter()
    loose = []
    for name in sorted(names):
        if match := _NUMBERED.match(name):
            runs[match["stem"]].add(int(match["index"]))
            sizes[match["stem"]] += 1
        else:
            loose.append(name)
    parts = [f"{stem}.{{{_index_ranges(runs[stem])}}}.* ({sizes[stem]})" for stem in sorted(runs)]
    parts += loose[:_LISTED] + ([f"... {len(loose) - _LISTED} more"] if len(loose) > _LISTED else [])
    return f"{len(names)} tensors: " + ", ".join(parts)


def _index_ranges(indices: set[int]) -> str:
    """{0, 2, 3, 4, 9} -> ``0,2..4,9``."""
    ordered = sorted(indices)
    runs: list[list[int]] = []
    for index in ordered:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs)


def update_weights_digest(digest: Any, module: nn.Module, prefix: str = "") -> None:
    """Feed every state-dict tensor's name, dtype, shape and bytes, in sorted name order, to ``digest``.

    Two modules give the same digest exactly when their weights are identical.
    """
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{prefix}{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())


def save_pretrained(model: MoonViT, path: str | Path) -> None:
    """Write the model's ``config.json`` and ``model.safetensors`` to the folder ``path``."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder)
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    save_safetensors_atomic(state, folder / SINGLE_FILE)
