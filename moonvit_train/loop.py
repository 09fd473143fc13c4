"""``python -m moonvit_train``: the run itself.

Build the run (:mod:`moonvit_train.build`), resume its state if ``--out`` holds it (refusing another run,
naming what differs), fix the step count (``--steps``, ``--epochs`` from simulated packs, or
``--minutes`` from timed steps, the calibration kept with the state), then step
(:class:`moonvit_train.trainer.Trainer`), validating at ``--evals`` points and saving every
``--save-every`` steps and at the end. At the end: export the encoder and the objective's files,
score the test split once, and, with ``--probe-dataset``, linear-probe the exported encoder.
"""

from __future__ import annotations

import contextlib
import copy
import json
import platform
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

import moonvit
from moonvit.cli import apply_threads, one_line_warnings, torch_dtype
from moonvit.distributed import Ranks, close_ranks, init_ranks
from moonvit.files import write_text_atomic
from moonvit.model.linear import cpu_has_bf16_arithmetic
from moonvit.names import display_name
from moonvit.perf import matmul_peak
from moonvit_eval.datasets import DatasetError, load_dataset

from .batch import UnreadableImageError
from .build import TrainError, build_encoder, build_plan, describe, steps_for_epochs
from .checkpoint import RunMismatch, check_same_run, load_state, save_state, state_path
from .config import TrainConfig, parse_args, run_defining
from .data import UNLABELLED_PREFIX, DataError, load_training_data
from .evaluation import calibrate, draw, evaluate, validate
from .log import MetricsLog, plot_curves
from .objectives import OBJECTIVES
from .trainer import StepFeed, Trainer

__all__ = ["TrainError", "main", "run"]


def calibrate_steps(trainer: Trainer, minutes: float) -> tuple[int, dict[str, float]]:
    """Steps that fit ``minutes``: the first step's packs run forward and backward three times (no update),
    one validation pass is timed, and the step count leaves room for the ``--evals`` validations."""
    probe = copy.deepcopy(trainer.plan.packer)
    packs = [probe.next_pack(0.0) for _ in range(trainer.plan.packs_per_step)]
    times = []
    for _ in range(3):
        start = time.perf_counter()
        trainer.forward_backward(0, packs)
        times.append(time.perf_counter() - start)
        trainer.parallel.module.zero_grad(set_to_none=True)
    start = time.perf_counter()
    evaluate(trainer, trainer.data.val)
    val_s = time.perf_counter() - start
    measured = trainer.ranks.max(torch.tensor([float(np.median(times)), val_s], dtype=torch.float64))
    step_s, val_s = float(measured[0]), float(measured[1])
    budget_s = minutes * 60 - trainer.config.runtime.evals * val_s
    steps = max(1, int(budget_s / (step_s * 1.03)))  # 3%: the optimizer step and logging
    return int(trainer.ranks.from_main(steps)), {"step_s": step_s, "val_s": val_s}


def save(trainer: Trainer, identity: dict[str, Any]) -> None:
    """Write the trainer's state (every rank takes part in gathering it; the main rank writes it)."""
    state = trainer.state_dict()
    if trainer.ranks.is_main:
        args = {k: str(v) for k, v in trainer.config.flat().items()}
        save_state(state_path(trainer.config.run.out), {"run": identity, "args": args, **state})
    trainer.ranks.barrier()
    trainer.saved_step = trainer.step


