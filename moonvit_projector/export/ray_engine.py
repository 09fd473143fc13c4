"""``--engine ray``: the export's packs decoded in Ray CPU tasks and encoded by a pool of actors.

The driver (the process that runs ``python -m moonvit_projector.export``) does what the local engine does
before and after the forwards: it lists and plans the inputs, claims ``run.json``, finds the copies
of an image and the cache hits, and groups each pending shard's remaining items into packs with
:meth:`.shards.ShardWork.packs`, the very packs the local engine encodes. Those packs go through a
Ray Data pipeline::

    from_items(packs) -> map(decode_pack)            CPU tasks, --workers at once (at least 1)
                      -> map_batches(EncodePacks)    --encoder-actors actors, one pack a call
                      -> iter_rows() on the driver   each shard written when its last pack is back

Each actor loads the models once, with the thread count ``run.json`` records and the same kernels:
an actor whose torch version, CPU kernel level or bf16 units differ from the driver's is refused, and
so is a decoding task with another Pillow, since the bytes could differ in the last bit. So the
shards hold the bytes the local engine writes, whichever actor encodes which pack, in whatever order
the packs come back. Tokens travel as pickled tensors (bf16 included, each item its own copy),
never through numpy.

Faults are Ray Data's to recover from: a decode task whose worker dies is retried, an encoder
actor that dies is restarted and its pack given again (Ray Data restarts map actors without limit
and retries their calls). A pack's result only reaches a shard once, on the driver, so a retried
pack is neither lost nor doubled. If the driver dies, the shards whose part file was written are
done; the same command redoes the others (as with the local engine).

Without ``--ray-address`` a local Ray instance is started with the CPUs the tasks and actors take
(an actor on CPU takes ``run.json``'s thread count) and stopped at the end; it is not started when
no pack needs a forward. On CUDA a one-GPU task first resolves the attention backend where the
actors run (:func:`actors_attention`: flash-attn may be installed there and not on the driver), and
``run.json`` records that. With ``--ray-address`` (``auto``, or ``host:port``) the export joins that
cluster, whose nodes must have this package installed. A process that already called ``ray.init``
keeps its own connection. Ray is imported only here.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import pickle
import platform
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import PIL
import torch
from tqdm import tqdm

from moonvit.cli import torch_dtype
from moonvit.encode import encode_processed, process_pack
from moonvit.media.packing import Pack
from moonvit.media.processor import ImageProcessor
from moonvit.media.video import MoonViTVideoProcessor
from moonvit.model.attention import resolve_attn_implementation
from moonvit.ray_data import object_column
from moonvit.runs import compute_facts, describe_differences, differences

from .models import load_models
from .settings import ExportError, ExportRun
from .shards import Key, ShardResult, ShardWork, finish_shard, stored_tensors

__all__ = ["EncodePacks", "PackResult", "RayRun", "actors_attention", "decode_pack", "encode_on_ray", "ray_session"]

DECODE_WORKER_BYTES = 384 * 2**20
"""A decoding worker's own memory: Python with torch and Pillow imported (about 240 MiB measured)."""

PackResult = tuple[dict[Key, dict[str, torch.Tensor]], dict[Key, str]]
"""What an encoder actor gives back for one pack: each encoded item's stored kinds (on the CPU,
in the export dtype) and the reasons of the items that could not be decoded."""


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""The logger of the notice that a new local Ray enables token authentication (and of the token's
creation): a line on every start of the export's own instance, not a thing to act on."""

RAY_DATA_LOGGERS = {"ray.data": logging.WARNING, "ray.data._internal.progress": logging.ERROR}
"""Ray Data's loggers, quieted while the export's pipeline runs: not a line per pipeline start and
end, nor the notice that Ray's own bars are off (its warnings and errors still show)."""


