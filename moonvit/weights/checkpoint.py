"""Reading and writing MoonViT checkpoints.

Read from a local folder (or a Hugging Face hub id, fetched by :mod:`.hub` into
its cache first, only the files needed), in safetensors or torch pickle files
(``pytorch_model.bin``, memory-mapped; see :mod:`.storage`):

- Kimi-VL's and Kimi-K2.5 / K2.6's releases: ``config.json`` with a
  ``vision_config`` and tensors named ``vision_tower.<name>``, usually sharded
  beside a large language model (``model.safetensors.index.json``). Only the
  shards that hold vision tensors are opened, and only those tensors are read.
- transformers' ``kimi_k25`` folders, in its native tensor names or in the
  hybrid names its ``save_pretrained`` writes (see :mod:`moonvit.weights.formats`).
- NVIDIA LocateAnything-3B's release: ``model_type "locateanything"``, the same tower
  tensors under ``vision_model.``, beside its projector ``mlp1.*`` and the language model.
- This project's own (also MoonViT-SO-400M's standalone layout): ``config.json``
  with the encoder fields at the top level and unprefixed tensor names in
  ``model.safetensors``, which :func:`save_pretrained` writes (and, with ``layout="release"``,
  the releases' layouts above: :mod:`.release`).

Module names in :class:`~moonvit.model.encoder.MoonViT` equal Kimi-VL's names without
the ``vision_tower.`` prefix, so the release layouts need no renaming.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.nn as nn

from ..devices import check_device
from ..files import folder_problem
from ..model.config import DictConfig
from .config_keys import warn_unread_keys
from .formats import TOWER_PREFIXES, TensorLayoutError, TensorSource, TowerLayout
from .storage import (
    CheckpointError,
    open_tensor_file,
    read_json,
    tensor_files,
    tensor_names,
    write_tensor_files,
)

if TYPE_CHECKING:
    from ..model.encoder import MoonViT
    from ..model.projector import MoonViTProjector
    from ..model.tower import PackedTower
    from .hub import HubSnapshot

C = TypeVar("C", bound=DictConfig)


def config_from_file(cls: type[C], values: dict[str, Any], path: Path, also_read: Iterable[str] = ()) -> C:
    """``cls.from_dict(values)``, read from the file ``path``: keys it does not read are named in
    a warning, and invalid values raise :class:`CheckpointError` naming the file."""
    warn_unread_keys(path, values, {*(f.name for f in dataclasses.fields(cls)), *also_read})  # type: ignore[arg-type]
    try:
        return cls.from_dict(values)
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: {err}") from err


def read_config(folder: Path) -> tuple[Any, Any]:
    """The tower config of a checkpoint folder and the layout of its tensors, read by the registered
    family that claims its ``config.json`` (:func:`moonvit.families.find_family`: the MoonViT families,
    :mod:`moonvit.families.moonvit`, and the classic ViT and DeiT).

    Raises:
        CheckpointError: no config.json, or one no family reads (naming the file), or tensors that do
            not fit it (naming the folder).
    """
    from ..families import find_family  # the families build on this package

    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json")
    values = read_json(path)
    family = find_family(values)
    if family is None:
        raise CheckpointError(f"{path}: no registered checkpoint family reads this config.json")
    try:
        return family.read(values, path, _FolderTensorNames(folder))
    except CheckpointError:
        raise  # the tensor files themselves (an index naming a missing shard, ...), already named
    except TensorLayoutError as error:
        raise CheckpointError(f"{folder}: {error}") from error
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{path}: {error}") from error


class _FolderTensorNames(Collection[str]):
    """A folder's tensor names, read on first use: a family whose layout needs none (this package's
    own) never opens its tensor files; none before a hub snapshot has them."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._names: list[str] | None = None
        self._set: frozenset[str] = frozenset()

    def _read(self) -> list[str]:
        if self._names is None:
            self._names = tensor_names(self._folder)
            self._set = frozenset(self._names)
        return self._names

    def __contains__(self, name: object) -> bool:
        self._read()
        return name in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def tower_builder(config: Any, cls: Callable[[Any], nn.Module]) -> Callable[[Any], nn.Module]:
    """What builds the tower of ``config`` when a loader of ``cls`` reads it: ``cls`` itself where it
    builds that family's towers (the family's class, or a subclass of it), else the family's own
    (a classic ViT's folder read through ``MoonViT.from_pretrained``)."""
    from ..families import families

    build = next((family.build for family in families() if isinstance(config, family.config_type)), None)
    if build is None or (isinstance(cls, type) and isinstance(build, type) and issubclass(cls, build)):
        return cls
    return build


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
    _, layout = read_config(snapshot.file("config.json").parent)
    # Before the index is here, the layout of a Kimi family is not known: fetch any tower tensor.
    # A registered family's layout names its own prefix ("" for all: a ViT's head sits outside its tower).
    if not isinstance(layout, TowerLayout):
        prefix = layout.prefix  # one prefix, or several (OpenVLA's backbone and projector)
        snapshot.tensors(*(prefix if isinstance(prefix, tuple) else (prefix,)))
    else:
        snapshot.tensors(*(("",) if layout.name == "own" else TOWER_PREFIXES))


