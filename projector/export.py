"""Pre-compute the visual tokens of a whole image collection, for LLM alignment training.

    python -m projector.export --inputs images/ --checkpoint ckpt/ --out tokens/
    torchrun --nproc-per-node 2 -m projector.export --inputs list.txt --checkpoint ckpt/ --out tokens/

The inputs are split, in input order, into shards of ``--shard-size`` images. Shard k is written
to ``shard-{k:06d}.safetensors``: one tensor per stored kind, the images' tokens back to back
(``projected`` (sum n_i, llm_hidden), ``merged`` (sum n_i, 4, D)). Its manifest lines and failures
go to ``parts/shard-{k:06d}.json``. Both files are written to a temporary name and renamed, shard
first, so a shard is done exactly when its part exists: a killed run started again with the same
arguments redoes only the shards in flight. At the end rank 0 assembles ``manifest.jsonl`` (one
line per exported image, in input order) and ``failures.jsonl`` from the parts. ``run.json`` holds
the settings; starting again with other settings into the same folder is an error that names each
differing setting with both values.

Under torchrun each rank takes a contiguous run of shards with about equal patch totals (planned
from the file headers) and writes its own shards; each shard is encoded in the same packs
whichever rank writes it, so for the same thread count per process the output is byte-identical
to one process's. ``run.json`` records that thread count (torchrun sets ``OMP_NUM_THREADS=1`` per
rank unless ``--threads`` says otherwise), torch's version and the CPU's kernel level, since CPU
kernels may round differently under any of them. ``--out`` must be a folder that every rank sees
(a shared filesystem across machines). Without torchrun's environment the export runs in one
process.

An input with nothing to export (no image files, or no image that can be planned) is an error,
and so is a run that exports no image at all; files skipped for their extension are counted.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import hashlib
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

import moonvit
from moonvit import IMAGE_EXTENSIONS, MoonViT, MoonViTImageProcessor, PackItem, VisionEncoder
from moonvit.cli import (
    add_budget_argument,
    add_checkpoint_argument,
    add_device_argument,
    add_dtype_argument,
    add_side_limit_argument,
    add_threads_argument,
    add_workers_argument,
    apply_threads,
    existing_path,
    exit_on,
    one_line_warnings,
    output_dir,
    positive_int,
    torch_dtype,
)
from moonvit.distributed import Ranks, close_ranks, init_ranks
from moonvit.encode import EncodedPack, encode_processed, processed_packs
from moonvit.files import files_below, save_safetensors_atomic, sha256_file, skipped_line, write_text_atomic
from moonvit.media.packing import group_into_packs, plan_pack_item, plan_video_items
from moonvit.media.video import VIDEO_EXTENSIONS, MoonViTVideoProcessor, is_video
from moonvit.names import display_name, path_record, recorded_path, text_bytes
from moonvit.weights.checkpoint import CheckpointError, update_weights_digest
from moonvit.weights.hub import source_label

from .model import MoonViTProjector
from .token_folder import FAILURES_FILE, FORMAT, MANIFEST_FILE, PARTS_DIR, RUN_FILE

__all__ = [
    "STORES",
    "ExportError",
    "InputImage",
    "Inputs",
    "export",
    "main",
    "read_inputs",
    "scan_inputs",
]

STORES = {"merged": ("merged",), "projected": ("projected",), "both": ("merged", "projected")}


class ExportError(RuntimeError):
    """The export cannot start: bad inputs, or an output folder made with other settings."""


# ---- inputs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class InputImage:
    """One image of the collection: its id (unique) and the file path to read."""

    id: str
    path: str


@dataclass(frozen=True)
class Inputs:
    """What ``--inputs`` names: the images, and the files of a folder skipped for their extension
    (lower-cased extension, "" for none -> count)."""

    images: list[InputImage]
    skipped: dict[str, int]

    def skipped_line(self) -> str:
        """``3 files skipped for their extension (.txt 2, .json 1)``, or "" when none were."""
        return skipped_line(self.skipped)


def scan_inputs(path: Path) -> Inputs:
    """The images named by ``--inputs``, in a deterministic order.

    - a folder: every file below it whose extension is in ``moonvit.IMAGE_EXTENSIONS``, sorted
      by relative path (the id); other files are counted by extension;
    - a ``.jsonl`` file: one ``{"id": ..., "path": ...}`` object per line;
    - any other file: one path per line (the id is the line as written).

    Paths are made absolute; relative ones in a list are resolved against the list's folder.
    Blank lines are skipped.

    Raises:
        ExportError: the path does not exist, it names no image (the skipped files counted), a
            JSONL line lacks ``id`` / ``path``, or ids repeat.
    """
    path = path.absolute()
    skipped: dict[str, int] = {}
    if path.is_dir():
        images, skipped = _folder_inputs(path)
    elif path.is_file():
        images = _jsonl_inputs(path) if path.suffix.lower() == ".jsonl" else _text_inputs(path)
    else:
        raise ExportError(f"--inputs {path} is neither a folder nor a file")
    inputs = Inputs(images, skipped)
    if not images:
        extensions = " ".join(sorted(IMAGE_EXTENSIONS))
        detail = f": {inputs.skipped_line()}; image extensions are {extensions}" if skipped else ""
        raise ExportError(f"--inputs {path} names no images{detail}")
    _check_unique_ids(images, path)
    return inputs


def read_inputs(path: Path) -> list[InputImage]:
    """The images (and videos) of :func:`scan_inputs`."""
    return scan_inputs(path).images


def _folder_inputs(folder: Path) -> tuple[list[InputImage], dict[str, int]]:
    files, skipped = files_below(folder, IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    # the id is text of JSON and of prompts: a name that is not UTF-8 is shown escaped (moonvit.names)
    return [InputImage(display_name(p.relative_to(folder).as_posix()), str(p)) for p in files], skipped


def _text_inputs(file: Path) -> list[InputImage]:
    # a list of file names: bytes that are not UTF-8 are kept as Python keeps them in names
    lines = (line.strip() for line in file.read_text(encoding="utf-8", errors="surrogateescape").splitlines())
    return [InputImage(display_name(line), str(file.parent / line)) for line in lines if line]


def _jsonl_inputs(file: Path) -> list[InputImage]:
    images = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            images.append(InputImage(str(record["id"]), str(file.parent / recorded_path(record))))
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ExportError(f"{file}:{number}: expected a JSON object with 'id' and 'path' ({error!r})") from error
    return images


def _check_unique_ids(images: Sequence[InputImage], source: Path) -> None:
    counts = collections.Counter(image.id for image in images)
    repeated = sorted(name for name, count in counts.items() if count > 1)
    if repeated:
        raise ExportError(f"--inputs {source} repeats the ids {repeated[:5]}{' ...' if len(repeated) > 5 else ''}")


# ---- planning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedImage:
    """An input and its items (one for an image, one per chunk for a video), planned from the
    file's header or container alone, or why it cannot be exported (then ``items`` is empty)."""

    image: InputImage
    items: tuple[PackItem, ...]
    reason: str | None

    @property
    def num_patches(self) -> int:
        return sum(item.num_patches for item in self.items)


