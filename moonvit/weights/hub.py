"""Hugging Face hub ids for the loaders: only the files a loader reads, fetched into the hub cache.

``MoonViT.from_pretrained``, ``MoonViTProjector.from_pretrained`` and
``MoonViTImageProcessor.from_pretrained`` take a local path or a hub id (``owner/name``). A path
that exists always wins. For an id, :func:`resolve_pretrained` hands the loader's fetch function a
:class:`HubSnapshot`, which fetches the small files first (``config.json``, the safetensors index)
and then only the shards that hold the tensors the loader reads: for Kimi-VL the vision tower's
(and the projector's), never the language model's, which for a Kimi-K2.5-size checkpoint is the
difference between about 1 GB and hundreds. Files go through ``huggingface_hub``'s cache
(``HF_HOME`` / ``HF_HUB_CACHE``), so a second load downloads nothing, and ``HF_HUB_OFFLINE=1``
reads the cache alone. The loader then reads the snapshot folder like any local folder.

Needs ``huggingface_hub`` (``pip install "moonvit[hub]"``); local folders do not.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from .storage import WEIGHT_FILES, CheckpointError, read_weight_map

__all__ = ["HubSnapshot", "is_hub_id", "resolve_pretrained", "source_label"]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


def is_hub_id(source: object) -> bool:
    """Whether ``source`` is spelt like a hub model id, ``owner/name`` (a ``str``; paths never are)."""
    return (
        isinstance(source, str)
        and _HUB_ID.fullmatch(source) is not None
        and ".." not in source
        and "--" not in source
        and not source.endswith(".git")
    )


def source_label(source: str | os.PathLike) -> str:
    """How to record where weights came from: an existing path made absolute, a hub id as given."""
    return str(source) if is_hub_id(source) and not Path(source).exists() else str(Path(source).resolve())


class _NotCached(Exception):
    """A file whose presence in the repository cannot be known: offline (or the hub unreachable)
    and neither the file nor its absence is in the cache."""


class HubSnapshot:
    """One revision of a hub repository, fetched file by file into the hub cache.

    The first file fetched pins the revision to its commit, so every later file comes from the
    same snapshot folder (:attr:`folder`).
    """

    def __init__(self, repo_id: str, revision: str | None = None) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.folder: Path | None = None

    def file(self, name: str) -> Path:
        """The local path of the repository's file ``name``.

        Raises:
            CheckpointError: the repository has no such file, or it is not in the cache and the
                hub cannot be reached (offline).
        """
        try:
            path = self._fetch(name)
        except _NotCached as error:
            raise CheckpointError(str(error)) from None
        if path is None:
            raise CheckpointError(f"hub repository {self.repo_id} has no {name}")
        return path

    def optional_file(self, name: str, *, unknown: Literal["error", "absent"] = "error") -> Path | None:
        """Like :meth:`file`, but None when the repository has no such file.

        ``unknown`` says what to do offline when neither the file nor its absence is cached:
        ``"error"`` (when guessing could silently change results) or ``"absent"``.
        """
        try:
            return self._fetch(name)
        except _NotCached as error:
            if unknown == "absent":
                return None
            raise CheckpointError(str(error)) from None

    def tensors(self, *prefixes: str) -> None:
        """Fetch the tensor files that hold names starting with any of ``prefixes`` ("" for all):
        through an index when the repository has one, else its single file; safetensors first,
        then torch pickles (``pytorch_model.bin``), as the loaders prefer them."""
        for index_name, single_name in WEIGHT_FILES:
            try:
                index = self._fetch(index_name)
            except _NotCached:
                if self._cached(single_name) is None:
                    raise CheckpointError(
                        f"neither {index_name} nor {single_name} of hub repository {self.repo_id} is in the "
                        f"hub cache, and the hub cannot be reached{self._offline_hint()}"
                    ) from None
                index = None
            if index is not None:
                shards = {file for name, file in read_weight_map(index).items() if name.startswith(prefixes)}
                for shard in sorted(shards):
                    self.file(shard)
                return
            if self.optional_file(single_name) is not None:
                return
        names = ", ".join(name for pair in WEIGHT_FILES for name in pair)
        raise CheckpointError(f"hub repository {self.repo_id} has none of {names}")

    # ---- huggingface_hub -----------------------------------------------------------------------

    def _fetch(self, name: str) -> Path | None:
        hub = _hub()
        try:
            path = Path(hub.hf_hub_download(self.repo_id, name, revision=self.revision))
        except hub.errors.LocalEntryNotFoundError:
            if self._cached(name) is hub._CACHED_NO_EXIST:
                return None
            raise _NotCached(
                f"{name} of hub repository {self.repo_id} is not in the hub cache, and the hub cannot be "
                f"reached{self._offline_hint()}"
            ) from None
        except hub.errors.EntryNotFoundError:  # the hub answered: no such file
            return None
        except hub.errors.RevisionNotFoundError:
            raise CheckpointError(f"hub repository {self.repo_id} has no revision {self.revision}") from None
        except hub.errors.RepositoryNotFoundError:
            raise CheckpointError(
                f"no hub repository {self.repo_id} that you can access (private or gated ones need `hf auth login`)"
            ) from None
        except (hub.errors.HfHubHTTPError, OSError, ValueError) as error:
            raise CheckpointError(f"cannot fetch {name} of hub repository {self.repo_id}: {error}") from error
        if self.folder is None:
            # .../snapshots/<commit>/<name>: pin the revision so every file comes from this commit.
            self.folder = path.parents[len(Path(name).parts) - 1]
            self.revision = self.folder.name
        return path

    def _cached(self, name: str) -> Any:
        """The cache's knowledge of ``name``: its path, ``_CACHED_NO_EXIST``, or None."""
        return _hub().try_to_load_from_cache(self.repo_id, name, revision=self.revision)

    @staticmethod
    def _offline_hint() -> str:
        return " (HF_HUB_OFFLINE is set)" if _hub().constants.HF_HUB_OFFLINE else ""


def resolve_pretrained(source: str | os.PathLike, fetch: Callable[[HubSnapshot], None]) -> Path:
    """The local path to load ``source`` from.

    A path that exists, and anything not spelt as a hub id, is returned unchanged (the loader
    says what is wrong with it). A hub id is resolved with ``fetch``, which asks the
    :class:`HubSnapshot` for the files the loader reads; the snapshot folder is returned.

    Raises:
        CheckpointError: ``huggingface_hub`` is missing, or fetching failed (see :class:`HubSnapshot`).
    """
    if not is_hub_id(source) or Path(source).exists():
        return Path(source)
    snapshot = HubSnapshot(str(source))
    try:
        fetch(snapshot)
    except CheckpointError as error:
        raise CheckpointError(f"{source} is not a local path, and as a hub id: {error}") from error
    if snapshot.folder is None:
        raise CheckpointError(f"nothing was fetched from hub repository {source}")
    return snapshot.folder


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
    except ImportError:
        raise CheckpointError(
            'loading from a hub id needs huggingface_hub: pip install "moonvit[hub]" (or pass a local folder)'
        ) from None
    return huggingface_hub
