"""``--engine ray``: the export's packs decoded in Ray CPU tasks and encoded by a pool of actors.

The driver (the process that runs ``python -m projector.export``) does what the local engine does
before and after the forwards: it lists and plans the inputs, claims ``run.json``, finds the copies
of an image and the cache hits, and groups each pending shard's remaining items into packs with
:meth:`.shards.ShardWork.packs`, the very packs the local engine encodes. Those packs go through a
Ray Data pipeline::

    from_items(packs) -> map(decode_pack)            CPU tasks, --workers at once (at least 1)
                      -> map_batches(EncodePacks)    --encoder-actors actors, one pack a call
                      -> iter_rows() on the driver   each shard written when its last pack is back

Each actor loads the models once, with the thread count ``run.json`` records and the same kernels:
an actor whose torch version or CPU kernel level differs from the driver's is refused, since its
tokens could differ in the last bit. So the shards hold the bytes the local engine writes, whichever
actor encodes which pack, in whatever order the packs come back. Tokens travel as pickled tensors
(bf16 included), never through numpy.

Faults are Ray Data's to recover from: a decode task whose worker dies is retried, an encoder
actor that dies is restarted and its pack given again (Ray Data restarts map actors without limit
and retries their calls). A pack's result only reaches a shard once, on the driver, so a retried
pack is neither lost nor doubled. If the driver dies, the shards whose part file was written are
done; the same command redoes the others (as with the local engine).

Without ``--ray-address`` a local Ray instance is started with ``max(1, --workers) +
--encoder-actors`` CPUs and stopped at the end; with it (``auto``, or ``host:port``) the export
joins that cluster, whose nodes must have this package installed. A process that already called
``ray.init`` keeps its own connection. Ray is imported only here.
"""

from __future__ import annotations

import collections
import functools
import logging
import pickle
import platform
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moonvit.cli import torch_dtype
from moonvit.encode import encode_processed, process_pack
from moonvit.media.packing import Pack
from moonvit.media.processor import MoonViTImageProcessor
from moonvit.media.video import MoonViTVideoProcessor

from .models import load_models
from .settings import ExportError, ExportRun
from .shards import Key, ShardResult, ShardWork, finish_shard, stored_tensors

__all__ = ["EncodePacks", "PackResult", "decode_pack", "encode_on_ray", "ray_session"]

DECODE_WORKER_BYTES = 384 * 2**20
"""A decoding worker's own memory: Python with torch and Pillow imported (about 240 MiB measured)."""

PackResult = tuple[dict[Key, dict[str, torch.Tensor]], dict[Key, str]]
"""What an encoder actor gives back for one pack: each encoded item's stored kinds (on the CPU,
in the export dtype) and the reasons of the items that could not be decoded."""