def plan_input(index: int, image: InputImage, models: Models, budget: int) -> PlannedImage:
    """Plan one input from its header alone (scaled down if alone it exceeds ``budget``)."""
    try:
        if is_video(image.path):
            models.video_processor.check_tower(models.encoder.config.max_frames)
            items = plan_video_items(index, image.path, models.video_processor, budget)
            return PlannedImage(image, tuple(items), None)
        return PlannedImage(image, (plan_pack_item(index, image.path, models.processor, budget),), None)
    except ValueError as error:  # ImageLoadError included; the cause is the unprefixed reason
        return PlannedImage(image, (), str(error.__cause__ or error))


def shard_ranges(count: int, shard_size: int) -> list[range]:
    """Input positions of each shard: consecutive runs of ``shard_size``."""
    return [range(start, min(start + shard_size, count)) for start in range(0, count, shard_size)]


def split_balanced(costs: Sequence[int], parts: int) -> list[range]:
    """Split ``costs`` into ``parts`` contiguous ranges with about equal sums (some may be empty)."""
    prefix = [0, *itertools.accumulate(costs)]
    starts = [bisect.bisect_left(prefix, prefix[-1] * r / parts) for r in range(parts)]
    return [range(start, end) for start, end in zip(starts, [*starts[1:], len(costs)])]


