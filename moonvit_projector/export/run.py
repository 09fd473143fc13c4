"""The run: ``run.json`` (claim or resume), this rank's shards, the torchrun ranks, the summary."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import moonvit
from moonvit.cli import apply_threads, torch_dtype
from moonvit.distributed import Ranks, close_ranks, init_ranks
from moonvit.files import write_text_atomic
from moonvit.model.interface import prefix_token_names
from moonvit.runs import compute_facts, describe_differences, differences
from moonvit.weights.hub import source_label

from ..token_folder import FAILURES_FILE, FORMAT, POOLED_ROW, POOLED_TENSOR, PREFIX_ROW, PREFIX_TENSOR, RUN_FILE
from .cache import TokenCache, cache_settings, duplicate_sources
from .inputs import InputImage, Inputs, listing_sha256, scan_inputs
from .models import Models, load_models
from .plan import ExportItem, plan_all, shard_ranges, split_balanced
from .settings import ExportError, ExportRun
from .shards import ShardResult, assemble, export_shard, part_path, shard_work

__all__ = [
    "Progress",
    "claim_output",
    "describe_run",
    "export",
    "export_on_ray",
    "export_rank",
    "kept_shards",
    "pooled_description",
    "prefix_description",
]


def describe_run(run: ExportRun, models: Models, images: Sequence[InputImage], device: torch.device) -> dict[str, Any]:
    """The content of ``run.json``: everything that determines the output folder's bytes.

    ``models`` holds the encoder's and the projector's resolved configs (the weights' hash alone
    does not tell a head count or a norm's eps). ``compute`` holds what the numbers depend on
    beyond the arguments (:func:`moonvit.runs.compute_facts`: threads, torch, device type, CPU
    kernel level, the host's bf16 units and Pillow) and the attention backend the encoder runs.
    The number of ranks is not there: it does not change the output. ``checkpoint.sha256`` hashes the
    encoder's and the projector's weights; ``checkpoint.projector_from`` names where the projector
    came from when it is not the checkpoint (``--projector-from``; absent otherwise). For a tower
    with prefix tokens (ViT, DeiT, DINOv2), ``prefix_tokens`` describes the shards' tensor of
    them (:func:`prefix_description`), and for one with a pooled output (every ViT tower) ``pooled``
    its tensor of those (:func:`pooled_description`); both absent for MoonViT. Made of JSON types only
    (lists, not tuples), so it compares equal to the file read back.
    """
    description = {
        "format": FORMAT,
        "moonvit_version": moonvit.__version__,
        "checkpoint": {
            "path": source_label(run.checkpoint),
            "sha256": models.checkpoint_sha256,
            **({} if run.projector_from is None else {"projector_from": source_label(run.projector_from)}),
        },
        "models": {
            "encoder": models.encoder.config.to_dict(),
            "projector": None if models.projector is None else models.projector.config.to_dict(),
        },
        "processor": models.processor.to_dict(),
        "video_processor": models.video_processor.to_dict(),
        "store": list(run.kinds),
        "dtype": run.dtype,
        "inputs": {"path": str(run.inputs.resolve()), "count": len(images), "sha256": listing_sha256(images)},
        "arguments": {
            "store": run.store,
            "dtype": run.dtype,
            "max_patches_per_pack": run.max_patches_per_pack,
            "shard_size": run.shard_size,
            "device": run.device,
            "threads": run.threads,
            "side_limit_mode": run.side_limit_mode,
            "image_rule": run.image_rule,
            "attn": run.attn,
        },
        "compute": {**compute_facts(device), "attention": _attention(run, models, device)},
    }
    if models.prefix_tokens:
        description["prefix_tokens"] = prefix_description(models)
    if models.pooled:
        description["pooled"] = pooled_description(models)
    return json.loads(json.dumps(description))


def prefix_description(models: Models) -> dict[str, Any]:
    """``run.json``'s ``prefix_tokens``: the shards' tensor of the prefix rows (its name), how many rows
    each image has and what they are (``cls``, then DeiT's ``distillation`` or DINOv2's ``register_0``
    ...), its shape per shard and the manifest key of an image's row."""
    count = models.prefix_tokens
    return {
        "tensor": PREFIX_TENSOR,
        "count": count,
        "rows": list(prefix_token_names(models.encoder.config)),
        "shape": ["images", count, models.encoder.config.hidden_size],
        "manifest_key": PREFIX_ROW,
    }


def pooled_description(models: Models) -> dict[str, Any]:
    """``run.json``'s ``pooled``: the shards' tensor of each image's pooled vector (its name), what it is
    (``cls``: the CLS row after the final norm; ``map``: SigLIP's MAP head; ``mean``: the patch rows'
    mean), its shape per shard and the manifest key of an image's row."""
    return {
        "tensor": POOLED_TENSOR,
        "kind": models.pooled,
        "shape": ["images", models.encoder.config.hidden_size],
        "manifest_key": POOLED_ROW,
    }


def _attention(run: ExportRun, models: Models, device: torch.device) -> str:
    """The attention backend the encoder runs: resolved here, or, for Ray's GPU actors, by one of
    them (``auto`` takes flash-attn where it is installed, which the driver's host need not be)."""
    if run.engine == "ray" and device.type == "cuda":
        from .ray_engine import actors_attention

        return actors_attention(run, models.encoder.config.attn_implementation)
    return models.attention(device)


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
            changes = describe_differences(differences(previous, run), "{key}: {before!r} there, {after!r} now")
            raise ExportError(
                f"--out {out} holds an export with other settings ({changes}; from {file}); "
                "use the same arguments to resume, or another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(file, json.dumps(run, indent=2) + "\n")


@dataclass
class Progress:
    """This process's counts for the summary."""

    images: int = 0
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    data_s: float = 0.0
    """Seconds the encoder waited for decoded packs (summed over the actors on Ray)."""
    encode_s: float = 0.0
    """Seconds the encoder was busy (on Ray, summed over the actors)."""
    first_pack_s: float = 0.0
    """Seconds from the start of the encoding (on Ray: Ray up, the actors starting) to the first
    pack's result: the engine's start-up, paid once per run."""
    steady_items: int = 0
    """Items in the packs after the first."""
    steady_s: float = 0.0
    """Seconds from the first pack's result to the last's: ``steady_items / steady_s`` is the
    rate once the pipeline runs, whatever it cost to start."""
    encoded: int = 0
    duplicates: int = 0
    cached: int = 0
    cache_corrupt: int = 0

    def time_packs(self, start: float, results: Sequence[ShardResult]) -> None:
        """Fill the start-up and steady-state figures from the results' pack times (``start``:
        ``time.perf_counter()`` at the start of the encoding)."""
        done = sorted(pack for result in results for pack in result.packs_done)
        if done:
            self.first_pack_s = done[0][0] - start
            self.steady_items = sum(items for _, items in done[1:])
            self.steady_s = done[-1][0] - done[0][0]

    def add(self, result: ShardResult, seconds: float) -> None:
        """Count a written shard; ``seconds`` since the start."""
        self.encoded += result.encoded
        self.duplicates += result.duplicates
        self.cached += result.cached
        self.images += len(result.images)
        self.failed += len(result.failures)
        self.tokens += result.num_tokens
        self.seconds = seconds


def export_rank(
    shards: Sequence[int],
    layout: Sequence[range],
    planned: Sequence[ExportItem],
    models: Models,
    run: ExportRun,
    show: bool,
    duplicates: Mapping[int, str] | None = None,
    cache: TokenCache | None = None,
) -> Progress:
    """Export this rank's shards that have no part file yet, with a progress bar on ``show``
    (``duplicates`` and ``cache`` as :func:`.shards.export_shard` takes them)."""
    pending = [k for k in shards if not part_path(run.out, k).is_file()]
    progress = Progress()
    start = time.perf_counter()
    total = sum(len(layout[k]) for k in pending)
    results = []
    with tqdm(total=total, unit="img", desc="export", disable=not show, dynamic_ncols=True) as bar:
        for k in pending:
            shard = [planned[i] for i in layout[k]]
            result = export_shard(
                k, shard, models, run.kinds, run.max_patches_per_pack, run.out, run.workers, duplicates, cache
            )
            results.append(result)
            progress.data_s += result.data_s
            progress.add(result, time.perf_counter() - start)
            bar.update(len(layout[k]))
            bar.set_postfix(
                img_s=f"{(progress.images + progress.failed) / progress.seconds:.1f}",
                tok_s=f"{progress.tokens / progress.seconds:.0f}",
            )
    progress.seconds = time.perf_counter() - start
    progress.encode_s = progress.seconds - progress.data_s
    progress.time_packs(start, results)
    progress.cache_corrupt = cache.corrupt if cache is not None else 0
    return progress


def export_on_ray(
    shards: Sequence[int],
    layout: Sequence[range],
    planned: Sequence[ExportItem],
    models: Models,
    run: ExportRun,
    description: Mapping[str, Any],
    duplicates: Mapping[int, str] | None = None,
    cache: TokenCache | None = None,
    on_pack: Callable[[int], None] | None = None,
) -> Progress:
    """:func:`export_rank` on Ray (:mod:`.ray_engine`): the shards with no part file yet, their
    packs encoded by ``run.encoder_actors`` actors; ``on_pack`` as :func:`.ray_engine.encode_on_ray`."""
    from .ray_engine import encode_on_ray

    pending = [k for k in shards if not part_path(run.out, k).is_file()]
    # every shard is planned before any pack is encoded: cache hits are checked, not held
    works = [shard_work(k, [planned[i] for i in layout[k]], duplicates, cache, keep=False) for k in pending]
    source = {
        # the actors' working folder is not the driver's: a local folder goes by its absolute path
        "checkpoint": _for_elsewhere(run.checkpoint),
        "projector_from": None if run.projector_from is None else _for_elsewhere(run.projector_from),
        "processor_overrides": _processor_overrides(run),
        "compute": description["compute"],
        "weights_sha256": models.checkpoint_sha256,
        "processor": models.processor,
        "video_processor": models.video_processor,
    }
    progress = Progress()
    done = encode_on_ray(works, run, source, True, duplicates, cache, on_pack)
    progress.seconds = done.seconds
    progress.data_s, progress.encode_s = done.waited, done.encoding
    for result in done.results:
        progress.add(result, progress.seconds)
    progress.time_packs(done.start, done.results)
    progress.cache_corrupt = cache.corrupt if cache is not None else 0
    return progress


def kept_shards(out: Path) -> str:
    """What Ctrl-C keeps of an export into ``out``, on either engine: the finished shards (each
    written whole with its part file, by this run or an earlier one), which the same command
    does not encode again; a shard in flight leaves nothing that looks finished."""
    finished = sorted(int(part.stem.removeprefix("shard-")) for part in part_path(out, 0).parent.glob("shard-*.json"))
    total = _shard_count(out)
    of = "" if total is None else f" of {total}"
    if not finished:
        return f"no shard{of} finished in {out}; the same command starts the export again"
    count = f"{len(finished)}{of} shard{'s' * (len(finished) != 1 or total is not None)}"
    return f"{count} finished in {out} ({_ranges(finished)}), each whole; the same command resumes with the rest"


def _shard_count(out: Path) -> int | None:
    """The number of shards of the run ``out`` holds (from its ``run.json``), or None before it is claimed."""
    try:
        run = json.loads((out / RUN_FILE).read_text())
        return math.ceil(run["inputs"]["count"] / run["arguments"]["shard_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _ranges(numbers: Sequence[int]) -> str:
    """``0-2, 5`` for [0, 1, 2, 5] (sorted, distinct)."""
    runs: list[list[int]] = []
    for number in numbers:
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


def _for_elsewhere(source: str) -> str:
    """A folder or hub id as another process reads it: a local folder by its absolute path."""
    return str(Path(source).resolve()) if Path(source).is_dir() else str(source)


def _processor_overrides(run: ExportRun) -> dict[str, Any]:
    """The checkpoint processors' settings the command line replaces (``rule``: the ViT rule by name)."""
    overrides: dict[str, Any] = {} if run.side_limit_mode is None else {"side_limit_mode": run.side_limit_mode}
    return overrides if run.image_rule is None else {**overrides, "rule": run.image_rule}


def export(run: ExportRun, on_pack: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run the export ``run`` describes; returns the summary (on every rank). ``on_pack``: see
    :func:`export_on_ray` (the Ray engine only)."""
    apply_threads(run.threads)
    if run.engine == "ray":
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
            raise ExportError("--engine ray runs from one driver process; launch it without torchrun")
        return _export(run, Ranks(), torch.device(run.device), on_pack)
    ranks, device = init_ranks(run.device)
    try:
        return _export(run, ranks, device)
    finally:
        close_ranks()


def _export(
    run: ExportRun, ranks: Ranks, device: torch.device, on_pack: Callable[[int], None] | None = None
) -> dict[str, Any]:
    inputs = scan_inputs(run.inputs)
    images = inputs.images
    # on Ray the driver plans and writes, the actors encode: its own copy stays on the CPU
    here = torch.device("cpu") if run.engine == "ray" else device
    models = load_models(
        run.checkpoint, run.kinds, torch_dtype(run.dtype), here, _processor_overrides(run), run.attn, run.projector_from
    )
    smallest = models.encoder.config.tokens_per_merge
    if run.max_patches_per_pack < smallest:
        raise ExportError(f"--max-patches-per-pack {run.max_patches_per_pack} is below one merged token ({smallest})")
    description = describe_run(run, models, images, device)
    planned = plan_all(images, models, run.max_patches_per_pack, ranks)
    problem = None
    if ranks.is_main:
        try:
            claim_output(run.out, description)
        except ExportError as error:
            problem = str(error)
    problem = ranks.from_main(problem)
    if problem is not None:
        raise ExportError(problem)

    layout = shard_ranges(len(images), run.shard_size)
    costs = [sum(planned[i].num_patches for i in shard) for shard in layout]
    mine = split_balanced(costs, ranks.world_size)[ranks.rank]
    sources = duplicate_sources(planned)  # the same plan on every rank: made from the whole listing
    duplicates = {i: images[first].id for i, first in sources.items()}
    cache = None if run.cache is None else TokenCache(run.cache, cache_settings(description))
    if run.engine == "ray":
        progress = export_on_ray(mine, layout, planned, models, run, description, duplicates, cache, on_pack)
    else:
        progress = export_rank(mine, layout, planned, models, run, ranks.is_main, duplicates, cache)
    everyone = ranks.all_gather(progress)  # also the barrier before assembling
    summary = None
    if ranks.is_main:
        exported, failed = assemble(run.out, len(layout))
        summary = _summary(everyone, exported, failed, inputs.skipped)
        summary["cache"] = None if run.cache is None else str(run.cache)
        print(_summary_line(summary, run.out, inputs))
    summary = ranks.from_main(summary)
    if summary["records"] == 0:
        raise ExportError(f"no image could be exported: the reasons are in {run.out / FAILURES_FILE}")
    return summary


def _summary(
    progress: Sequence[Progress], exported: dict[str, int], failed: int, skipped: dict[str, int]
) -> dict[str, Any]:
    """The run's summary: the folder's counts (:func:`manifest_counts`, ``failed`` records), and this
    run's: ``images_this_run`` counts the images and video chunks it went through, one record each,
    ``exported_this_run`` those written to a shard and ``failed_this_run`` those that failed."""
    seconds = max(p.seconds for p in progress)
    done = sum(p.images + p.failed for p in progress)
    tokens = sum(p.tokens for p in progress)
    return {
        **exported,
        "failed": failed,
        "skipped": skipped,
        "images_this_run": done,
        "exported_this_run": sum(p.images for p in progress),
        "failed_this_run": sum(p.failed for p in progress),
        "tokens_this_run": tokens,
        "seconds": seconds,
        "images_per_s": done / seconds if seconds else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        # the share of the encoder's time spent waiting for decoded packs (rank 0's when several;
        # on Ray, over all the actors)
        "data_share": _share(progress[0].data_s, progress[0].data_s + progress[0].encode_s),
        # the engine's start-up (to the first pack's result) and the rate after it (rank 0's)
        "first_pack_s": progress[0].first_pack_s,
        "steady_items_per_s": _share(progress[0].steady_items, progress[0].steady_s),
        # each image encoded once: items encoded, later copies of an image, tokens read from --cache
        "encoded_this_run": sum(p.encoded for p in progress),
        "duplicates_this_run": sum(p.duplicates for p in progress),
        "cache_reused_this_run": sum(p.cached for p in progress),
        "cache_corrupt_this_run": sum(p.cache_corrupt for p in progress),
    }


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _summary_line(summary: dict[str, Any], out: Path, inputs: Inputs) -> str:
    """``exported 1 image, 1 video (2 chunks), 0 failed ...``: images and videos counted apart (a
    video's chunks are one record each, like an image, and are what this run's counts and rate
    count); then this run's: how many it exported and how many failed, its rates, its start-up."""
    skipped = f"; {inputs.skipped_line()}" if inputs.skipped else ""
    once = ""
    if summary["duplicates_this_run"]:
        once += f"; {summary['duplicates_this_run']} copies of an image encoded once"
    if summary.get("cache") is not None:
        corrupt = summary["cache_corrupt_this_run"]
        once += f"; {summary['cache_reused_this_run']} reused from the cache {summary['cache']}"
        once += f" ({corrupt} damaged entries encoded again)" if corrupt else ""
    exported = f"{summary['images']} image{'s' * (summary['images'] != 1)}"
    items, unit = "images", "images"
    if summary["videos"]:
        videos, chunks = summary["videos"], summary["video_chunks"]
        exported += f", {videos} video{'s' * (videos != 1)} ({chunks} chunk{'s' * (chunks != 1)})"
        items, unit = "images and video chunks", "items"
    steady = summary["steady_items_per_s"]
    start = f"first pack after {summary['first_pack_s']:.1f} s" + (f", then {steady:.1f} {unit}/s" if steady else "")
    return (
        f"exported {exported}, {summary['failed']} failed (see {out / FAILURES_FILE}){skipped}; "
        f"this run processed {summary['images_this_run']} {items} ({summary['exported_this_run']} exported, "
        f"{summary['failed_this_run']} failed) into {summary['tokens_this_run']} tokens in {summary['seconds']:.1f} s "
        f"({summary['images_per_s']:.1f} {unit}/s, {summary['tokens_per_s']:.0f} tokens/s; {start}; "
        f"{summary['data_share']:.0%} of it waiting for decoded images){once}"
    )