@contextmanager
def ray_session(address: str | None, cpus: int) -> Iterator[None]:
    """Ray for the export: the caller's connection when there is one, else ``address``'s
    cluster, else a local instance of ``cpus`` CPUs, stopped on the way out."""
    try:
        import ray
    except ImportError as error:
        raise ExportError("--engine ray needs Ray: pip install 'moonvit[ray]' (ray[data])") from error
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(
                address=address,
                num_cpus=cpus if address is None else None,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        except (ConnectionError, RuntimeError, ValueError) as error:
            raise ExportError(f"--ray-address {address}: cannot join a Ray cluster there ({error})") from error
    context = ray.data.DataContext.get_current()
    bars, context.enable_progress_bars = context.enable_progress_bars, False  # the export's own bar
    # not a line per pipeline start and end, nor the notice that Ray's own bars are off
    quiet = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
    levels = {name: logging.getLogger(name).level for name in quiet}
    for name, level in quiet.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        context.enable_progress_bars = bars
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if started:
            ray.shutdown()


def decode_pack(
    row: dict[str, Any], processor: MoonViTImageProcessor, video_processor: MoonViTVideoProcessor
) -> dict[str, Any]:
    """A CPU task: one pack's pixels (:func:`~moonvit.encode.process_pack`, undecodable items
    recorded, not raised), pickled for the encoder actor."""
    pack: Pack = pickle.loads(row["pack"])
    processed = process_pack(processor, pack, skip_errors=True, video_processor=video_processor)
    return {"id": row["id"], "processed": pickle.dumps(processed)}


class EncodePacks:
    """An encoder actor: the models loaded once, then one decoded pack per call.

    Refuses to start when its weights, torch version or CPU kernel level are not those of the
    driver's ``run.json`` (``compute``), and runs torch with the thread count recorded there.
    Each call's output row carries the seconds the actor waited for that pack since its previous
    call returned (0 for its first: that wait is the pipeline filling, decoding workers starting
    included, not a steady-state shortfall) and the seconds it spent encoding it.
    """

    def __init__(
        self,
        checkpoint: str,
        store: Sequence[str],
        dtype: str,
        device: str,
        processor_overrides: Mapping[str, Any],
        compute: Mapping[str, Any],
        weights_sha256: str,
    ) -> None:
        torch.set_num_threads(compute["threads"])
        target = torch.device(device)
        if target.type == "cuda":  # Ray gives each actor its GPUs as cuda:0 ..
            target = torch.device("cuda", 0)
        here = {
            "torch": torch.__version__,
            "device_type": target.type,
            "cpu_capability": torch.backends.cpu.get_cpu_capability() if target.type == "cpu" else None,
        }
        differing = {key: (compute[key], value) for key, value in here.items() if compute[key] != value}
        if differing:
            detail = ", ".join(f"{key}: {there!r} in run.json, {now!r} here" for key, (there, now) in differing.items())
            raise ExportError(f"an encoder actor on {platform.node()} would not give run.json's bytes ({detail})")
        self.models = load_models(checkpoint, store, torch_dtype(dtype), target, dict(processor_overrides))
        if self.models.checkpoint_sha256 != weights_sha256:
            raise ExportError(f"--checkpoint {checkpoint} holds other weights on {platform.node()} than the driver's")
        self.store = tuple(store)
        self.idle_since: float | None = None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Encode each pack of the batch (``map_batches(batch_size=1)`` gives one)."""
        start = time.perf_counter()
        results = []
        for payload in batch["processed"]:
            encoded = encode_processed(self.models.encoder, pickle.loads(payload))
            tensors = stored_tensors(encoded, self.models, self.store) if encoded.items else {}
            results.append(pickle.dumps((tensors, encoded.failures)))
        done = time.perf_counter()
        wait = 0.0 if self.idle_since is None else start - self.idle_since
        self.idle_since = done
        count = len(results)
        return {
            "id": batch["id"],
            "result": _objects(results),
            "wait_s": np.full(count, wait / count),
            "encode_s": np.full(count, (done - start) / count),
        }


def encode_on_ray(
    works: Sequence[ShardWork],
    run: ExportRun,
    models_source: Mapping[str, Any],
    show: bool,
    duplicates: Mapping[int, str] | None,
    cache: Any,
    on_pack: Callable[[int], None] | None = None,
) -> tuple[list[ShardResult], float, float]:
    """Encode the packs of ``works`` (the shards still to write) on Ray and write each shard as
    its last pack comes back.

    ``models_source`` holds what an actor needs to load the models as the driver did
    (``checkpoint``, ``processor_overrides``, ``compute``, ``weights_sha256``, ``processor``,
    ``video_processor``). ``on_pack`` is called with the number of packs back so far after each
    (a hook for progress displays and fault drills). Returns (the shards' results in the order
    they were written, the seconds the actors waited for decoded packs, the seconds they encoded).
    """
    import ray

    packs: list[tuple[int, Pack]] = [
        (w, pack) for w, work in enumerate(works) for pack in work.packs(run.max_patches_per_pack)
    ]
    remaining = collections.Counter(w for w, _ in packs)
    results: list[ShardResult] = []
    waited = encoding = 0.0
    with tqdm(total=sum(len(work.planned) for work in works), unit="img", desc="export", disable=not show) as bar:

        def write(w: int) -> None:
            results.append(finish_shard(works[w], run.kinds, run.out, duplicates, cache))
            bar.update(len(works[w].planned))

        for w in [w for w in range(len(works)) if remaining[w] == 0]:  # nothing to encode
            write(w)
        if packs:
            rows = [{"id": i, "pack": pickle.dumps(pack)} for i, (_, pack) in enumerate(packs)]
            decode = functools.partial(
                decode_pack,
                processor=models_source["processor"],
                video_processor=models_source["video_processor"],
            )
            decoded = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
                decode,
                num_cpus=1,
                # declared (the worker, a pack's pixels twice): also what keeps Ray Data from
                # fusing the decoding into the encoder actors, which would serialise the two
                memory=DECODE_WORKER_BYTES
                + 2 * run.max_patches_per_pack * 3 * models_source["processor"].patch_size ** 2 * 4,
                compute=ray.data.TaskPoolStrategy(size=max(1, run.workers)),
            )
            cuda = torch.device(run.device).type == "cuda"
            encoded = decoded.map_batches(
                EncodePacks,
                fn_constructor_kwargs={
                    "checkpoint": models_source["checkpoint"],
                    "store": run.kinds,
                    "dtype": run.dtype,
                    "device": run.device,
                    "processor_overrides": models_source["processor_overrides"],
                    "compute": models_source["compute"],
                    "weights_sha256": models_source["weights_sha256"],
                },
                batch_size=1,
                compute=ray.data.ActorPoolStrategy(size=run.encoder_actors),
                num_cpus=1,
                num_gpus=1 if cuda else 0,
            )
            seen: set[int] = set()
            for row in _rows(encoded):
                pack_id = int(row["id"])
                if pack_id in seen:  # a retried pack that came back twice: its first copy counts
                    continue
                seen.add(pack_id)
                tensors, failures = pickle.loads(row["result"])
                w = packs[pack_id][0]
                works[w].add(tensors, failures)
                waited += float(row["wait_s"])
                encoding += float(row["encode_s"])
                remaining[w] -= 1
                if remaining[w] == 0:
                    write(w)
                if on_pack is not None:
                    on_pack(len(seen))
            missing = [w for w, count in remaining.items() if count]
            if missing:
                raise ExportError(
                    f"Ray returned no result for some packs of shards {[works[w].index for w in missing]}"
                )
    return results, waited, encoding


def _rows(dataset: Any) -> Iterator[dict[str, Any]]:
    """The pipeline's output rows; a failure Ray could not recover from as an :class:`ExportError`
    (an actor refused by its own checks, a task that failed for its inputs' sake)."""
    import ray

    try:
        yield from dataset.iter_rows()
    except ray.exceptions.RayError as error:
        cause = error.as_instanceof_cause() if isinstance(error, ray.exceptions.RayTaskError) else error
        raise ExportError(f"the Ray pipeline failed: {_last_line(cause)}") from error


def _last_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def _objects(values: Sequence[bytes]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out
