"""Each image encoded once: duplicates within a run, and a content-addressed token store across runs.

Both are engine-neutral helpers: an engine plans with :func:`duplicate_sources` (from the planned
list, in input order, so every rank and every engine computes the same plan) and reads and writes
tokens through a :class:`TokenCache`.

Cache layout (``--cache DIR``)::

    DIR/<settings digest>/settings.json          the settings below, readable
    DIR/<settings digest>/<ab>/<sha256>.safetensors   one image's tokens (<ab>: the hash's first 2 hex)

The settings digest is the SHA-256 of the canonical JSON of :func:`cache_settings`: everything in
``run.json`` that an image's tokens depend on: the cache format, the package's version, the
weights' hash (encoder, and projector when projected tokens are stored), the encoder's and the
projector's resolved configs, the processor's ``to_dict()``, the dtype, the stored kinds, the
per-image rows stored beside them (a ViT tower's ``prefix_tokens`` and ``pooled``), the max
patches per pack (an image over it is scaled down) and the compute description (threads, torch
version, device type, CPU kernel level, the host's bf16 units and Pillow, the attention
backend). An entry holds one tensor per stored kind, each (n, ...) for the image's n tokens,
and, for such a tower, its prefix rows as ``prefix_tokens`` (1, n_prefix, D) and its pooled
vector as ``pooled`` (1, D); as metadata, the
settings digest, the content hash and the SHA-256 of its tensors' bytes; an entry whose
metadata or bytes do not match is a miss (counted as corrupt), and is encoded again and
rewritten. Entries are written atomically (temporary name, rename), so concurrent writers of the
same entry are harmless.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moonvit.files import save_safetensors_atomic, write_text_atomic

from ..token_folder import PER_IMAGE_ROWS
from .plan import ExportItem

__all__ = [
    "CACHE_FORMAT",
    "OPTIONAL_TOKEN_SETTINGS",
    "TOKEN_SETTINGS",
    "TokenCache",
    "cache_settings",
    "cacheable",
    "duplicate_sources",
    "tokens_sha256",
]

CACHE_FORMAT = "moonvit-export-cache/1"


def cacheable(entry: ExportItem) -> bool:
    """An image planned for export (one item, not a video chunk) with a content hash."""
    return entry.reason is None and entry.sha256 is not None and len(entry.items) == 1 and entry.items[0].chunk is None


def duplicate_sources(planned: Sequence[ExportItem]) -> dict[int, int]:
    """Input position of each later copy of an image -> the position of its first copy (same
    content hash), planned from the listing in order: the first occurrence is the one encoded."""
    first: dict[str, int] = {}
    sources: dict[int, int] = {}
    for position, entry in enumerate(planned):
        if not cacheable(entry):
            continue
        assert entry.sha256 is not None
        if entry.sha256 in first:
            sources[position] = first[entry.sha256]
        else:
            first[entry.sha256] = position
    return sources


TOKEN_SETTINGS = ("moonvit_version", "models", "processor", "dtype", "store", "compute")
"""The keys of ``run.json`` that an image's tokens depend on (beside the weights' hash and the
pack budget); the rest (inputs, shard size, the checkpoint's path) only place them in a folder."""
OPTIONAL_TOKEN_SETTINGS = tuple(PER_IMAGE_ROWS)
"""Keys of ``run.json`` that only some exports have (a ViT tower's ``prefix_tokens`` and ``pooled``,
each describing its per-image tensor of the same name), part of the cache key where present."""


def cache_settings(run: Mapping[str, Any]) -> dict[str, Any]:
    """What an image's tokens depend on besides its bytes, taken from the run's description
    (``run.json``, :func:`.run.describe_run`): the key of a cache folder."""
    settings = {
        "format": CACHE_FORMAT,
        "weights_sha256": run["checkpoint"]["sha256"],
        "max_patches_per_pack": run["arguments"]["max_patches_per_pack"],
        **{key: run[key] for key in TOKEN_SETTINGS},
        **{key: run[key] for key in OPTIONAL_TOKEN_SETTINGS if key in run},
    }
    return dict(json.loads(json.dumps(settings)))


def tokens_sha256(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the tensors' names, dtypes, shapes and bytes, by name."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class TokenCache:
    """The tokens of images by content hash, for one settings digest (see the module docstring)."""

    def __init__(self, root: Path, settings: Mapping[str, Any]) -> None:
        self.settings = dict(settings)
        self.digest = hashlib.sha256(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()
        self.folder = Path(root) / self.digest
        self.kinds = tuple(self.settings["store"])
        # a ViT tower: each entry also holds its image's (1, n_prefix, D) prefix rows and (1, D) pooled vector
        self.per_image = tuple(name for name in PER_IMAGE_ROWS if name in self.settings)
        self.corrupt = 0
        """Entries found damaged (or made for other settings under this digest) and so encoded again."""

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors of an entry: the stored kinds, and the per-image rows where the tower has them."""
        return (*self.kinds, *self.per_image)

    def path(self, sha256: str) -> Path:
        return self.folder / sha256[:2] / f"{sha256}.safetensors"

    def load(self, sha256: str) -> dict[str, torch.Tensor] | None:
        """The stored tokens of the image with this content hash, or None (a miss: absent, or an
        entry that fails its checks, counted in :attr:`corrupt`)."""
        return self._read(sha256, tensors=True)

    def has(self, sha256: str) -> bool:
        """Whether a valid-looking entry for this content hash is there, from its header alone
        (its settings, hash, kinds and lengths; the tensors' bytes are checked when :meth:`load`
        reads them). A damaged header counts in :attr:`corrupt`, as in :meth:`load`."""
        return self._read(sha256, tensors=False) is not None

    def _read(self, sha256: str, tensors: bool) -> dict[str, torch.Tensor] | None:
        """The entry's tensors (none read unless ``tensors``: an empty dict) when it passes its checks."""
        path = self.path(sha256)
        if not path.is_file():
            return None
        loaded: dict[str, torch.Tensor] = {}
        try:
            with safe_open(path, framework="pt") as handle:
                metadata = handle.metadata() or {}
                lengths = {name: handle.get_slice(name).get_shape()[0] for name in handle.keys()}  # noqa: SIM118
                if tensors:
                    loaded = {name: handle.get_tensor(name) for name in lengths}
            tokens = {length for name, length in lengths.items() if name not in self.per_image}
            valid = (
                metadata.get("settings") == self.digest
                and metadata.get("sha256") == sha256
                and set(lengths) == set(self.names)
                and len(tokens) == 1
                and all(lengths[name] == 1 for name in self.per_image)
                and (not tensors or metadata.get("tokens_sha256") == tokens_sha256(loaded))
            )
        except Exception:  # a truncated or garbled file: any error of the reader
            valid = False
        if not valid:
            self.corrupt += 1
            return None
        return loaded

    def discard(self, sha256: str) -> None:
        """Remove the entry of this content hash (one found damaged), so that it is encoded again."""
        self.path(sha256).unlink(missing_ok=True)

    def save(self, sha256: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store one image's tokens (each kind (n, ...); the prefix rows (1, n_prefix, D) and pooled vector
        (1, D) where the tower has them) atomically."""
        settings_file = self.folder / "settings.json"
        if not settings_file.is_file():
            self.folder.mkdir(parents=True, exist_ok=True)
            write_text_atomic(settings_file, json.dumps(self.settings, indent=2, sort_keys=True) + "\n")
        stored = {name: tensors[name].contiguous() for name in self.names}
        path = self.path(sha256)
        path.parent.mkdir(parents=True, exist_ok=True)
        metadata = {"settings": self.digest, "sha256": sha256, "tokens_sha256": tokens_sha256(stored)}
        save_safetensors_atomic(stored, path, metadata=metadata)