def run(config: TrainConfig, ranks: Ranks, device: torch.device) -> dict[str, Any]:
    out = config.run.out
    out.mkdir(parents=True, exist_ok=True)
    objective_class = OBJECTIVES[config.run.objective]
    encoder, processor = build_encoder(config)
    data = load_training_data(
        config.data.dataset,
        config.data.data_dir,
        config.data.val_fraction,
        config.run.seed,
        processor,
        config.data.eval_limit,
        skip_bad=config.data.skip_bad_images,
        progress=config.runtime.progress and ranks.is_main,
        labelled=objective_class.needs_labels,
    )
    if config.data.probe_dataset is not None:
        _check_probe_dataset(config)
    if ranks.is_main:
        for message in data.warnings:
            warnings.warn(message, stacklevel=1)
        if device.type == "cpu" and config.runtime.dtype == "bf16" and not cpu_has_bf16_arithmetic():
            warnings.warn(
                "--dtype bf16 on a CPU without bf16 arithmetic (no AVX512-BF16 or AMX): autocast's bf16 matmuls "
                "are emulated here, several times slower than --dtype fp32",
                stacklevel=1,
            )
        if data.skipped:
            first = data.skipped[0]
            warnings.warn(
                f"--skip-bad-images left out {len(data.skipped)} unreadable images (the first: "
                f"{display_name(first.path)}: {first.reason}); all are listed in results.json",
                stacklevel=1,
            )
    objective = objective_class.from_config(encoder, data.classes, config)
    plan = build_plan(config, encoder.config, data, ranks, objective.grid_unit)
    identity = {
        **run_defining(config),
        "--packs-per-step": plan.packs_per_step,  # resolved: the default follows the world size
        "dataset_fingerprint": data.fingerprint,
        "encoder": describe(encoder.config),
    }
    saved = load_state(state_path(out))
    threads_warning = None
    if saved is not None:
        check_same_run(saved["run"], identity, out)
        threads_warning = _threads_warning(saved)
        if ranks.is_main and threads_warning is not None:
            warnings.warn(threads_warning, stacklevel=1)
    trainer = Trainer(config, ranks, device, encoder, processor, objective, data, plan)
    if saved is None and objective.calibration_images:
        summary = calibrate(trainer)  # a resumed run restores what it set, with the objective's state
        if ranks.is_main:
            described = ", ".join(f"{k} {v:g}" for k, v in summary.items())
            print(f"{config.run.objective}: calibrated on {described}", flush=True)

    calibration: dict[str, float] = {}
    if saved is not None:
        total = saved["total_steps"]
    elif config.run.steps is not None:
        total = config.run.steps
    elif config.run.epochs is not None:
        total = steps_for_epochs(plan, config.run.epochs)
    else:
        assert config.run.minutes is not None
        total, calibration = calibrate_steps(trainer, config.run.minutes)
    trainer.start(total)
    if saved is not None:
        trainer.load_state_dict(saved)
        if threads_warning is not None:
            trainer.warnings.append(threads_warning)  # kept with the state: results.json records it
        if ranks.is_main and trainer.step < total:
            print(f"resuming {out} at step {trainer.step} of {total} ({ranks.world_size} ranks)", flush=True)
    else:
        trainer.calibration = calibration
    results_file = out / "results.json"
    if trainer.step == total and results_file.is_file():
        if ranks.is_main:
            print(f"{out} holds a finished run ({total} steps); results in {results_file}")
        return json.loads(results_file.read_text())

    peak = _peak_flops(config, device) * ranks.world_size
    log = MetricsLog(out / "metrics.jsonl", trainer.step, enabled=ranks.is_main)
    eval_steps = (
        {round(total * (k + 1) / config.runtime.evals) for k in range(config.runtime.evals)}
        if config.runtime.evals
        else set()
    )
    bar = tqdm(
        total=total,
        initial=trainer.step,
        desc="train",
        unit="step",
        disable=not (ranks.is_main and config.runtime.progress),
    )
    smoothed: dict[str, float] = {}
    feed = StepFeed(trainer, total, config.runtime.workers)
    try:
        while trainer.step < total:
            packs, plan_state, rendered = feed.next(trainer.step)
            record = trainer.train_step(packs, rendered, plan_state)
            record["mfu"] = record["tflops"] * 1e12 / peak
            log.write(record)
            for name in ("loss", "images_per_s", "patches_per_s", "mfu"):
                smoothed[name] = record[name] if name not in smoothed else 0.9 * smoothed[name] + 0.1 * record[name]
            bar.set_postfix(
                loss=f"{smoothed['loss']:.3f}",
                lr=f"{record['lr']:.2e}",
                img_s=f"{smoothed['images_per_s']:.0f}",
                patch_s=f"{smoothed['patches_per_s']:.0f}",
                mfu=f"{smoothed['mfu']:.1%}",
                refresh=False,
            )
            bar.update()
            if trainer.step in eval_steps:
                with trainer.averaged():  # with --ema, the weights the run saves
                    validation = validate(trainer)
                log.write(validation)
                if ranks.is_main:
                    bar.write(f"step {trainer.step}: validation " + _summary(validation))
            if trainer.step == total or (config.runtime.save_every and trainer.step % config.runtime.save_every == 0):
                save(trainer, identity)
    except KeyboardInterrupt:
        raise Interrupted(_interrupted_message(out, trainer)) from None
    finally:
        feed.close()
        bar.close()  # ends the bar's line before anything else is printed
    with interruptible(out, trainer):
        return finish(trainer)


