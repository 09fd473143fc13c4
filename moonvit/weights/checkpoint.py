"""Reading and writing MoonViT checkpoints.

Read from a local folder:

- Kimi-VL's and Kimi-K2.5 / K2.6's releases: ``config.json`` with a
  ``vision_config`` and tensors named ``vision_tower.<name>``, usually sharded
  beside a large language model (``model.safetensors.index.json``). Only the
  shards that hold vision tensors are opened, and only those tensors are read.
- transformers' ``kimi_k25`` folders, in its native tensor names or in the
  hybrid names its ``save_pretrained`` writes (see :mod:`moonvit.weights.formats`).
- This project's own (also MoonViT-SO-400M's standalone layout): ``config.json``
  with the encoder fields at the top level and unprefixed tensor names in
  ``model.safetensors``, which :func:`save_pretrained` writes.

Module names in :class:`~moonvit.model.encoder.MoonViT` equal Kimi-VL's names without
the ``vision_tower.`` prefix, so the release layouts need no renaming.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn
from safetensors import safe_open

from ..files import save_safetensors_atomic
from ..model.config import MoonViTConfig
from .formats import TensorSource, TowerLayout, detect_tower_layout, encoder_config_from_json

if TYPE_CHECKING:
    from ..model.encoder import MoonViT

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as it stands."""


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from err


def read_config(folder: Path) -> tuple[MoonViTConfig, TowerLayout]:
    """The encoder config of a checkpoint folder and the layout of its tower tensors
    (see :mod:`moonvit.weights.formats` for the families read)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    try:
        config, family = encoder_config_from_json(read_json(path), str(path))
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error
    has_tensors = (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()
    names = [] if family == "own" or not has_tensors else [n for ns in tensor_files(folder, "").values() for n in ns]
    return config, detect_tower_layout(names, family, config.num_attention_heads)


def tensor_files(folder: Path, prefix: str) -> dict[Path, list[str]]:
    """Map each safetensors file that holds tensors under ``prefix`` to those names."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files: dict[Path, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            if name.startswith(prefix):
                files[folder / file].append(name)
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index} names {file.name}, which is not in {folder}")
        return dict(files)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with safe_open(single, framework="pt") as f:
        return {single: [name for name in f.keys() if name.startswith(prefix)]}  # noqa: SIM118 (a safe_open handle, not a dict)


def load_pretrained(
    cls: type[MoonViT],
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "auto",
) -> MoonViT:
    """Build ``cls`` from a checkpoint folder, reading only the vision tensors (see :func:`assign_from_files`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    config, layout = read_config(folder)
    config.attn_implementation = attn_implementation
    with torch.device("meta"):
        model = cls(config)
    return assign_from_files(model, tensor_files(folder, layout.prefix), layout.source, folder, dtype, device)


M = TypeVar("M", bound=nn.Module)


def assign_from_files(
    model: M,
    files: dict[Path, list[str]],
    checkpoint_name: Callable[[str], str | TensorSource],
    folder: Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> M:
    """Give a model built on the meta device its parameters from safetensors files.

    Args:
        model: built under ``torch.device("meta")``.
        files: each file and the checkpoint names to take from it; together they
            must be exactly the model's parameters.
        checkpoint_name: the checkpoint's name of each state-dict entry, or the
            :class:`TensorSource` it is assembled from.
        dtype: defaults to the checkpoint dtype of the model's first matrix.

    Only the listed tensors are read, one copy each, so peak memory is about
    one copy of the model. Returns the model in eval mode.

    Raises:
        CheckpointError: tensors missing, unexpected or of the wrong shape, all named.
    """
    params = model.state_dict()
    sources = {name: _as_source(checkpoint_name(name)) for name in params}
    # checkpoint name -> (state-dict entry, part of it)
    needed = {ckpt: (name, i) for name, source in sources.items() for i, ckpt in enumerate(source.names)}
    found = {name for names in files.values() for name in names}
    missing, unexpected = sorted(set(needed) - found), sorted(found - set(needed))
    if missing or unexpected:
        raise CheckpointError(
            f"{folder} does not match the {type(model).__name__} config: missing {missing}, unexpected {unexpected}"
        )
    wrong_shape = []
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            for ckpt in names:
                name = needed[ckpt][0]
                shape, wanted = tuple(f.get_slice(ckpt).get_shape()), sources[name].part_shape(params[name].shape)
                if shape != wanted:
                    wrong_shape.append(f"{ckpt}: {shape}, expected {wanted}")
    if wrong_shape:
        raise CheckpointError(f"{folder} has tensors of the wrong shape: " + "; ".join(wrong_shape))

    if dtype is None:
        first_matrix = sources[next(name for name, p in params.items() if p.ndim >= 2)].names[0]
        file = next(file for file, names in files.items() if first_matrix in names)
        with safe_open(file, framework="pt") as f:
            dtype = f.get_slice(first_matrix)[:1].dtype
    # safetensors maps the file lazily; copy each tensor out so the model never
    # aliases the file (which a later save to the same folder would overwrite).
    parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
    for file, names in files.items():
        with safe_open(file, framework="pt") as f:
            for ckpt in names:
                name, i = needed[ckpt]
                parts[name][i] = f.get_tensor(ckpt).to(device=device or "cpu", dtype=dtype, copy=True)
    state = {name: sources[name].combine([parts[name][i] for i in range(len(sources[name].names))]) for name in params}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _as_source(source: str | TensorSource) -> TensorSource:
    return TensorSource((source,)) if isinstance(source, str) else source


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
