"""Writing shards: one shard's tokens and part file (each atomically), then the manifest from the parts.

Shard k is ``shard-{k:06d}.safetensors`` (one tensor per stored kind, the images' tokens back to
back; for a tower with prefix tokens (ViT, DeiT, DINOv2) also ``prefix_tokens`` (images, n_prefix, D),
and for a tower with a pooled output (every ViT tower) ``pooled`` (images, D), one row per image each,
named by the line's ``prefix_row`` / ``pooled_row``) and
``parts/shard-{k:06d}.json`` (its manifest lines and failures). The shard is renamed into
place before its part, so a shard is done exactly when its part exists.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from moonvit import PackItem
from moonvit.encode import EncodedPack, encode_processed, processed_packs
from moonvit.files import save_safetensors_atomic, write_text_atomic
from moonvit.media.packing import Pack, group_into_packs
from moonvit.names import path_record

from ..token_folder import FAILURES_FILE, MANIFEST_FILE, PARTS_DIR, PER_IMAGE_ROWS, POOLED_TENSOR, PREFIX_TENSOR
from .cache import TokenCache, cacheable
from .models import Models
from .plan import ExportItem
from .settings import ExportError

__all__ = [
    "Key",
    "ShardResult",
    "ShardWork",
    "assemble",
    "export_shard",
    "finish_shard",
    "item_id",
    "manifest_counts",
    "manifest_line",
    "part_path",
    "shard_name",
    "shard_work",
    "stored_tensors",
]


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def part_path(out: Path, index: int) -> Path:
    return out / PARTS_DIR / f"shard-{index:06d}.json"


@dataclass
class ShardResult:
    """One shard's manifest lines and failures, in input order. A later copy of an image encoded
    earlier in the run is a line ``{id, path, duplicate_of: <first copy's id>}`` until
    :func:`assemble` completes it from the first copy's line."""

    images: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    data_s: float = 0.0
    """Seconds the encoder loop waited for decoded packs (all of the decoding when it is inline)."""
    encoded: int = 0
    """Items encoded by this shard's forwards."""
    duplicates: int = 0
    """Later copies of an image, not encoded."""
    cached: int = 0
    """Images whose tokens came from the cache."""
    packs_done: list[tuple[float, int]] = field(default_factory=list)
    """(``time.perf_counter()`` when a pack's result came in, its items), pack by pack."""

    @property
    def num_tokens(self) -> int:
        return sum(entry["num_tokens"] for entry in self.images if "duplicate_of" not in entry)


Key = tuple[int, int | None]
"""An item's :attr:`~moonvit.PackItem.key`: (input position, video chunk or None)."""


@dataclass
class ShardWork:
    """One shard on its way to disk: what must be encoded, and what has come back so far.

    Made by :func:`shard_work`; the engine fills ``tensors`` / ``reasons`` pack by pack (from its
    own forwards, in this process or elsewhere) and :func:`finish_shard` writes it.
    """

    index: int
    planned: Sequence[ExportItem]
    """The shard's inputs, in input order."""
    to_encode: list[ExportItem]
    """The inputs that need a forward (not failed at planning, not a later copy, not in the cache)."""
    tensors: dict[Key, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Per item key, its stored kinds (from the cache, then from the forwards)."""
    reasons: dict[Key, str] = field(default_factory=dict)
    """Per item key, why it could not be decoded."""
    cached: int = 0
    encoded: int = 0
    data_s: float = 0.0
    cache_hits: dict[Key, str] = field(default_factory=dict)
    """Items whose cache entry was found but not read (``shard_work(..., keep=False)``): key ->
    content hash, read when the shard is written."""
    packs_done: list[tuple[float, int]] = field(default_factory=list)
    """(``time.perf_counter()`` when a pack's result came in, its items), in arrival order."""

    def packs(self, budget: int) -> list[Pack]:
        """The packs of ``to_encode`` under ``budget``: the same packs whichever engine encodes them."""
        return list(group_into_packs((item for entry in self.to_encode for item in entry.items), budget))

    def add(self, tensors: Mapping[Key, dict[str, torch.Tensor]], failures: Mapping[Key, str]) -> None:
        """One pack's result: each encoded item's stored kinds (:func:`stored_tensors`), the failures."""
        self.tensors.update(tensors)
        self.reasons.update(failures)
        self.encoded += len(tensors)
        self.packs_done.append((time.perf_counter(), len(tensors) + len(failures)))


def shard_work(
    index: int,
    planned: Sequence[ExportItem],
    duplicates: Mapping[int, str] | None = None,
    cache: TokenCache | None = None,
    keep: bool = True,
) -> ShardWork:
    """Shard ``index``'s inputs split into those to encode and those that need no forward.

    ``duplicates`` maps the input position of a later copy of an image to the first copy's id
    (:func:`.cache.duplicate_sources`): it is not encoded. With ``cache`` an image's tokens are
    read from it when there; with ``keep=False`` an entry is only checked from its header and
    noted, and read (its bytes checked) by :func:`finish_shard`: an engine that plans every
    shard before encoding any holds no tokens, and reads each entry once."""
    duplicates = duplicates or {}
    work = ShardWork(index, planned, [])
    for entry in planned:
        if entry.reason is not None or (cacheable(entry) and entry.items[0].index in duplicates):
            continue
        if cache is not None and cacheable(entry):
            assert entry.sha256 is not None
            if keep:
                hit = cache.load(entry.sha256)
                if hit is not None:
                    work.tensors[entry.items[0].key] = hit
            elif cache.has(entry.sha256):
                work.cache_hits[entry.items[0].key] = entry.sha256
            if entry.items[0].key in work.tensors or entry.items[0].key in work.cache_hits:
                work.cached += 1
                continue
        work.to_encode.append(entry)
    return work


def export_shard(
    index: int,
    planned: Sequence[ExportItem],
    models: Models,
    store: Sequence[str],
    budget: int,
    out: Path,
    workers: int = 0,
    duplicates: Mapping[int, str] | None = None,
    cache: TokenCache | None = None,
) -> ShardResult:
    """Encode one shard's inputs in this process, then write its tensors and part file
    (:func:`finish_shard`). ``workers`` threads decode the next packs while one encodes (the
    same bytes as 0); ``duplicates`` and ``cache`` as :func:`shard_work` takes them."""
    work = shard_work(index, planned, duplicates, cache)
    packs = processed_packs(
        models.processor,
        work.packs(budget),
        workers=workers,
        skip_errors=True,
        video_processor=models.video_processor,
    )
    ready = time.perf_counter()
    for _, processed in packs:
        work.data_s += time.perf_counter() - ready  # waiting for this pack's pixels
        encoded = encode_processed(models.encoder, processed)
        work.add(stored_tensors(encoded, models, store) if encoded.items else {}, encoded.failures)
        ready = time.perf_counter()
    return finish_shard(work, store, out, duplicates, cache)


def finish_shard(
    work: ShardWork,
    store: Sequence[str],
    out: Path,
    duplicates: Mapping[int, str] | None = None,
    cache: TokenCache | None = None,
) -> ShardResult:
    """Write a shard whose every pack has come back: the images encoded here go to ``cache``,
    the tokens to ``shard-k.safetensors`` and the lines to its part file, each atomically."""
    duplicates = duplicates or {}
    for key, sha256 in work.cache_hits.items():  # found when planned, read now
        assert cache is not None
        hit = cache.load(sha256)
        if hit is None:  # damaged inside (its header was fine) or changed since: encoded by the next run
            cache.discard(sha256)
            raise ExportError(
                f"the cache entry of {sha256} in {cache.folder} is damaged or changed during the run; "
                "it was removed: run again to encode it"
            )
        work.tensors[key] = hit
    if cache is not None:
        for entry in work.to_encode:
            if cacheable(entry) and entry.items[0].key in work.tensors:
                assert entry.sha256 is not None
                cache.save(entry.sha256, work.tensors[entry.items[0].key])
    lines: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    stored: dict[str, list[torch.Tensor]] = {kind: [] for kind in store}
    per_image: dict[str, list[torch.Tensor]] = {name: [] for name in PER_IMAGE_ROWS}  # each image's (1, ...)
    offset = 0
    for entry in work.planned:
        if entry.reason is not None:
            failures.append({"id": entry.image.id, **path_record(entry.image.path), "reason": entry.reason})
            continue
        if cacheable(entry) and entry.items[0].index in duplicates:
            source = duplicates[entry.items[0].index]
            lines.append({"id": entry.image.id, **path_record(entry.image.path), "duplicate_of": source})
            continue
        assert entry.sha256 is not None
        for item in entry.items:
            if item.key in work.reasons:
                reason = work.reasons[item.key]
                failures.append({"id": item_id(entry, item), **path_record(entry.image.path), "reason": reason})
                continue
            result = work.tensors[item.key]
            num_tokens = len(result[store[0]])
            line = manifest_line(entry, item, entry.sha256, num_tokens, shard_name(work.index), offset)
            for name, row in PER_IMAGE_ROWS.items():  # prefix rows, pooled vector: where the tower gives them
                if name in result:
                    line[row] = len(per_image[name])
                    per_image[name].append(result[name])
            lines.append(line)
            offset += num_tokens
            for kind in store:
                stored[kind].append(result[kind])
    if offset:
        tensors = {kind: torch.cat(parts) for kind, parts in stored.items()}
        tensors.update({name: torch.cat(rows) for name, rows in per_image.items() if rows})
        save_safetensors_atomic(tensors, out / shard_name(work.index))
    part = part_path(out, work.index)
    part.parent.mkdir(exist_ok=True)
    write_text_atomic(part, json.dumps({"images": lines, "failures": failures}) + "\n")
    copies = sum(1 for line in lines if "duplicate_of" in line)
    return ShardResult(lines, failures, work.data_s, work.encoded, copies, work.cached, work.packs_done)


def stored_tensors(encoded: EncodedPack, models: Models, store: Sequence[str]) -> dict[Key, dict[str, torch.Tensor]]:
    """Per item key, the kinds to store on the CPU: ``merged`` (n_i, kh * kw, D) and / or
    ``projected`` (n_i, llm_hidden), n_i = rows_i * cols_i / (kh * kw), in the export dtype; for a
    tower with prefix tokens (:attr:`Models.prefix_tokens`), also ``prefix_tokens`` (1, n_prefix, D),
    the item's prefix rows after the final norm (CLS, then DeiT's distillation token or DINOv2's
    registers), and for a tower that pools (:attr:`Models.pooled`) ``pooled`` (1, D)."""
    outputs = {"merged": encoded.merged}
    if "projected" in store:
        assert models.projector is not None
        with torch.no_grad():
            outputs["projected"] = models.projector(encoded.merged)
    split = {kind: encoded.split_tokens(outputs[kind].cpu()) for kind in store}
    tensors = {item.key: {kind: split[kind][i] for kind in store} for i, item in enumerate(encoded.items)}
    assert encoded.output is not None
    for name, wanted, given in (
        (PREFIX_TENSOR, models.prefix_tokens, encoded.output.prefix_tokens),
        (POOLED_TENSOR, models.pooled, encoded.output.pooled),
    ):
        if wanted:
            if given is None:
                raise ExportError(f"the encoder's output has no {name}, which its config says it gives")
            rows = given.to("cpu", copy=True)  # its own storage: a CLS tower's pooled rows are views of its prefix rows
            for i, item in enumerate(encoded.items):
                tensors[item.key][name] = rows[i : i + 1]
    return tensors


def item_id(entry: ExportItem, item: PackItem) -> str:
    """An image's id, or ``<video id>#<chunk>`` for a video's chunk."""
    return entry.image.id if item.chunk is None else f"{entry.image.id}#{item.chunk.plan.chunk}"


def manifest_line(
    entry: ExportItem, item: PackItem, sha256: str, num_tokens: int, shard: str, offset: int
) -> dict[str, Any]:
    """One ``manifest.jsonl`` record: where an image's (a video chunk's) tokens lie and how it was processed."""
    plan = item.plan
    line = {
        "id": item_id(entry, item),
        **path_record(entry.image.path),
        "sha256": sha256,
        "size": list(plan.size),
        "resized": list(plan.resized_size),
        "grid_hw": list(plan.grid_hw),
        "num_tokens": num_tokens,
        "rescaled": item.rescaled,
        "shard": shard,
        "offset": offset,
    }
    if plan.stretched_size is not None:  # LocateAnything's rule: stretched, not padded, to the grid
        line["stretched"] = list(plan.stretched_size)
    if item.chunk is not None:
        chunk = item.chunk.plan
        line.update(
            video_id=entry.image.id,
            chunk=chunk.chunk,
            timestamp=chunk.timestamp,
            frames=chunk.frames,
            frame_indices=list(chunk.frame_indices),
            grid_thw=[chunk.frames, *plan.grid_hw],
        )
    return line


def assemble(out: Path, count: int) -> tuple[dict[str, int], int]:
    """Write ``manifest.jsonl`` and ``failures.jsonl`` from the parts of shards 0 .. count - 1.

    A later copy of an image gets the first copy's line (the same shard and offset) under its own
    id and path, or the first copy's failure. Each shard a part names is opened (header only), so
    that a damaged folder fails loudly. Returns (the manifest's counts, see
    :func:`manifest_counts`; the failures).
    """
    records: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    lines: dict[str, dict[str, Any]] = {}
    reasons: dict[str, str] = {}
    for k in range(count):
        part = json.loads(part_path(out, k).read_text())
        if any("duplicate_of" not in line for line in part["images"]):
            with safe_open(out / shard_name(k), framework="pt"):
                pass
        for line in part["failures"]:
            reasons[line["id"]] = line["reason"]
        failures.extend(part["failures"])
        for line in part["images"]:
            source = line.get("duplicate_of")
            if source is None:
                lines[line["id"]] = line
                records.append(line)
                continue
            named = {key: value for key, value in line.items() if key != "duplicate_of"}
            if source in lines:
                rest = {key: value for key, value in lines[source].items() if key not in ("id", "path", "path_hex")}
                records.append({**named, **rest})
            else:  # the first copy failed to decode: so does this one
                failures.append({**named, "reason": reasons[source]})
    # the manifest last: a folder with one is whole (a disk that fills in between leaves none)
    write_text_atomic(out / FAILURES_FILE, "".join(json.dumps(line) + "\n" for line in failures))
    write_text_atomic(out / MANIFEST_FILE, "".join(json.dumps(line) + "\n" for line in records))
    return manifest_counts(records), len(failures)


def manifest_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    """What manifest records stand for: ``images``, ``videos`` (with a chunk exported) and
    ``video_chunks`` (one record each, like an image), and ``records`` in all."""
    chunks = [record["video_id"] for record in records if "video_id" in record]
    return {
        "images": len(records) - len(chunks),
        "videos": len(set(chunks)),
        "video_chunks": len(chunks),
        "records": len(records),
    }