def load_pretrained(
    cls: Callable[[Any], nn.Module],
    path: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "auto",
) -> nn.Module:
    """Build ``cls`` (or, for a registered family's folder, that family's tower) from a checkpoint folder
    or hub id, reading only the vision tensors (see :func:`assign_from_files`)."""
    if device is not None:
        device = check_device(device)
    folder = checkpoint_folder(path, fetch_encoder_files)
    config, layout = read_config(folder)
    config.attn_implementation = attn_implementation
    # A registered family's folder builds its own tower (a classic ViT read through MoonViT.from_pretrained).
    build = tower_builder(config, cls)
    with torch.device("meta"):
        model = build(config)
    files = tensor_files(folder, layout.prefix)
    unused = getattr(layout, "unused", None)  # tensors a layout knows the tower does not read (DINOv2's mask token)
    if unused is not None:
        files = {file: [name for name in names if not unused(name)] for file, names in files.items()}
    return assign_from_files(model, files, layout.source, folder, dtype, device)


M = TypeVar("M", bound=nn.Module)


def load_tower(
    cls: type[M],
    path: str | Path,
    what: str,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str = "auto",
) -> M:
    """:func:`load_pretrained` of a family's own tower class ``cls``, which the folder must hold.

    Raises:
        TypeError: the folder holds another family's tower (the message says it is not ``what``).
    """
    model = load_pretrained(cls, path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    if not isinstance(model, cls):
        raise TypeError(f"{path} holds a {type(model).__name__}, not {what}")
    return model


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
            f"{folder} does not match the {type(model).__name__} config: "
            + "; ".join(
                [
                    *count_mismatches(found, set(needed)),
                    *name_lists(missing=missing, unexpected=unexpected),
                    *family_hints(missing, unexpected, set(needed)),
                ]
            )
        )
    with ExitStack() as stack:  # each file opened once (a legacy torch pickle is read whole)
        opened = {file: stack.enter_context(open_tensor_file(file)) for file in files}
        wrong_shape = []
        for file, names in files.items():
            for ckpt in names:
                name, part = needed[ckpt]
                shape, wanted = opened[file].shape(ckpt), sources[name].part_shape(params[name].shape, part)
                if shape != wanted:
                    wrong_shape.append(f"{ckpt}: {shape}, expected {wanted}")
        if wrong_shape:
            shown = "; ".join(wrong_shape[:3]) + ("; ..." if len(wrong_shape) > 3 else "")
            raise CheckpointError(
                f"{folder} has {len(wrong_shape)} tensors of the wrong shape for the config (are its widths "
                f"those of the checkpoint?): {shown}"
            )

        if dtype is None:
            first_matrix = sources[next(name for name, p in params.items() if p.ndim >= 2)].names[0]
            dtype = opened[next(file for file, names in files.items() if first_matrix in names)].dtype(first_matrix)
        # Both formats map the file lazily; copy each tensor out so the model never
        # aliases the file (which a later save to the same folder would overwrite).
        parts: dict[str, dict[int, torch.Tensor]] = defaultdict(dict)
        for file, names in files.items():
            for ckpt in names:
                name, i = needed[ckpt]
                parts[name][i] = opened[file].tensor(ckpt).to(device=device or "cpu", dtype=dtype, copy=True)
    state = {name: sources[name].combine([parts[name][i] for i in range(len(sources[name].names))]) for name in params}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def _as_source(source: str | TensorSource) -> TensorSource:
    return TensorSource((source,)) if isinstance(source, str) else source


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


def family_hints(missing: list[str], unexpected: list[str], needed: set[str]) -> list[str]:
    """What a mismatch of all the biases and nothing else says: weights of one family read with
    another's config (Kimi K3's layers have no biases; Kimi-VL's and K2.5's do). One missing bias
    is a damaged file, not a family, and gets no hint."""
    hints = []
    biases = {name for name in needed if name.endswith(".bias")}
    if missing and set(missing) == biases:
        hints.append(
            "the checkpoint has no biases where the config expects them: is it a Kimi K3 (MoonViT-V2) tower "
            "read with a Kimi-VL / K2.5 config? (K3's config sets attn_bias, linear_bias, patch_embed_proj_bias false)"
        )
    if unexpected and all(name.endswith(".bias") for name in unexpected):
        hints.append(
            "the checkpoint has biases the config does not expect: is it a Kimi-VL / K2.5 tower read with a "
            "Kimi K3 (MoonViT-V2) config?"
        )
    return hints


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


SAVE_LAYOUTS = ("own", "release")
"""The layouts :func:`save_pretrained` writes."""


def save_own(model: PackedTower, path: str | Path) -> None:
    """Write ``model`` in this package's own layout into the folder ``path``: its config's ``config.json``
    and one ``model.safetensors`` under the module's own names (any tower class; the tensor files of an
    earlier save that this replaces removed, see :func:`~.storage.write_tensor_files`)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save(folder)
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    write_tensor_files(folder, state, max_shard_bytes=None)


def save_pretrained(
    model: MoonViT, path: str | Path, layout: str = "own", projector: MoonViTProjector | None = None
) -> None:
    """Write the model (and ``projector``) to the folder ``path`` in ``layout``.

    ``"own"``: this package's ``config.json`` and ``model.safetensors`` (the projector's own two files
    beside them). ``"release"``: the release's ``config.json`` and tensor names, the projector's among
    them (:func:`moonvit.weights.release.save_release`). Either way the tensor files of an earlier save
    that these replace are removed (see :func:`~.storage.write_tensor_files`).

    Raises:
        ValueError: an unknown ``layout``, or a model its release cannot hold as it is.
    """
    if layout not in SAVE_LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(SAVE_LAYOUTS)}")
    if layout == "release":
        from .release import save_release  # it reads projectors, which build on this module

        save_release(path, model, projector)
        return
    save_own(model, path)
    if projector is not None:
        projector.save_pretrained(path)
