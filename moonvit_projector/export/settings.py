"""The export's settings, typed: what the command line says, as one :class:`ExportRun`."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moonvit.cli import default_device
from moonvit.media.packing import DEFAULT_MAX_PATCHES_PER_PACK

__all__ = ["ENGINES", "STORES", "ExportError", "ExportRun"]

ENGINES = ("local", "ray")
"""``--engine``'s choices."""

STORES = {"merged": ("merged",), "projected": ("projected",), "both": ("merged", "projected")}
"""``--store`` -> the tensor kinds each shard holds."""


class ExportError(RuntimeError):
    """The export cannot start: bad inputs, or an output folder made with other settings."""


@dataclass(frozen=True)
class ExportRun:
    """One export: every setting of ``python -m moonvit_projector.export`` (see
    :func:`moonvit_projector.export.cli.build_parser`)."""

    inputs: Path
    """Image folder, text file of paths, or JSONL of ``{id, path}`` lines."""
    checkpoint: str
    """Folder or hub id with the encoder, projector and preprocessor_config.json."""
    out: Path
    """Output folder (resumed if it holds this run)."""
    store: str = "projected"
    """A key of :data:`STORES`."""
    dtype: str = "bf16"
    """Compute and storage dtype, by short name (bf16, fp16, fp32)."""
    max_patches_per_pack: int = DEFAULT_MAX_PATCHES_PER_PACK
    """The patch budget of one encoder forward."""
    shard_size: int = 1000
    """Images per shard."""
    side_limit_mode: str | None = None
    """The processor's ``side_limit_mode`` (error, resize), or None for the checkpoint's."""
    image_rule: str | None = None
    """A classic ViT / DeiT folder's processor rule (native, vit, deit), or None for native."""
    device: str = field(default_factory=default_device)
    """cpu, cuda or cuda:N (each torchrun rank takes cuda:LOCAL_RANK)."""
    attn: str = "auto"
    """The encoder's attention backend (``auto`` or a registered one); ``run.json`` records the one it
    resolves to, in ``compute.attention``."""
    threads: int | None = None
    """torch CPU threads per process, or None for torch's choice."""
    workers: int = 0
    """Threads decoding the next packs while one encodes (the same bytes as 0)."""
    cache: Path | None = None
    """Content-addressed token store (:mod:`moonvit_projector.export.cache`), or None; not run-defining."""
    engine: str = "local"
    """``local`` (this process, or torchrun's ranks) or ``ray`` (:mod:`moonvit_projector.export.ray_engine`);
    not run-defining: both write the same bytes."""
    encoder_actors: int = 1
    """``--engine ray``: encoder actors (one GPU each on CUDA)."""
    ray_address: str | None = None
    """``--engine ray``: the cluster to join (``auto`` or ``host:port``); None starts a local Ray."""
    projector_from: str | None = None
    """Folder or hub id to read the projector from instead of ``checkpoint`` (a fine-tuned tower's folder
    may hold none); None: the checkpoint's. ``run.json`` records it, its weights are in the hash."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ExportError(f"engine {self.engine!r}: expected one of {', '.join(ENGINES)}")
        if self.engine != "ray" and (self.encoder_actors != 1 or self.ray_address is not None):
            raise ExportError("--encoder-actors and --ray-address are settings of --engine ray")
        if self.encoder_actors < 1:
            raise ExportError(f"--encoder-actors {self.encoder_actors}: expected at least 1")
        if self.projector_from is not None and self.store == "merged":
            raise ExportError(f"--projector-from is for projected tokens; --store {self.store} stores none")

    @property
    def kinds(self) -> tuple[str, ...]:
        """The tensor kinds stored: ``STORES[store]``."""
        return STORES[self.store]