# ---- processes -------------------------------------------------------------------------------


def plan_all(images: Sequence[InputImage], models: Models, budget: int, ranks: Ranks) -> list[PlannedImage]:
    """Plan every input, the header reads spread over the ranks; the same list on every rank.

    Raises:
        ExportError: no input can be planned (the commonest reasons given).
    """
    mine = {i: plan_input(i, images[i], models, budget) for i in range(ranks.rank, len(images), ranks.world_size)}
    merged: dict[int, PlannedImage] = {}
    for part in ranks.all_gather(mine):
        merged.update(part)
    planned = [merged[i] for i in range(len(images))]
    if all(not entry.items for entry in planned):
        reasons = collections.Counter(str(entry.reason) for entry in planned).most_common(3)
        raise ExportError(
            f"none of the {len(planned)} inputs can be exported: "
            + "; ".join(f"{reason} ({count} images)" for reason, count in reasons)
        )
    return planned


# ---- models ----------------------------------------------------------------------------------


@dataclass
class Models:
    """The encoder, the projector (None when only merged tokens are stored) and the processor."""

    encoder: VisionEncoder
    projector: MoonViTProjector | None
    processor: MoonViTImageProcessor
    video_processor: MoonViTVideoProcessor
    checkpoint_sha256: str


def load_models(
    checkpoint: str | Path,
    store: Sequence[str],
    dtype: torch.dtype,
    device: torch.device,
    processor_overrides: dict[str, Any] | None = None,
) -> Models:
    """Load the checkpoint (a folder or hub id) and hash the weights as read (before the cast to ``dtype``)."""
    digest = hashlib.sha256()
    try:
        encoder = MoonViT.from_pretrained(checkpoint, device="cpu")
        update_weights_digest(digest, encoder, "encoder.")
        projector = None
        if "projected" in store:
            projector = MoonViTProjector.from_pretrained(checkpoint, device="cpu")
            update_weights_digest(digest, projector, "projector.")
    except CheckpointError as error:
        hint = " (use --store merged to export without a projector)" if "projected" in store else ""
        raise ExportError(f"--checkpoint {checkpoint}: {error}{hint}") from error
    processor = MoonViTImageProcessor.from_pretrained(checkpoint, **(processor_overrides or {}))
    video_processor = MoonViTVideoProcessor.from_pretrained(checkpoint)  # frames always resize to the side cap
    encoder = encoder.to(device=device, dtype=dtype).eval()
    projector = projector.to(device=device, dtype=dtype).eval() if projector is not None else None
    return Models(encoder, projector, processor, video_processor, digest.hexdigest())


# ---- run description -------------------------------------------------------------------------


def describe_run(
    args: argparse.Namespace, models: Models, images: Sequence[InputImage], device: torch.device
) -> dict[str, Any]:
    """The content of ``run.json``: everything that determines the output folder's bytes.

    ``compute`` holds what the numbers depend on beyond the arguments: the threads per process
    in effect, torch's version, the device type and, on CPU, the kernel level torch dispatches to.
    The number of ranks is not there: it does not change the output. Made of JSON types only
    (lists, not tuples), so it compares equal to the file read back.
    """
    listing = hashlib.sha256(text_bytes("\n".join(f"{image.id}\t{image.path}" for image in images))).hexdigest()
    run = {
        "format": FORMAT,
        "moonvit_version": moonvit.__version__,
        "checkpoint": {"path": source_label(args.checkpoint), "sha256": models.checkpoint_sha256},
        "processor": models.processor.to_dict(),
        "video_processor": models.video_processor.to_dict(),
        "store": list(STORES[args.store]),
        "dtype": args.dtype,
        "inputs": {"path": str(args.inputs.resolve()), "count": len(images), "sha256": listing},
        "arguments": {
            "store": args.store,
            "dtype": args.dtype,
            "max_patches_per_pack": args.max_patches_per_pack,
            "shard_size": args.shard_size,
            "device": args.device,
            "threads": args.threads,
            "side_limit_mode": args.side_limit_mode,
        },
        "compute": {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "device_type": device.type,
            "cpu_capability": torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else None,
        },
    }
    return json.loads(json.dumps(run))