class Interrupted(Exception):
    """Ctrl-C during a run; its message is the one line :func:`main` prints instead of a traceback."""


@contextlib.contextmanager
def interruptible(out: Path, trainer: Trainer | None = None) -> Iterator[None]:
    """Turn Ctrl-C (KeyboardInterrupt) within it into :class:`Interrupted`, saying which step's state is
    kept (the last checkpoint: a save is atomic, so one cut short leaves the one before) and how to resume."""
    try:
        yield
    except KeyboardInterrupt:
        raise Interrupted(_interrupted_message(out, trainer)) from None


def _interrupted_message(out: Path, trainer: Trainer | None) -> str:
    """The line for Ctrl-C: where the run was (``trainer``: None while it is being set up) and what is kept."""
    path = state_path(out)
    if trainer is None:
        where = "while setting up the run"
        kept = f"the checkpoint in {path} is kept" if path.is_file() else None
    else:
        where = (
            f"at step {trainer.step + 1} of {trainer.total}" if trainer.step < trainer.total else "after the last step"
        )
        kept = None if trainer.saved_step is None else f"the checkpoint of step {trainer.saved_step} is kept in {path}"
    if kept is None:
        return f"interrupted {where}: no checkpoint had been written yet; the same command starts the run again"
    return f"interrupted {where}: {kept}; the same command resumes from it"


def _threads_warning(saved: dict[str, Any]) -> str | None:
    """The warning for resuming ``saved`` with another thread count than it was saved with, or None."""
    threads, now = saved.get("threads"), torch.get_num_threads()
    if threads is None or threads == now:
        return None
    return (
        f"resuming with {now} threads, where the run so far used {threads} (to step {saved['step']}): CPU kernels "
        "split their sums by thread count, so the result will not be bit-identical to an uninterrupted run "
        f"(--threads {threads} keeps it so)"
    )


def _check_probe_dataset(config: TrainConfig) -> None:
    """Refuse a ``--probe-dataset`` that cannot be probed before any training."""
    spec = config.data.probe_dataset or ""
    if spec.startswith(UNLABELLED_PREFIX):
        raise DataError(f"--probe-dataset {spec}: a linear probe needs labels (imagefolder:DIR, digits, ...)")
    try:
        load_dataset(spec, config.data.data_dir, seed=config.run.seed)
    except DatasetError as error:
        raise DataError(f"--probe-dataset {spec}: {error}") from error


def _summary(record: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k not in ("kind", "step"))


def _peak_flops(config: TrainConfig, device: torch.device) -> float:
    """FLOP/s of one process's matmuls in the autocast dtype: given, or measured now."""
    if config.runtime.peak_tflops:
        return config.runtime.peak_tflops * 1e12
    return matmul_peak(torch_dtype(config.runtime.dtype), 2048 if device.type == "cpu" else 8192, 3, device)


def probe(config: TrainConfig) -> dict[str, Any]:
    """``python -m moonvit_eval.linear_probe`` on the exported encoder and ``--probe-dataset``, its results in
    ``<out>/probe`` (the figures it prints, also in results.json)."""
    from moonvit_eval.linear_probe import main as probe_main

    argv = ["--checkpoint", str(config.run.out / "checkpoint"), "--dataset", str(config.data.probe_dataset)]
    argv += ["--out", str(config.run.out / "probe"), "--short-side", str(config.data.eval_resolution), "--no-baseline"]
    argv += [
        "--threads",
        str(torch.get_num_threads()),
        "--device",
        config.runtime.device,
        "--seed",
        str(config.run.seed),
    ]
    if config.data.data_dir is not None:
        argv += ["--data-dir", str(config.data.data_dir)]
    result = probe_main(argv)
    return {"dataset": config.data.probe_dataset, "top1": result["top1"], "results": "probe/results.json"}


