"""Pre-compute the visual tokens of a whole image collection, for LLM alignment training.

    python -m moonvit_projector.export --inputs images/ --checkpoint ckpt/ --out tokens/
    torchrun --nproc-per-node 2 -m moonvit_projector.export --inputs list.txt --checkpoint ckpt/ --out tokens/

The inputs are split, in input order, into shards of ``--shard-size`` images. Shard k is written
to ``shard-{k:06d}.safetensors``: one tensor per stored kind, the images' tokens back to back
(``projected`` (sum n_i, llm_hidden), ``merged`` (sum n_i, 4, D); a ViT tower's (ViT, DeiT,
SigLIP, DINOv2) ``merged`` is (sum n_i, 1, D), each patch one token, and its shards also hold one row
per image of ``prefix_tokens`` (images, n_prefix, D), its CLS (then distillation or register) rows,
where the tower has them, and ``pooled`` (images, D), its pooled vector (the CLS row after the final
norm, SigLIP's MAP head); an image's rows are named by its manifest line's ``prefix_row`` /
``pooled_row``, each tensor described by ``run.json``'s key of its name). Its manifest lines and
failures go to ``parts/shard-{k:06d}.json``. Both files are written to a temporary name and renamed, shard
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

Each image is encoded once. Before any encoding, every input is hashed (SHA-256 of its bytes,
with the header reads of the plan); a later image with the content of an earlier one in the
listing (the first occurrence, in input order, is the one encoded: the same plan on every rank)
is not encoded: its part records ``duplicate_of`` the first copy's id, and ``manifest.jsonl``
gives it the first copy's line (the same ``shard`` and ``offset``, so both ids read the same
rows) under its own ``id`` and ``path``, or the first copy's failure. Video files are not
deduplicated.

``--cache DIR`` keeps a content-addressed store of tokens across exports (layout and key in
:mod:`.cache`): one folder per settings digest, the SHA-256 of the cache format, the weights'
hash, the processor's ``to_dict()``, the dtype, the stored kinds, ``--max-patches-per-pack`` and
the compute description of ``run.json``; one safetensors file per image content hash in it. An
image whose entry is there is not encoded: its tokens are the entry's bytes, i.e. those of the
export that wrote it. An entry made with any other settings lies in another folder and is never
read; an entry that fails its checks (its recorded settings, content hash and tokens' SHA-256) is
encoded again and rewritten. ``--cache`` is not in ``run.json``: a run resumed with or without it
is the same run. The summary counts the copies not encoded and the images reused from the cache.

``--engine ray`` (:mod:`.ray_engine`) computes the same packs in a Ray Data pipeline: decoding in
CPU tasks, encoding in a pool of ``--encoder-actors`` actors that hold the models once, each shard
written by the driver when its last pack is back; for the same ``run.json`` the folder is the
local engine's, byte for byte. The engine is not in ``run.json``: a run started on one engine can
be finished on the other.

An input with nothing to export (no image files, or no image that can be planned) is an error,
and so is a run that exports no image at all; files skipped for their extension are counted.

The package by job: :mod:`.settings` (the typed :class:`ExportRun`), :mod:`.inputs` (what
``--inputs`` names, the ids, the listing's hash), :mod:`.models`, :mod:`.plan` (items and shards
planned from the file headers), :mod:`.cache` (duplicates and the token store, for any engine),
:mod:`.shards` (a shard's work, its tokens and part written atomically, the
manifest assembled), :mod:`.ray_engine` (the Ray pipeline; the only module that imports Ray),
:mod:`.run` (``run.json``, resume, the ranks, the summary) and :mod:`.cli`.
"""

from __future__ import annotations

from moonvit.runs import differences

from .cache import CACHE_FORMAT, TokenCache, cache_settings, cacheable, duplicate_sources, tokens_sha256
from .cli import build_parser, export_run, main
from .inputs import InputImage, Inputs, listing_sha256, read_inputs, scan_inputs
from .models import Models, load_models
from .plan import ExportItem, plan_all, plan_input, shard_ranges, split_balanced
from .run import (
    Progress,
    claim_output,
    describe_run,
    export,
    export_on_ray,
    export_rank,
    pooled_description,
    prefix_description,
)
from .settings import ENGINES, STORES, ExportError, ExportRun
from .shards import (
    ShardResult,
    ShardWork,
    assemble,
    export_shard,
    finish_shard,
    item_id,
    manifest_counts,
    manifest_line,
    part_path,
    shard_name,
    shard_work,
    stored_tensors,
)

__all__ = [
    "CACHE_FORMAT",
    "ENGINES",
    "STORES",
    "ExportError",
    "ExportItem",
    "ExportRun",
    "InputImage",
    "Inputs",
    "Models",
    "Progress",
    "TokenCache",
    "ShardResult",
    "ShardWork",
    "assemble",
    "build_parser",
    "cache_settings",
    "cacheable",
    "claim_output",
    "describe_run",
    "differences",
    "duplicate_sources",
    "export",
    "export_on_ray",
    "export_rank",
    "export_run",
    "export_shard",
    "finish_shard",
    "item_id",
    "listing_sha256",
    "load_models",
    "main",
    "manifest_counts",
    "manifest_line",
    "part_path",
    "plan_all",
    "plan_input",
    "pooled_description",
    "prefix_description",
    "read_inputs",
    "scan_inputs",
    "shard_name",
    "shard_ranges",
    "shard_work",
    "split_balanced",
    "stored_tensors",
    "tokens_sha256",
]