def claim_output(out: Path, run: dict[str, Any]) -> None:
    """Write ``run.json``, or check that the one already in ``out`` describes the same run.

    Raises:
        ExportError: ``out`` holds an export made with other settings (each differing setting
            named with its value there and now).
    """
    file = out / RUN_FILE
    if file.is_file():
        previous = json.loads(file.read_text())
        if previous != run:
            changes = "; ".join(
                f"{key}: {before!r} there, {after!r} now" for key, before, after in differences(previous, run)
            )
            raise ExportError(
                f"--out {out} holds an export with other settings ({changes}; from {file}); "
                "use the same arguments to resume, or another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(file, json.dumps(run, indent=2) + "\n")


_ABSENT = "(absent)"


def differences(before: Any, after: Any, key: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value before, value after) for every leaf that differs between two JSON values."""
    if isinstance(before, dict) and isinstance(after, dict):
        return [
            change
            for name in sorted(before.keys() | after.keys())
            for change in differences(
                before.get(name, _ABSENT), after.get(name, _ABSENT), f"{key}.{name}" if key else name
            )
        ]
    return [] if before == after else [(key, before, after)]


# ---- shards ----------------------------------------------------------------------------------


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.safetensors"


def part_path(out: Path, index: int) -> Path:
    return out / PARTS_DIR / f"shard-{index:06d}.json"


@dataclass
class ShardResult:
    """One shard's manifest lines and failures, in input order."""

    images: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    data_s: float = 0.0
    """Seconds the encoder loop waited for decoded packs (all of the decoding when it is inline)."""

    @property
    def num_tokens(self) -> int:
        return sum(entry["num_tokens"] for entry in self.images)


def export_shard(
    index: int,
    planned: Sequence[PlannedImage],
    models: Models,
    store: Sequence[str],
    budget: int,
    out: Path,
    workers: int = 0,
) -> ShardResult:
    """Encode one shard's inputs, then write its tensors and its part file, each atomically.
    ``workers`` threads decode the next packs while one encodes (the same bytes as 0)."""
    Key = tuple[int, int | None]
    tensors: dict[Key, dict[str, torch.Tensor]] = {}
    reasons: dict[Key, str] = {}
    packs = processed_packs(
        models.processor,
        group_into_packs((item for p in planned for item in p.items), budget),
        workers=workers,
        skip_errors=True,
        video_processor=models.video_processor,
    )
    data_s, ready = 0.0, time.perf_counter()
    for _, processed in packs:
        data_s += time.perf_counter() - ready  # waiting for this pack's pixels
        encoded = encode_processed(models.encoder, processed)
        reasons.update(encoded.failures)
        if encoded.items:
            tensors.update(stored_tensors(encoded, models, store))
        ready = time.perf_counter()
    lines: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    stored: dict[str, list[torch.Tensor]] = {kind: [] for kind in store}
    offset = 0
    for entry in planned:
        if entry.reason is not None:
            failures.append({"id": entry.image.id, **path_record(entry.image.path), "reason": entry.reason})
            continue
        try:
            sha256 = sha256_file(entry.image.path)
        except OSError as error:  # the file went away after it was decoded
            failures.append({"id": entry.image.id, **path_record(entry.image.path), "reason": str(error)})
            continue
        for item in entry.items:
            if item.key in reasons:
                reason = reasons[item.key]
                failures.append({"id": item_id(entry, item), **path_record(entry.image.path), "reason": reason})
                continue
            result = tensors[item.key]
            num_tokens = len(result[store[0]])
            lines.append(manifest_line(entry, item, sha256, num_tokens, shard_name(index), offset))
            offset += num_tokens
            for kind in store:
                stored[kind].append(result[kind])
    if lines:
        save_safetensors_atomic({kind: torch.cat(parts) for kind, parts in stored.items()}, out / shard_name(index))
    part = part_path(out, index)
    part.parent.mkdir(exist_ok=True)
    write_text_atomic(part, json.dumps({"images": lines, "failures": failures}) + "\n")
    return ShardResult(lines, failures, data_s)


def stored_tensors(
    encoded: EncodedPack, models: Models, store: Sequence[str]
) -> dict[tuple[int, int | None], dict[str, torch.Tensor]]:
    """Per item key, the kinds to store on the CPU: ``merged`` (n_i, 4, D) and / or
    ``projected`` (n_i, llm_hidden), n_i = rows_i * cols_i / 4, in the export dtype."""
    outputs = {"merged": encoded.merged}
    if "projected" in store:
        assert models.projector is not None
        with torch.no_grad():
            outputs["projected"] = models.projector(encoded.merged)
    split = {kind: encoded.split_tokens(outputs[kind].cpu()) for kind in store}
    return {item.key: {kind: split[kind][i] for kind in store} for i, item in enumerate(encoded.items)}


def item_id(entry: PlannedImage, item: PackItem) -> str:
    """An image's id, or ``<video id>#<chunk>`` for a video's chunk."""
    return entry.image.id if item.chunk is None else f"{entry.image.id}#{item.chunk.plan.chunk}"


def manifest_line(
    entry: PlannedImage, item: PackItem, sha256: str, num_tokens: int, shard: str, offset: int
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


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Progress:
    """This process's counts for the summary."""

    images: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    data_s: float = 0.0


def export_rank(
    shards: Sequence[int],
    layout: Sequence[range],
    planned: Sequence[PlannedImage],
    models: Models,
    args: argparse.Namespace,
    show: bool,
) -> Progress:
    """Export this rank's shards that have no part file yet, with a progress bar on ``show``."""
    pending = [k for k in shards if not part_path(args.out, k).is_file()]
    progress = Progress()
    start = time.perf_counter()
    total = sum(len(layout[k]) for k in pending)
    with tqdm(total=total, unit="img", desc="export", disable=not show, dynamic_ncols=True) as bar:
        for k in pending:
            shard = [planned[i] for i in layout[k]]
            result = export_shard(
                k, shard, models, STORES[args.store], args.max_patches_per_pack, args.out, args.workers
            )
            progress.data_s += result.data_s
            progress.images += len(result.images)
            progress.failed += len(result.failures)
            progress.tokens += result.num_tokens
            progress.seconds = time.perf_counter() - start
            bar.update(len(layout[k]))
            bar.set_postfix(
                img_s=f"{(progress.images + progress.failed) / progress.seconds:.1f}",
                tok_s=f"{progress.tokens / progress.seconds:.0f}",
            )
    progress.seconds = time.perf_counter() - start
    return progress


def assemble(out: Path, count: int) -> tuple[dict[str, int], int]:
    """Write ``manifest.jsonl`` and ``failures.jsonl`` from the parts of shards 0 .. count - 1.

    Each shard a part names is opened (header only), so that a damaged folder fails loudly.
    Returns (the manifest's counts, see :func:`manifest_counts`; the failures).
    """
    records: list[dict[str, Any]] = []
    failures: list[str] = []
    for k in range(count):
        part = json.loads(part_path(out, k).read_text())
        if part["images"]:
            with safe_open(out / shard_name(k), framework="pt"):
                pass
        records.extend(part["images"])
        failures.extend(json.dumps(line) + "\n" for line in part["failures"])
    write_text_atomic(out / MANIFEST_FILE, "".join(json.dumps(line) + "\n" for line in records))
    write_text_atomic(out / FAILURES_FILE, "".join(failures))
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


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Run the export described by the parsed command line; returns the summary (on every rank)."""
    apply_threads(args.threads)
    ranks, device = init_ranks(args.device)
    try:
        return _export(args, ranks, device)
    finally:
        close_ranks()


def _export(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> dict[str, Any]:
    inputs = scan_inputs(args.inputs)
    images = inputs.images
    overrides = {} if args.side_limit_mode is None else {"side_limit_mode": args.side_limit_mode}
    models = load_models(args.checkpoint, STORES[args.store], torch_dtype(args.dtype), device, overrides)
    smallest = models.encoder.config.tokens_per_merge
    if args.max_patches_per_pack < smallest:
        raise ExportError(f"--max-patches-per-pack {args.max_patches_per_pack} is below one merged token ({smallest})")
    run = describe_run(args, models, images, device)
    planned = plan_all(images, models, args.max_patches_per_pack, ranks)
    problem = None
    if ranks.is_main:
        try:
            claim_output(args.out, run)
        except ExportError as error:
            problem = str(error)
    problem = ranks.from_main(problem)
    if problem is not None:
        raise ExportError(problem)

    layout = shard_ranges(len(images), args.shard_size)
    costs = [sum(planned[i].num_patches for i in shard) for shard in layout]
    mine = split_balanced(costs, ranks.world_size)[ranks.rank]
    progress = export_rank(mine, layout, planned, models, args, show=ranks.is_main)
    everyone = ranks.all_gather(progress)  # also the barrier before assembling
    summary = None
    if ranks.is_main:
        exported, failed = assemble(args.out, len(layout))
        summary = _summary(everyone, exported, failed, inputs.skipped)
        print(_summary_line(summary, args.out, inputs))
    summary = ranks.from_main(summary)
    if summary["records"] == 0:
        raise ExportError(f"no image could be exported: the reasons are in {args.out / FAILURES_FILE}")
    return summary


def _summary(
    progress: Sequence[Progress], exported: dict[str, int], failed: int, skipped: dict[str, int]
) -> dict[str, Any]:
    """The run's summary: the folder's counts (:func:`manifest_counts`, ``failed`` records), and this
    run's: ``images_this_run`` counts images and video chunks, one record each."""
    seconds = max(p.seconds for p in progress)
    done = sum(p.images + p.failed for p in progress)
    tokens = sum(p.tokens for p in progress)
    return {
        **exported,
        "failed": failed,
        "skipped": skipped,
        "images_this_run": done,
        "tokens_this_run": tokens,
        "seconds": seconds,
        "images_per_s": done / seconds if seconds else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        # the share of the encode loop spent waiting for decoded packs (rank 0's when several)
        "data_share": progress[0].data_s / progress[0].seconds if progress[0].seconds else 0.0,
    }


def _summary_line(summary: dict[str, Any], out: Path, inputs: Inputs) -> str:
    """``exported 1 image, 1 video (2 chunks), 0 failed ...``: images and videos counted apart (a
    video's chunks are one record each, like an image, and are what this run's rate counts)."""
    skipped = f"; {inputs.skipped_line()}" if inputs.skipped else ""
    exported = f"{summary['images']} image{'s' * (summary['images'] != 1)}"
    items, unit = "images", "images"
    if summary["videos"]:
        videos, chunks = summary["videos"], summary["video_chunks"]
        exported += f", {videos} video{'s' * (videos != 1)} ({chunks} chunk{'s' * (chunks != 1)})"
        items, unit = "images and video chunks", "items"
    return (
        f"exported {exported}, {summary['failed']} failed (see {out / FAILURES_FILE}){skipped}; "
        f"this run processed {summary['images_this_run']} {items} into {summary['tokens_this_run']} tokens "
        f"in {summary['seconds']:.1f} s "
        f"({summary['images_per_s']:.1f} {unit}/s, {summary['tokens_per_s']:.0f} tokens/s; "
        f"{summary['data_share']:.0%} of it waiting for decoded images)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m projector.export",
        description=__doc__.split("\n")[0],
        epilog="Data-parallel: torchrun --nproc-per-node K -m projector.export ...",
    )
    parser.add_argument(
        "--inputs",
        type=existing_path,
        required=True,
        help="image folder (recursive; files with other extensions are skipped and counted), "
        "text file of paths, or JSONL of {id, path} lines",
    )
    add_checkpoint_argument(
        parser,
        help="folder or hub id (owner/name) with the encoder, projector and preprocessor_config.json",
        required=True,
    )
    parser.add_argument("--out", type=output_dir, required=True, help="output folder (resumed if it holds this run)")
    parser.add_argument(
        "--store",
        choices=sorted(STORES),
        default="projected",
        help="merged encoder tokens, projected tokens, or both (default: projected)",
    )
    add_dtype_argument(parser, "bf16", "compute and storage dtype")
    add_budget_argument(parser)
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="images per shard (default: 1000)")
    add_side_limit_argument(parser)
    add_device_argument(parser, "cpu, cuda or cuda:N (each torchrun rank takes cuda:LOCAL_RANK)")
    add_threads_argument(parser)
    add_workers_argument(parser, "packs of images")
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parser.parse_args(argv)
    with one_line_warnings(), exit_on(parser, ExportError):
        return export(args)


if __name__ == "__main__":
    main()