def finish(trainer: Trainer) -> dict[str, Any]:
    """Export, score the test split once (where there is one), probe, write results.json and the curves;
    with ``--ema``, all of it on the moving average of the weights."""
    config, out, ranks, data = trainer.config, trainer.config.run.out, trainer.ranks, trainer.data
    with trainer.averaged():
        files = trainer.export()
        if draw(trainer, out / "pictures.png"):
            files.append("pictures.png")
        val, _ = evaluate(trainer, data.val)
        test_outputs = None if data.test is None else evaluate(trainer, data.test, outputs=True)[1]
    if not ranks.is_main:
        return {}
    test = None
    if data.test is not None:
        assert test_outputs is not None
        test = trainer.objective.report(test_outputs, torch.from_numpy(data.test.labels), data.classes)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r["kind"] == "train"]
    timed = steps[min(5, len(steps) - 1) :] if steps else []
    results = {
        "objective": config.run.objective,
        "dataset": data.name,
        "test": test,
        "val": {"loss": val["loss"], **trainer.objective.metrics(val)},
        "probe": probe(config) if config.data.probe_dataset is not None else None,
        "steps": trainer.step,
        "images_seen": trainer.images_seen,
        "epochs": trainer.images_seen / len(data.train),
        "train_minutes": trainer.elapsed_s / 60,
        "images_per_s": float(np.mean([r["images_per_s"] for r in timed])) if timed else None,
        "patches_per_s": float(np.mean([r["patches_per_s"] for r in timed])) if timed else None,
        "mfu": float(np.mean([r["mfu"] for r in timed])) if timed else None,
        "utilisation": float(np.mean([r["utilisation"] for r in steps])) if steps else None,
        "data_share": float(np.sum([r["data_s"] for r in timed]) / np.sum([r["step_s"] for r in timed]))
        if timed
        else None,
        "encoder": {
            "shape": describe(trainer.encoder.config),
            "parameters": sum(p.numel() for p in trainer.encoder.parameters()),
            "trained": sum(p.numel() for p in trainer.encoder.parameters() if p.requires_grad),
        },
        "sizes": {
            "train": len(data.train),
            "val": len(data.val),
            "test": None if data.test is None else len(data.test),
        },
        "files": files,
        "calibration": trainer.calibration or None,
        "data_warnings": [*data.warnings, *trainer.warnings],
        "skipped_images": [image.record() for image in data.skipped],
        "threads": torch.get_num_threads(),
        "world_size": ranks.world_size,
        "args": {k: str(v) for k, v in config.flat().items()},
        "command": " ".join(["python -m moonvit_train", *sys.argv[1:]]),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "moonvit": moonvit.__version__},
    }
    metric = next(iter(trainer.objective.metrics(val)), None)  # top1, cosine; MAE reports none
    plot_curves(out / "metrics.jsonl", out / "curves.png", f"{config.run.objective} on {data.name}", metric)
    write_text_atomic(out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
    label, shown = ("test", test) if test is not None else ("validation", {"loss": val["loss"]})
    print(f"{label}: " + _summary({k: v for k, v in shown.items() if isinstance(v, float)}))
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    config = parse_args(argv)
    apply_threads(config.runtime.threads)
    ranks, device = init_ranks(config.runtime.device)
    try:
        with one_line_warnings(), interruptible(config.run.out):
            results = run(config, ranks, device)
        # Every rank leaves the process group together: none tears down its connections while rank 0
        # still writes the results (only on success: after a failure the others may never arrive).
        ranks.barrier()
        return results
    except (DataError, RunMismatch, TrainError, UnreadableImageError) as error:
        raise SystemExit(f"error: {error}") from error
    except Interrupted as interrupted:
        if ranks.is_main:
            print(interrupted, file=sys.stderr, flush=True)
        raise SystemExit(130) from None  # the shell's code for a run ended by SIGINT
    finally:
        close_ranks()
