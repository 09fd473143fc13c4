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
the settings; starting again with other settings into the same folder is an error.

Under torchrun each rank takes a contiguous run of shards with about equal patch totals (planned
from the file headers) and writes its own shards; shard names and contents do not depend on the
number of ranks. ``--out`` must be a folder that every rank sees (a shared filesystem across
machines). Without torchrun's environment the export runs in one process.
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
    add_device_argument,
    add_dtype_argument,
    add_threads_argument,
    apply_threads,
    positive_int,
    torch_dtype,
)
from moonvit.distributed import Ranks, close_ranks, init_ranks
from moonvit.encode import EncodedPack, encode_pack
from moonvit.files import save_safetensors_atomic, sha256_file, write_text_atomic
from moonvit.media.packing import group_into_packs, plan_pack_item
from moonvit.weights.checkpoint import CheckpointError, update_weights_digest

from .model import MoonViTProjector
from .token_folder import FAILURES_FILE, FORMAT, MANIFEST_FILE, PARTS_DIR, RUN_FILE

__all__ = [
    "STORES",
    "ExportError",
    "InputImage",
    "export",
    "main",
    "read_inputs",
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


def read_inputs(path: Path) -> list[InputImage]:
    """The images named by ``--inputs``, in a deterministic order.

    - a folder: every file with an image extension below it, sorted by relative path (the id);
    - a ``.jsonl`` file: one ``{"id": ..., "path": ...}`` object per line;
    - any other file: one path per line (the id is the line as written).

    Paths are made absolute; relative ones in a list are resolved against the list's folder.
    Blank lines are skipped.

    Raises:
        ExportError: the path does not exist, a JSONL line lacks ``id`` / ``path``, or ids repeat.
    """
    path = path.absolute()
    if path.is_dir():
        images = _folder_inputs(path)
    elif path.is_file():
        images = _jsonl_inputs(path) if path.suffix.lower() == ".jsonl" else _text_inputs(path)
    else:
        raise ExportError(f"--inputs {path} is neither a folder nor a file")
    _check_unique_ids(images, path)
    return images


def _folder_inputs(folder: Path) -> list[InputImage]:
    files = (p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
    relative = sorted(p.relative_to(folder).as_posix() for p in files)
    return [InputImage(name, str(folder / name)) for name in relative]


def _text_inputs(file: Path) -> list[InputImage]:
    lines = (line.strip() for line in file.read_text().splitlines())
    return [InputImage(line, str(file.parent / line)) for line in lines if line]


def _jsonl_inputs(file: Path) -> list[InputImage]:
    images = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            images.append(InputImage(str(record["id"]), str(file.parent / record["path"])))
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
    """An input and its geometry from the file header, or why it cannot be exported.

    Exactly one of ``item`` (index = input position) and ``reason`` is set.
    """

    image: InputImage
    item: PackItem | None
    reason: str | None

    @property
    def num_patches(self) -> int:
        return self.item.plan.num_patches if self.item is not None else 0


def plan_input(index: int, image: InputImage, processor: MoonViTImageProcessor, budget: int) -> PlannedImage:
    """Plan one image from its header alone (scaled down if alone it exceeds ``budget``)."""
    try:
        return PlannedImage(image, plan_pack_item(index, image.path, processor, budget), None)
    except ValueError as error:  # ImageLoadError included; the cause is the unprefixed reason
        return PlannedImage(image, None, str(error.__cause__ or error))


def shard_ranges(count: int, shard_size: int) -> list[range]:
    """Input positions of each shard: consecutive runs of ``shard_size``."""
    return [range(start, min(start + shard_size, count)) for start in range(0, count, shard_size)]


def split_balanced(costs: Sequence[int], parts: int) -> list[range]:
    """Split ``costs`` into ``parts`` contiguous ranges with about equal sums (some may be empty)."""
    prefix = [0, *itertools.accumulate(costs)]
    starts = [bisect.bisect_left(prefix, prefix[-1] * r / parts) for r in range(parts)]
    return [range(start, end) for start, end in zip(starts, [*starts[1:], len(costs)])]


# ---- processes -------------------------------------------------------------------------------


def plan_all(
    images: Sequence[InputImage], processor: MoonViTImageProcessor, budget: int, ranks: Ranks
) -> list[PlannedImage]:
    """Plan every input, the header reads spread over the ranks; the same list on every rank."""
    mine = {i: plan_input(i, images[i], processor, budget) for i in range(ranks.rank, len(images), ranks.world_size)}
    merged: dict[int, PlannedImage] = {}
    for part in ranks.all_gather(mine):
        merged.update(part)
    return [merged[i] for i in range(len(images))]


# ---- models ----------------------------------------------------------------------------------


@dataclass
class Models:
    """The encoder, the projector (None when only merged tokens are stored) and the processor."""

    encoder: VisionEncoder
    projector: MoonViTProjector | None
    processor: MoonViTImageProcessor
    checkpoint_sha256: str


def load_models(checkpoint: Path, store: Sequence[str], dtype: torch.dtype, device: torch.device) -> Models:
    """Load the checkpoint folder and hash the weights as read (before the cast to ``dtype``)."""
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
    processor = MoonViTImageProcessor.from_pretrained(checkpoint)
    encoder = encoder.to(device=device, dtype=dtype).eval()
    projector = projector.to(device=device, dtype=dtype).eval() if projector is not None else None
    return Models(encoder, projector, processor, digest.hexdigest())


# ---- run description -------------------------------------------------------------------------


def describe_run(args: argparse.Namespace, models: Models, images: Sequence[InputImage]) -> dict[str, Any]:
    """The content of ``run.json``: everything that determines the output folder's bytes.

    Made of JSON types only (lists, not tuples), so it compares equal to the file read back.
    """
    listing = hashlib.sha256("\n".join(f"{image.id}\t{image.path}" for image in images).encode()).hexdigest()
    run = {
        "format": FORMAT,
        "moonvit_version": moonvit.__version__,
        "checkpoint": {"path": str(args.checkpoint.resolve()), "sha256": models.checkpoint_sha256},
        "processor": models.processor.to_dict(),
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
        },
    }
    return json.loads(json.dumps(run))


def claim_output(out: Path, run: dict[str, Any]) -> None:
    """Write ``run.json``, or check that the one already in ``out`` describes the same run.

    Raises:
        ExportError: ``out`` holds an export made with other settings (the differing keys named).
    """
    file = out / RUN_FILE
    if file.is_file():
        previous = json.loads(file.read_text())
        if previous != run:
            keys = sorted(k for k in run.keys() | previous.keys() if run.get(k) != previous.get(k))
            raise ExportError(
                f"--out {out} holds an export with other settings (differing in {', '.join(keys)} of {file}); "
                "use the same arguments to resume, or another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(file, json.dumps(run, indent=2) + "\n")


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

    @property
    def num_tokens(self) -> int:
        return sum(entry["num_tokens"] for entry in self.images)


def export_shard(
    index: int, planned: Sequence[PlannedImage], models: Models, store: Sequence[str], budget: int, out: Path
) -> ShardResult:
    """Encode one shard's images, then write its tensors and its part file, each atomically."""
    tensors: dict[int, dict[str, torch.Tensor]] = {}
    reasons: dict[int, str] = {}
    for pack in group_into_packs((p.item for p in planned if p.item is not None), budget):
        encoded = encode_pack(models.encoder, models.processor, pack, skip_errors=True)
        reasons.update(encoded.failures)
        if encoded.items:
            tensors.update(stored_tensors(encoded, models, store))
    images: list[dict[str, Any]] = []
    failures: list[dict[str, Any]] = []
    stored: dict[str, list[torch.Tensor]] = {kind: [] for kind in store}
    offset = 0
    for entry in planned:
        reason = entry.reason if entry.item is None else reasons.get(entry.item.index)
        if entry.item is None or reason is not None:
            failures.append({"id": entry.image.id, "path": entry.image.path, "reason": reason})
            continue
        try:
            sha256 = sha256_file(entry.image.path)
        except OSError as error:  # the file went away after it was decoded
            failures.append({"id": entry.image.id, "path": entry.image.path, "reason": str(error)})
            continue
        result = tensors[entry.item.index]
        num_tokens = len(result[store[0]])
        images.append(manifest_line(entry, sha256, num_tokens, shard_name(index), offset))
        offset += num_tokens
        for kind in store:
            stored[kind].append(result[kind])
    if images:
        save_safetensors_atomic({kind: torch.cat(parts) for kind, parts in stored.items()}, out / shard_name(index))
    part = part_path(out, index)
    part.parent.mkdir(exist_ok=True)
    write_text_atomic(part, json.dumps({"images": images, "failures": failures}) + "\n")
    return ShardResult(images, failures)


def stored_tensors(encoded: EncodedPack, models: Models, store: Sequence[str]) -> dict[int, dict[str, torch.Tensor]]:
    """Per input index, the kinds to store on the CPU: ``merged`` (n_i, 4, D) and / or
    ``projected`` (n_i, llm_hidden), n_i = rows_i * cols_i / 4, in the export dtype."""
    outputs = {"merged": encoded.merged}
    if "projected" in store:
        assert models.projector is not None
        with torch.no_grad():
            outputs["projected"] = models.projector(encoded.merged)
    split = {kind: encoded.split_tokens(outputs[kind].cpu()) for kind in store}
    return {item.index: {kind: split[kind][i] for kind in store} for i, item in enumerate(encoded.items)}


def manifest_line(entry: PlannedImage, sha256: str, num_tokens: int, shard: str, offset: int) -> dict[str, Any]:
    """One ``manifest.jsonl`` record: where the image's tokens lie and how it was processed."""
    assert entry.item is not None
    plan = entry.item.plan
    return {
        "id": entry.image.id,
        "path": entry.image.path,
        "sha256": sha256,
        "size": list(plan.size),
        "resized": list(plan.resized_size),
        "grid_hw": list(plan.grid_hw),
        "num_tokens": num_tokens,
        "rescaled": entry.item.rescaled,
        "shard": shard,
        "offset": offset,
    }


# ---- the run ---------------------------------------------------------------------------------


@dataclass
class Progress:
    """This process's counts for the summary."""

    images: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0


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
            result = export_shard(
                k, [planned[i] for i in layout[k]], models, STORES[args.store], args.max_patches_per_pack, args.out
            )
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


def assemble(out: Path, count: int) -> tuple[int, int]:
    """Write ``manifest.jsonl`` and ``failures.jsonl`` from the parts of shards 0 .. count - 1.

    Each shard a part names is opened (header only), so that a damaged folder fails loudly.
    Returns (images in the manifest, failures).
    """
    images: list[str] = []
    failures: list[str] = []
    for k in range(count):
        part = json.loads(part_path(out, k).read_text())
        if part["images"]:
            with safe_open(out / shard_name(k), framework="pt"):
                pass
        images.extend(json.dumps(line) + "\n" for line in part["images"])
        failures.extend(json.dumps(line) + "\n" for line in part["failures"])
    write_text_atomic(out / MANIFEST_FILE, "".join(images))
    write_text_atomic(out / FAILURES_FILE, "".join(failures))
    return len(images), len(failures)


def export(args: argparse.Namespace) -> dict[str, Any]:
    """Run the export described by the parsed command line; returns the summary (on every rank)."""
    apply_threads(args.threads)
    ranks, device = init_ranks(args.device)
    try:
        return _export(args, ranks, device)
    finally:
        close_ranks()


def _export(args: argparse.Namespace, ranks: Ranks, device: torch.device) -> dict[str, Any]:
    images = read_inputs(args.inputs)
    models = load_models(args.checkpoint, STORES[args.store], torch_dtype(args.dtype), device)
    run = describe_run(args, models, images)
    problem = None
    if ranks.is_main:
        try:
            claim_output(args.out, run)
        except ExportError as error:
            problem = str(error)
    problem = ranks.from_main(problem)
    if problem is not None:
        raise ExportError(problem)

    planned = plan_all(images, models.processor, args.max_patches_per_pack, ranks)
    layout = shard_ranges(len(images), args.shard_size)
    costs = [sum(planned[i].num_patches for i in shard) for shard in layout]
    mine = split_balanced(costs, ranks.world_size)[ranks.rank]
    progress = export_rank(mine, layout, planned, models, args, show=ranks.is_main)
    everyone = ranks.all_gather(progress)  # also the barrier before assembling
    summary = None
    if ranks.is_main:
        exported, failed = assemble(args.out, len(layout))
        summary = _summary(everyone, exported, failed)
        print(_summary_line(summary, args.out))
    return ranks.from_main(summary)


def _summary(progress: Sequence[Progress], exported: int, failed: int) -> dict[str, Any]:
    seconds = max(p.seconds for p in progress)
    done = sum(p.images + p.failed for p in progress)
    tokens = sum(p.tokens for p in progress)
    return {
        "images": exported,
        "failed": failed,
        "images_this_run": done,
        "tokens_this_run": tokens,
        "seconds": seconds,
        "images_per_s": done / seconds if seconds else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
    }


def _summary_line(summary: dict[str, Any], out: Path) -> str:
    return (
        f"exported {summary['images']} images, {summary['failed']} failed (see {out / FAILURES_FILE}); this run "
        f"processed {summary['images_this_run']} images into {summary['tokens_this_run']} tokens "
        f"in {summary['seconds']:.1f} s "
        f"({summary['images_per_s']:.1f} images/s, {summary['tokens_per_s']:.0f} tokens/s)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m projector.export",
        description=__doc__.split("\n")[0],
        epilog="Data-parallel: torchrun --nproc-per-node K -m projector.export ...",
    )
    parser.add_argument(
        "--inputs",
        type=Path,
        required=True,
        help="image folder (recursive), text file of paths, or JSONL of {id, path} lines",
    )
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="folder with the encoder, projector and preprocessor_config.json"
    )
    parser.add_argument("--out", type=Path, required=True, help="output folder (resumed if it holds this run)")
    parser.add_argument(
        "--store",
        choices=sorted(STORES),
        default="projected",
        help="merged encoder tokens, projected tokens, or both (default: projected)",
    )
    add_dtype_argument(parser, "bf16", "compute and storage dtype")
    add_budget_argument(parser)
    parser.add_argument("--shard-size", type=positive_int, default=1000, help="images per shard (default: 1000)")
    add_device_argument(parser, "cpu, cuda or cuda:N (each torchrun rank takes cuda:LOCAL_RANK)")
    add_threads_argument(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    try:
        return export(args)
    except ExportError as error:
        raise SystemExit(f"error: {error}") from error


if __name__ == "__main__":
    main()
