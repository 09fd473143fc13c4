"""Writing a tower and its projector back in their release's layout.

What :meth:`MoonViT.save_pretrained(folder, layout="release", projector=...)
<moonvit.model.encoder.MoonViT.save_pretrained>` writes, so that a tower trained or fine-tuned here
goes back where its release loads (Kimi-VL, Kimi-K2.5 / K2.6, Kimi K3, NVIDIA LocateAnything-3B):

- ``config.json`` in the release's form: its ``model_type`` and ``architectures``, the tower's keys
  nested in ``vision_config`` as the release has them (``vt_*`` for K2.5 and K3), the projector's
  where the release keeps them (:func:`moonvit.families.moonvit.release_config_json`, from each
  family's spec; :func:`~.projector.projector_config_to_json`);
- the tensors under the release's names (``vision_tower.*`` + ``multi_modal_projector.*``,
  ``mm_projector.*``; ``vision_model.*`` + ``mlp1.*``), the inverse of the maps the loaders read
  them through, in ``model.safetensors`` or, past a size, shards and their index
  (:func:`~.storage.write_tensor_files`).

The family is the tower's (K3's switches, K2.5's temporal table, else Kimi-VL's), LocateAnything's
for a Kimi-VL tower with an ``mlp1`` projector (:func:`moonvit.families.moonvit.release_family`). The
language model is not part of it: the folder holds what this package trains, under the names the
release's own shards give them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..files import write_text_atomic
from ..model.projector import CONFIG_FILE, WEIGHTS_FILE
from .projector import projector_config_from_json, projector_config_to_json, release_projector_layout
from .storage import DEFAULT_MAX_SHARD_BYTES, write_tensor_files

if TYPE_CHECKING:
    from ..model.config import MoonViTConfig
    from ..model.encoder import MoonViT
    from ..model.projector import MoonViTProjector, ProjectorConfig

__all__ = ["release_config", "release_family", "release_tensors", "save_release"]

# Settings of a run, not of the weights: no checkpoint carries them (the loader's arguments set them).
_RUNTIME_FIELDS = ("attn_implementation", "drop_path_rate")


def release_family(encoder: MoonViTConfig, projector: ProjectorConfig | None = None) -> str:
    """The release a tower (and its projector) is saved as: ``kimi-k3`` for a tower with K3's switches,
    ``kimi-k25`` for one with a temporal table, else ``kimi-vl``, or ``locateanything`` for that
    tower with an ``mlp1`` projector (the rule: :func:`moonvit.families.moonvit.release_family`)."""
    from ..families.moonvit import release_family as family_of  # the families build on this package

    return family_of(encoder, None if projector is None else projector.projector_type)


def release_config(encoder: MoonViTConfig, projector: ProjectorConfig | None, family: str) -> dict[str, Any]:
    """The ``config.json`` of a ``family`` release holding ``encoder`` (and ``projector``).

    Raises:
        ValueError: a setting that release's config has no key for and that differs from the value
            it reads as (a Kimi-VL tower's ``rope_theta``, K2.5's ``layer_norm_eps``, a Kimi-VL
            projector's eps), or a projector no such release holds, named.
    """
    from ..families.moonvit import release_config_json

    values = release_config_json(encoder, family)
    if projector is not None:
        for key, part in projector_config_to_json(projector, family).items():
            values[key] = {**values.get(key, {}), **part} if isinstance(part, dict) else part
    _check_reads_back(values, encoder, projector, family)
    return values


def _check_reads_back(
    values: dict[str, Any], encoder: MoonViTConfig, projector: ProjectorConfig | None, family: str
) -> None:
    """Read ``values`` back through the loaders' config readers; refuse any field that comes back changed."""
    from ..families.moonvit import moonvit_family

    read_as = moonvit_family(values)  # as the loader reads it, with no tensors to tell layouts apart
    read, read_family = read_as.read(values, Path("config.json"), ())[0], read_as.name
    runtime = {name: getattr(encoder, name) for name in _RUNTIME_FIELDS}
    changed = _changed_fields(encoder, dataclasses.replace(read, **runtime))
    if projector is not None:
        read_projector = projector_config_from_json(values, Path("."))
        changed += [f"projector {name}" for name in _changed_fields(projector, read_projector)]
    if changed or read_family != family:
        raise ValueError(
            f"a {family} release's config.json cannot hold this model: {'; '.join(changed) or 'its family'} "
            f"(read back as {read_family}); save it in this package's layout instead"
        )


def _changed_fields(before: Any, after: Any) -> list[str]:
    """``name: before -> after`` for each dataclass field that differs."""
    return [
        f"{field.name} {getattr(before, field.name)!r} reads back as {getattr(after, field.name)!r}"
        for field in dataclasses.fields(before)
        if getattr(before, field.name) != getattr(after, field.name)
    ]


def release_tensors(encoder: MoonViT, projector: MoonViTProjector | None, family: str) -> dict[str, torch.Tensor]:
    """The tower's and the projector's tensors under a ``family`` release's names, tower first (CPU,
    detached, in the models' dtypes)."""
    state = {name: tensor.detach().cpu() for name, tensor in encoder.state_dict().items()}
    from ..families.moonvit import release_tower_layout

    tensors = release_tower_layout(family).checkpoint_tensors(state)
    if projector is not None:
        layout = release_projector_layout(family, projector.config.projector_type)
        tensors.update(
            {layout.checkpoint_name(name): tensor.detach().cpu() for name, tensor in projector.state_dict().items()}
        )
    return tensors


def save_release(
    folder: str | Path,
    encoder: MoonViT,
    projector: MoonViTProjector | None = None,
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Write ``encoder`` (and ``projector``) into ``folder`` in their release's layout (see the module
    docstring); returns the family written. :meth:`MoonViT.from_pretrained` and
    :meth:`MoonViTProjector.from_pretrained` read the folder back to the same weights and configs.

    This package's projector files in the folder (``projector_config.json``, ``projector.safetensors``),
    which its loader would read in preference to the release's, are removed, and so are the tensor
    files of an earlier save that these replace. A LocateAnything tower needs its projector: without
    one the folder is a Kimi-VL release's tower.

    Raises:
        ValueError: a model the family's release cannot hold as it is (see :func:`release_config`).
    """
    target = Path(folder)
    family = release_family(encoder.config, None if projector is None else projector.config)
    config = release_config(encoder.config, None if projector is None else projector.config, family)
    config["torch_dtype"] = str(encoder.dtype).removeprefix("torch.")
    tensors = release_tensors(encoder, projector, family)
    target.mkdir(parents=True, exist_ok=True)
    for own in (CONFIG_FILE, WEIGHTS_FILE):
        (target / own).unlink(missing_ok=True)
    write_tensor_files(target, tensors, max_shard_bytes)
    write_text_atomic(target / "config.json", json.dumps(config, indent=2) + "\n")
    return family