@contextmanager
def ray_session(address: str | None, cpus: int, gpus: int = 0) -> Iterator[None]:
    """Ray for the export: the caller's connection when there is one, else ``address``'s
    cluster, else a local instance of ``cpus`` CPUs (never a cluster that happens to run on this
    machine), stopped on the way out. A local instance with fewer GPUs than ``gpus`` is refused
    (its actors would wait for them for ever); a caller's or a cluster's with fewer CPUs or GPUs
    than the pipeline takes is warned about (a cluster may grow to them).

    A local instance starts without Ray's token-authentication notice, and while it runs the
    records its C++ core writes to this process's stderr are left out there
    (:func:`without_ray_records`; the session's log folder keeps them)."""
    try:
        import ray
    except ImportError as error:
        raise ExportError("--engine ray needs Ray: pip install 'moonvit[ray]' (ray[data])") from error
    started = not ray.is_initialized()
    if started:
        _start_ray(ray, address, cpus)
    local = started and address is None
    with without_ray_records() if local else contextlib.nullcontext():
        try:
            _check_resources(ray, local, cpus, gpus)
            with _pipeline_settings(ray), logger_levels(RAY_DATA_LOGGERS):
                yield
        finally:
            if started:
                ray.shutdown()


def _start_ray(ray: Any, address: str | None, cpus: int) -> None:
    """``ray.init`` for the export: a local instance of ``cpus`` CPUs (its start's token notice
    left out) when ``address`` is None, else that cluster."""
    quiet = {RAY_AUTH_LOGGER: logging.ERROR} if address is None else {}
    try:
        with logger_levels(quiet):
            ray.init(
                address="local" if address is None else address,
                num_cpus=cpus if address is None else None,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ExportError(f"--ray-address {address}: cannot join a Ray cluster there ({error})") from error


def _check_resources(ray: Any, local: bool, cpus: int, gpus: int) -> None:
    """Refuse a local instance without ``gpus`` GPUs; warn where Ray has fewer CPUs or GPUs than
    the pipeline takes (a cluster may grow to them; until then the pipeline waits)."""
    have = ray.cluster_resources()
    if local and have.get("GPU", 0) < gpus:
        found = int(have.get("GPU", 0))
        raise ExportError(f"--encoder-actors {gpus} on CUDA needs {gpus} GPUs; this machine's Ray sees {found}")
    short = [
        f"{need} {kind} ({have.get(kind, 0):g} now)"
        for kind, need in (("CPU", cpus), ("GPU", gpus))
        if have.get(kind, 0) < need
    ]
    if short:
        logging.getLogger("moonvit").warning(
            "the export's Ray pipeline needs %s: it waits until Ray has them", ", ".join(short)
        )


@contextmanager
def _pipeline_settings(ray: Any) -> Iterator[None]:
    """Ray Data's context for the export, restored on the way out: no progress bars of Ray's own
    (the export has its bar) and a failure's own exception, not Ray's wrapper around it."""
    context = ray.data.DataContext.get_current()
    settings = {"enable_progress_bars": False, "raise_original_map_exception": True}
    before = {name: getattr(context, name) for name in settings}
    for name, value in settings.items():
        setattr(context, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(context, name, value)


@contextmanager
def logger_levels(levels: Mapping[str, int]) -> Iterator[None]:
    """The named loggers at the given levels, their own levels restored on the way out."""
    before = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    try:
        yield
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def _record_tokens() -> list[str]:
    """The pieces (regular expressions) of a record Ray's C++ core logs below the fatal level,
    ``[2024-05-01 12:00:00,123 E 4242 4242] core_worker.cc:2465: ...``, in order."""
    stamp = [r"\d" if char == "0" else re.escape(char) for char in "0000-00-00 00:00:00,000"]
    return [r"\[", *stamp, " ", "[DIWE]", " ", r"\d+", " ", r"\d+", r"\]", " ", r"[^\n]*"]


def _prefixes(tokens: Sequence[str]) -> re.Pattern[bytes]:
    """A pattern whose full matches are the prefixes of the sequence ``tokens``, empty included."""
    pattern = ""
    for token in reversed(tokens):
        pattern = f"(?:{token}{pattern})?"
    return re.compile(pattern.encode())


RAY_RECORD = re.compile(("".join(_record_tokens()) + r"\n").encode())
"""One whole record of Ray's C++ core (debug to error), its line end included."""
RAY_RECORD_START = _prefixes(_record_tokens())
"""A text that may still become a record of Ray's C++ core as more of the stream comes."""
HELD_AT_MOST = 1 << 20
"""Bytes held back as a possible record's start before they are passed on anyway."""


class RayRecordFilter:
    """A byte stream with the records of Ray's C++ core left out and everything else passed on as
    it comes: only a tail that may still become such a record is held back, until the next data
    tells (a record can start after a partial line, such as a progress bar's)."""

    def __init__(self) -> None:
        self.held = b""

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (after what was held) to pass on now."""
        text = RAY_RECORD.sub(b"", self.held + data)
        start = self._record_start(text)
        self.held = text[start:]
        return text[:start]

    def flush(self) -> bytes:
        """The held tail, at the stream's end: it did not become a record."""
        rest, self.held = self.held, b""
        return rest

    @staticmethod
    def _record_start(text: bytes) -> int:
        """Where the tail of ``text`` that may still become a record begins (its length if none)."""
        line = text.rfind(b"\n") + 1
        start = text.find(b"[", line)
        while start != -1 and len(text) - start <= HELD_AT_MOST:
            if RAY_RECORD_START.fullmatch(text, start):
                return start
            start = text.find(b"[", start + 1)
        return len(text)


@contextmanager
def without_ray_records() -> Iterator[None]:
    """This process's stderr (file descriptor 2) passed on through a :class:`RayRecordFilter`.

    Ray's C++ core writes its records to descriptor 2 directly, where Python's stderr writes too,
    so a filter on that descriptor is the one way to leave out such a record and keep everything
    else: the progress bar, warnings, a failure's traceback. A core worker's records are in the
    session's log folder as well (``python-core-driver-*.log``); a fatal one is passed on."""
    sys.stderr.flush()
    try:
        terminal = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    source, sink = os.pipe()
    os.dup2(sink, 2)
    os.close(sink)
    thread = threading.Thread(target=_pass_on, args=(source, terminal), name="ray-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, 2)  # the pipe's last writer closed: the thread passes on the rest and ends
        thread.join(timeout=10)


def _pass_on(source: int, target: int) -> None:
    """Copy descriptor ``source`` to ``target`` until its end, Ray's records left out; both closed after."""
    records = RayRecordFilter()
    try:
        while chunk := os.read(source, 1 << 16):
            _write_all(target, records.feed(chunk))
        _write_all(target, records.flush())
    except OSError:  # stderr itself went away: nothing left to show it on
        pass
    finally:
        os.close(source)
        os.close(target)


def _write_all(target: int, data: bytes) -> None:
    """All of ``data`` to descriptor ``target`` (a write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[os.write(target, view) :]


def actors_attention(run: ExportRun, requested: str) -> str:
    """The attention backend an encoder actor on a GPU resolves ``requested`` to, asked of Ray in
    one task on one GPU (a session of its own, like the pipeline's): what ``run.json`` records and
    every actor is then checked against.

    Raises:
        ExportError: no GPU is there, or the backend cannot run on it (its reason).
    """
    import ray

    with ray_session(run.ray_address, 1, 1):
        task = ray.remote(num_gpus=1, num_cpus=1)(_resolve_attention)
        try:
            return str(ray.get(task.remote(requested, run.dtype)))
        except ray.exceptions.RayError as error:
            cause = _root_cause(error)
            raise ExportError(f"an encoder actor's GPU cannot run attention {requested!r}: {cause}") from error


def _resolve_attention(requested: str, dtype: str) -> str:
    """On an actor: ``requested`` resolved on its GPU (``cuda:0``, as Ray gives it)."""
    return resolve_attn_implementation(requested, torch.device("cuda", 0), torch_dtype(dtype))


def _check_same(expected: Mapping[str, Any], here: Mapping[str, Any], what: str) -> None:
    """Refuse ``what`` where a setting of ``here`` differs from the driver's (``expected``, which may hold more)."""
    changes = differences({key: expected[key] for key in here}, dict(here))
    if changes:
        detail = describe_differences(changes, "{key}: {before!r} on the driver, {after!r} here", ", ")
        raise ExportError(f"{what} on {platform.node()} would not give the driver's bytes ({detail})")


def decode_pack(
    row: dict[str, Any], processor: ImageProcessor, video_processor: MoonViTVideoProcessor, pillow: str
) -> dict[str, Any]:
    """A CPU task: one pack's pixels (:func:`~moonvit.encode.process_pack`, undecodable items
    recorded, not raised), pickled for the encoder actor. Refused where Pillow is not the
    driver's version (``pillow``): its resize is part of the bytes."""
    _check_same({"pillow": pillow}, {"pillow": PIL.__version__}, "a decoding task")
    pack: Pack = pickle.loads(row["pack"])
    processed = process_pack(processor, pack, skip_errors=True, video_processor=video_processor)
    return {"id": row["id"], "processed": pickle.dumps(processed)}


class EncodePacks:
    """An encoder actor: the models loaded once, then one decoded pack per call.

    Refuses to start when its weights or compute facts (torch version, CPU kernel level, bf16 units,
    Pillow: :func:`moonvit.runs.compute_facts`) or attention backend are not those of the
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
        attn: str = "auto",
        projector_from: str | None = None,
    ) -> None:
        torch.set_num_threads(compute["threads"])
        target = torch.device(device)
        if target.type == "cuda":  # Ray gives each actor its GPUs as cuda:0 ..
            target = torch.device("cuda", 0)
        _check_same(compute, compute_facts(target), "an encoder actor")
        self.models = load_models(
            checkpoint, store, torch_dtype(dtype), target, dict(processor_overrides), attn, projector_from
        )
        _check_same(compute, {"attention": self.models.attention(target)}, "an encoder actor")
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
            # each item its own copy: a pickled view carries its whole pack's buffer
            owned = {key: {kind: t.clone() for kind, t in kinds.items()} for key, kinds in tensors.items()}
            results.append(pickle.dumps((owned, encoded.failures)))
        done = time.perf_counter()
        wait = 0.0 if self.idle_since is None else start - self.idle_since
        self.idle_since = done
        count = len(results)
        return {
            "id": batch["id"],
            "result": object_column(results),
            "wait_s": np.full(count, wait / count),
            "encode_s": np.full(count, (done - start) / count),
        }


@dataclass
class RayRun:
    """What :func:`encode_on_ray` did: the shards written, in the order they were, and its clocks."""

    results: list[ShardResult]
    start: float
    """``time.perf_counter()`` once Ray was up (or when the shards needing no forward were written)."""
    seconds: float
    """From ``start`` to the last shard written: the actors' start included."""
    waited: float
    """Seconds the actors waited for decoded packs, summed (their first wait left out)."""
    encoding: float
    """Seconds the actors encoded, summed."""


def encode_on_ray(
    works: Sequence[ShardWork],
    run: ExportRun,
    models_source: Mapping[str, Any],
    show: bool,
    duplicates: Mapping[int, str] | None,
    cache: Any,
    on_pack: Callable[[int], None] | None = None,
) -> RayRun:
    """Encode the packs of ``works`` (the shards still to write) on Ray and write each shard as
    its last pack comes back; shards that need no forward are written first, and Ray is not
    started when no shard needs one.

    ``models_source`` holds what an actor needs to load the models as the driver did
    (``checkpoint``, ``projector_from``, ``processor_overrides``, ``compute``, ``weights_sha256``,
    ``processor``, ``video_processor``). ``on_pack`` is called with the number of packs back so
    far after each (a hook for progress displays and fault drills).
    """
    packs: list[tuple[int, Pack]] = [
        (w, pack) for w, work in enumerate(works) for pack in work.packs(run.max_patches_per_pack)
    ]
    remaining = collections.Counter(w for w, _ in packs)
    results: list[ShardResult] = []
    clocks = {"waited": 0.0, "encoding": 0.0}
    cuda = torch.device(run.device).type == "cuda"
    # a CPU actor runs run.json's thread count: it takes that many of the node's CPUs
    actor_cpus = 1 if cuda else models_source["compute"]["threads"]
    with tqdm(total=sum(len(work.planned) for work in works), unit="img", desc="export", disable=not show) as bar:

        def write(w: int) -> None:
            results.append(finish_shard(works[w], run.kinds, run.out, duplicates, cache))
            bar.update(len(works[w].planned))

        start = time.perf_counter()
        for w in [w for w in range(len(works)) if remaining[w] == 0]:  # nothing to encode
            write(w)
        if packs:
            cpus = max(1, run.workers) + run.encoder_actors * actor_cpus
            with ray_session(run.ray_address, cpus, run.encoder_actors if cuda else 0):
                start = time.perf_counter()  # Ray is up: from here on the pipeline, the actors' start included
                dataset = _pipeline(packs, run, models_source, actor_cpus, cuda)
                _collect(dataset, packs, works, remaining, write, clocks, on_pack)
    return RayRun(results, start, time.perf_counter() - start, clocks["waited"], clocks["encoding"])


def _pipeline(
    packs: Sequence[tuple[int, Pack]], run: ExportRun, source: Mapping[str, Any], actor_cpus: int, cuda: bool
) -> Any:
    """The Ray Data pipeline over ``packs``: decoding tasks, then the encoder actors."""
    import ray

    rows = [{"id": i, "pack": pickle.dumps(pack)} for i, (_, pack) in enumerate(packs)]
    decode = functools.partial(
        decode_pack,
        processor=source["processor"],
        video_processor=source["video_processor"],
        pillow=source["compute"]["host"]["pillow"],
    )
    decoded = ray.data.from_items(rows, override_num_blocks=len(rows)).map(
        decode,
        num_cpus=1,
        # declared (the worker, a pack's pixels twice): also what keeps Ray Data from
        # fusing the decoding into the encoder actors, which would serialise the two
        memory=DECODE_WORKER_BYTES
        + 2 * run.max_patches_per_pack * len(source["processor"].image_mean) * source["processor"].patch_size ** 2 * 4,
        compute=ray.data.TaskPoolStrategy(size=max(1, run.workers)),
    )
    return decoded.map_batches(
        EncodePacks,
        fn_constructor_kwargs={
            "checkpoint": source["checkpoint"],
            "store": run.kinds,
            "dtype": run.dtype,
            "device": run.device,
            "processor_overrides": source["processor_overrides"],
            "compute": source["compute"],
            "weights_sha256": source["weights_sha256"],
            "attn": run.attn,
            "projector_from": source["projector_from"],
        },
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=run.encoder_actors),
        num_cpus=actor_cpus,
        num_gpus=1 if cuda else 0,
    )


def _collect(
    dataset: Any,
    packs: Sequence[tuple[int, Pack]],
    works: Sequence[ShardWork],
    remaining: collections.Counter[int],
    write: Callable[[int], None],
    clocks: dict[str, float],
    on_pack: Callable[[int], None] | None,
) -> None:
    """Hand each pack's result to its shard, once, and write a shard when its last pack is in."""
    seen: set[int] = set()
    for row in _rows(dataset):
        pack_id = int(row["id"])
        if pack_id in seen:  # a retried pack that came back twice: its first copy counts
            continue
        seen.add(pack_id)
        tensors, failures = pickle.loads(row["result"])
        w = packs[pack_id][0]
        works[w].add(tensors, failures)
        clocks["waited"] += float(row["wait_s"])
        clocks["encoding"] += float(row["encode_s"])
        remaining[w] -= 1
        if remaining[w] == 0:
            write(w)
        if on_pack is not None:
            on_pack(len(seen))
    missing = [works[w].index for w, count in remaining.items() if count]
    if missing:
        raise ExportError(f"Ray returned no result for some packs of shards {missing}")


def _rows(dataset: Any) -> Iterator[dict[str, Any]]:
    """The pipeline's output rows; a failure Ray could not recover from as an :class:`ExportError`
    with its own message (an actor or task refused by its checks: that refusal's text; anything
    else: the original exception's type and first line), not Ray's wrapper around it."""
    import ray

    try:
        yield from dataset.iter_rows()
    except ray.exceptions.RayError as error:
        cause = _root_cause(error)
        if isinstance(cause, ExportError) and not isinstance(cause, ray.exceptions.RayError):
            raise ExportError(str(cause)) from error
        lines = [line for line in str(cause).splitlines() if line.strip()]
        reason = f"{type(cause).__name__}: {lines[-1].strip() if lines else ''}"
        raise ExportError(f"the Ray pipeline failed: {reason}") from error


def _root_cause(error: BaseException) -> BaseException:
    """The exception a Ray error wraps: Ray's task errors keep it as ``cause``, Ray Data's as ``__cause__``."""
    seen: set[int] = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "cause", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error
