"""The training state of one process and one optimizer step on it.

One step: the plan gives the step's packs (every rank computes all of them, each takes its
share), each pack is rendered (decode, resize, augment, mix, patchify, drop), run through the
encoder and the objective, and its loss sum, scaled by the world size over the step's units,
is backpropagated; gradients are clipped, AdamW steps, the schedule moves on and the objective's
``after_step`` hook runs. The :class:`Trainer` saves and restores its own state
(:meth:`Trainer.state_dict`), so that a run killed at any step resumes bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from moonvit import CheckpointError, MoonViT, MoonViTImageProcessor
from moonvit.cli import torch_dtype
from moonvit.distributed import Ranks
from moonvit.media.presets import video_processor_of
from moonvit.model.lora import apply_lora, lora_config, merge_lora, save_adapter
from moonvit.model.projector import MoonViTProjector

from .batch import Batch, render_pack
from .build import RunPlan, TrainError
from .checkpoint import rng_states, set_rng_states
from .classic import ClassicViT, Encoder
from .config import TrainConfig
from .data import TrainingData
from .ema import WeightEMA
from .objectives import Objective
from .optim import build_optimizer, build_schedule, param_groups
from .parallel import Parallel, TrainModule
from .plan import PlannedPack, derive_seed

__all__ = ["MIX_SEED", "TORCH_SEED", "StepFeed", "Trainer"]

MIX_SEED, TORCH_SEED = 1, 2
"""Purposes in :func:`derive_seed`: a pack's mixing draws, and torch's generator for its forward (stochastic depth)."""


class Trainer:
    """The training state of one process (see the module docstring)."""

    def __init__(
        self,
        config: TrainConfig,
        ranks: Ranks,
        device: torch.device,
        encoder: Encoder,
        processor: MoonViTImageProcessor,
        objective: Objective,
        data: TrainingData,
        plan: RunPlan,
    ) -> None:
        self.config, self.ranks, self.device = config, ranks, device
        self.encoder, self.processor, self.objective = encoder, processor, objective
        self.data, self.plan = data, plan
        encoder.set_attn_implementation(config.runtime.attn)  # --attn: checked for this device when parsed
        self.parallel = Parallel(TrainModule(encoder, objective).to(device), ranks, device, config.runtime.fsdp)
        self.autocast_dtype = torch_dtype(config.runtime.dtype)
        self.step = 0
        self.total = 0
        self.images_seen = 0
        self.elapsed_s = 0.0
        self.calibration: dict[str, float] = {}
        self.warnings: list[str] = []  # what the run warned of that results.json records (kept with the state)
        self.saved_step: int | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.schedule: torch.optim.lr_scheduler.LambdaLR | None = None
        self.ema: WeightEMA | None = None
        self.plan_state: Any = None  # the plan's position after the last step's packs, when drawn ahead

    # ---- set-up -------------------------------------------------------------------------------

    def start(self, total: int) -> None:
        """Optimizer and schedule for ``total`` steps, and the moving average of the weights (``--ema``)."""
        self.total = total
        optim = self.config.optim
        self.optimizer = build_optimizer(param_groups(self.encoder, self.objective, optim), optim, self.device)
        warmup = max(1, round(optim.warmup * total))
        self.schedule = build_schedule(self.optimizer, total, warmup, optim.min_lr_ratio)
        if optim.ema is not None:
            self.ema = WeightEMA(self.parallel.module, optim.ema)

    def averaged(self) -> contextlib.AbstractContextManager:
        """Within it the model holds the moving average of its weights (with ``--ema``; else as it is)."""
        return contextlib.nullcontext() if self.ema is None else self.ema.swapped()

    def my_share(self, packs: Sequence[PlannedPack]) -> list[tuple[int, PlannedPack]]:
        """(index in the step, pack) of the packs this rank runs."""
        return [(j, packs[j]) for j in range(self.ranks.rank, len(packs), self.ranks.world_size)]

    def autocast(self) -> contextlib.AbstractContextManager:
        enabled = self.autocast_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=enabled)

    # ---- its own state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything a step depends on, gathered (every rank takes part; the result is the same
        on each): model and optimizer (full, by parameter name), schedule, plan position, RNG states,
        counters, the ``--minutes`` calibration, the run's warnings and the thread count."""
        assert self.optimizer is not None and self.schedule is not None
        return {
            "step": self.step,
            "total_steps": self.total,
            "images_seen": self.images_seen,
            "elapsed_s": self.elapsed_s,
            "calibration": dict(self.calibration),
            "model": self.parallel.model_state(),
            "optimizer": self.parallel.optimizer_state(self.optimizer),
            "ema": self._ema_state(),
            "schedule": self.schedule.state_dict(),
            "plan": self.plan.packer.state_dict() if self.plan_state is None else self.plan_state,
            "rng": rng_states(),
            "warnings": list(self.warnings),
            "threads": torch.get_num_threads(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (after :meth:`start` with the saved total)."""
        assert self.optimizer is not None and self.schedule is not None
        self.parallel.load_model_state(state["model"])
        self.parallel.load_optimizer_state(self.optimizer, state["optimizer"])
        if self.ema is not None:
            # Loaded into the parameters while they are swapped with the averages: swapped back, the
            # saved averages are the averages (sharded as the parameters are, for any world size).
            with self.ema.swapped():
                self.parallel.load_model_state({**state["model"], **state["ema"]["weights"]})
            self.ema.updates = state["ema"]["updates"]
        self.schedule.load_state_dict(state["schedule"])
        self.plan.packer.load_state_dict(state["plan"])
        set_rng_states(state["rng"])
        self.step, self.images_seen, self.elapsed_s = state["step"], state["images_seen"], state["elapsed_s"]
        self.calibration = dict(state.get("calibration") or {})
        self.warnings = list(state.get("warnings") or [])
        self.saved_step = self.step

    def _ema_state(self) -> dict[str, Any] | None:
        """The moving averages by parameter name, gathered (every rank takes part), and their update count."""
        if self.ema is None:
            return None
        with self.ema.swapped():
            state = self.parallel.model_state()  # unsharded, the parameters themselves: copied before the swap back
            # (gathered from FSDP2's shards, the full state is the main rank's only)
            weights = {name: state[name].clone() for name in self.ema.names if name in state}
        return {"updates": self.ema.updates, "weights": weights}

    # ---- one step -----------------------------------------------------------------------------

    def render(self, step: int, packs: Sequence[PlannedPack]) -> list[Batch]:
        """This rank's packs of step ``step`` rendered on the CPU (decode, resize, augment, mix,
        patchify, drop): a function of the step and the packs alone, so a :class:`StepFeed` worker
        may call it ahead of the step."""
        batches = []
        for j, pack in self.my_share(packs):
            mix_rng = np.random.default_rng(derive_seed(self.config.run.seed, MIX_SEED, step, j))
            needs_full = self.objective.needs_full_pixels
            batches.append(
                render_pack(pack, self.data.train, self.encoder.config, self.config.augment, mix_rng, needs_full)
            )
        return batches

    def forward_backward(
        self, step: int, packs: Sequence[PlannedPack], rendered: Future[list[Batch]] | None = None
    ) -> tuple[dict[str, float], float]:
        """Run and backpropagate this rank's packs of a step, rendered now or by ``rendered`` (ahead,
        in a :class:`StepFeed` worker); returns the step's summed statistics over every rank (loss,
        objective sums, per unit) and the seconds this rank spent rendering or waiting for it."""
        units = sum(self.objective.weight(pack) for pack in packs)
        scale = self.ranks.world_size / units
        start = time.perf_counter()
        batches = self.render(step, packs) if rendered is None else rendered.result()
        render_s = time.perf_counter() - start
        sums: dict[str, torch.Tensor] = {}
        for position, ((j, _), cpu_batch) in enumerate(zip(self.my_share(packs), batches)):
            batch = cpu_batch.to(self.device)
            torch.manual_seed(derive_seed(self.config.run.seed, TORCH_SEED, step, j))
            with self.parallel.gradient_sync(position == len(batches) - 1):
                with self.autocast():
                    output = self.parallel(batch)
                (output.loss_sum * scale).backward()
            for name, value in {"loss": output.loss_sum.detach(), **output.sums}.items():
                sums[name] = sums.get(name, 0) + value.detach().float()
        names = ["loss", *self.objective.sum_names]
        # Reduced on the host: gloo takes CPU tensors (under NCCL too, through the mixed
        # "cpu:gloo,cuda:nccl" group moonvit.distributed joins on GPUs).
        totals = self.ranks.sum(torch.stack([sums[name] for name in names]).cpu())
        return {name: float(total) / units for name, total in zip(names, totals)}, render_s

    def train_step(
        self, packs: Sequence[PlannedPack], rendered: Future[list[Batch]] | None = None, plan_state: Any = None
    ) -> dict[str, Any]:
        """One optimizer step on a step's packs; returns its log record. ``rendered`` and
        ``plan_state`` come from a :class:`StepFeed` that draws and renders ahead: the batches, and
        the plan's position right after this step's packs (what a checkpoint after it saves)."""
        assert self.optimizer is not None and self.schedule is not None
        self.plan_state = plan_state
        start = time.perf_counter()
        lr = max(group["lr"] for group in self.optimizer.param_groups)
        stats, render_s = self.forward_backward(self.step, packs, rendered)
        params = [p for p in self.parallel.module.parameters() if p.grad is not None]
        clip = self.config.optim.clip_grad if self.config.optim.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not (math.isfinite(stats["loss"]) and math.isfinite(grad_norm)):
            raise TrainError(self._non_finite_message(stats["loss"], grad_norm))
        self.optimizer.step()
        if self.ema is not None:
            self.ema.update()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.objective.after_step()
        step_s = time.perf_counter() - start
        self.step += 1
        self.elapsed_s += step_s
        images = sum(len(pack) for pack in packs)
        patches = sum(item.kept for pack in packs for item in pack)
        self.images_seen += images
        flops = 3 * sum(self.encoder.config.flops([item.kept for item in pack]) for pack in packs)
        return {
            "kind": "train",
            "step": self.step,
            "epoch": self.images_seen / len(self.data.train),
            "loss": stats["loss"],
            **self.objective.metrics(stats),
            "lr": lr,
            "grad_norm": grad_norm,
            "images": images,
            "patches": patches,
            "utilisation": patches / (len(packs) * self.config.data.batch_patches),
            "token_drop": self.config.data.token_drop.rate(max(self.step - 1, 0) / self.total),
            "step_s": step_s,
            "data_s": render_s,
            "images_per_s": images / step_s,
            "patches_per_s": patches / step_s,
            "tflops": flops / step_s / 1e12,
        }

    def _non_finite_message(self, loss: float, grad_norm: float) -> str:
        from .checkpoint import state_path

        kept = (
            f"the last good checkpoint, from step {self.saved_step}, is kept in {state_path(self.config.run.out)}"
            if self.saved_step is not None
            else "no checkpoint had been written yet"
        )
        return (
            f"the loss is {loss} (gradient norm {grad_norm}) at step {self.step + 1}: training stopped and this "
            f"step was not applied; {kept}. Lower --lr, keep --clip-grad on, or try --dtype fp32"
        )

    # ---- the result ---------------------------------------------------------------------------

    def export(self) -> list[str]:
        """The encoder in the package's format at ``<out>/checkpoint`` (with the processor's settings), and
        the objective's files beside it. Every rank gathers; the main rank writes. A LoRA run's checkpoint
        is the tower with its adapters merged in (a plain tower), the adapters alone in ``<out>/adapter``.
        A classic ViT's is its own folder (:meth:`ClassicViT.save_pretrained`: its table at the native size it
        trained at, its head(s)), which ``MoonViT.from_pretrained`` loads as a classic ViT."""
        out = self.config.run.out
        state = self.parallel.model_state()
        if not self.ranks.is_main:
            return []
        parts: dict[str, dict[str, torch.Tensor]] = {"encoder": {}, "objective": {}}
        for name, tensor in state.items():
            part, _, rest = name.partition(".")
            parts[part][rest] = tensor
        if isinstance(self.encoder, ClassicViT):
            classic = ClassicViT(dataclasses.replace(self.encoder.config, drop_path_rate=0.0))
            classic.load_state_dict(parts["encoder"])
            classic.save_pretrained(out / "checkpoint")
            self.processor.save_pretrained(out / "checkpoint")
            return ["checkpoint", *self.objective.save(out, parts["objective"])]
        encoder = MoonViT(dataclasses.replace(self.encoder.config, drop_path_rate=0.0))
        lora = lora_config(self.encoder)
        if lora is not None:
            with torch.random.fork_rng(devices=[]):  # its A draws are overwritten next: leave the run's RNG as it is
                apply_lora(encoder, lora)
        encoder.load_state_dict(parts["encoder"])
        if lora is not None:
            model = self.config.model
            base = model.checkpoint or f"--preset {model.preset} --seed {self.config.run.seed}"  # the tower adapted
            save_adapter(encoder, out / "adapter", base=base)
            merge_lora(encoder)
        self.save_checkpoint(encoder, out / "checkpoint")
        adapter = [] if lora is None else ["adapter"]
        return ["checkpoint", *adapter, *self.objective.save(out, parts["objective"])]

    def save_checkpoint(self, encoder: MoonViT, folder: Path) -> None:
        """Write the trained ``encoder`` to ``folder`` in ``--save-layout``'s layout, with the processor's
        settings, a video tower's video rule (its source's: K3's 8 fps), and the projector of a
        ``--checkpoint`` that has one, unchanged: the tower's tokens still reach its language model through
        it (this package's projector files beside the tower, or the release's tensors)."""
        projector, layout = source_projector(self.config.model.checkpoint), self.config.runtime.save_layout
        try:
            encoder.save_pretrained(folder, layout=layout, projector=projector)
        except ValueError as error:  # a tower its release cannot hold as it is; the final state is saved
            raise TrainError(
                f"--save-layout {layout}: {error}; the same command with --save-layout own writes the trained tower"
            ) from error
        self.processor.save_pretrained(folder)
        if encoder.config.max_frames > 1:
            video = video_processor_of(checkpoint=self.config.model.checkpoint, preset=self.config.model.preset)
            video.save_pretrained(folder)


def source_projector(checkpoint: str | None) -> MoonViTProjector | None:
    """The projector of the ``--checkpoint`` a run started from, as it is stored (its dtype kept), or None:
    a preset's run, or a tower saved without one (this package's folders may hold none)."""
    if checkpoint is None:
        return None
    try:
        return MoonViTProjector.from_pretrained(checkpoint)
    except CheckpointError:
        return None


class StepFeed:
    """The packs of each step, drawn from the plan in step order, with this rank's batches rendered
    up to ``workers`` steps ahead in background threads (none: each step renders its own).

    The draws are those of the serial loop, in the same order, and rendering is a function of the
    step and its packs (:meth:`Trainer.render`), so the run is bit for bit the same with any
    ``workers``. Each step carries the plan's position right after its own packs, which is what a
    checkpoint after that step saves, so a resumed run draws the same packs as well.
    """

    def __init__(self, trainer: Trainer, total: int, workers: int) -> None:
        self.trainer, self.total, self.workers = trainer, total, workers
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="moonvit-render") if workers else None
        self.ahead: deque[tuple[list[PlannedPack], Any, Future[list[Batch]] | None]] = deque()

    def _draw(self, step: int) -> tuple[list[PlannedPack], Any]:
        plan = self.trainer.plan
        packs = [plan.packer.next_pack(step / self.total) for _ in range(plan.packs_per_step)]
        return packs, plan.packer.state_dict()

    def next(self, step: int) -> tuple[list[PlannedPack], Any, Future[list[Batch]] | None]:
        """Step ``step``'s (packs, plan position after them, rendering or None), topping up the
        steps drawn ahead."""
        if self.pool is None:
            return (*self._draw(step), None)
        while len(self.ahead) <= self.workers and step + len(self.ahead) < self.total:
            ahead = step + len(self.ahead)
            packs, state = self._draw(ahead)
            self.ahead.append((packs, state, self.pool.submit(self.trainer.render, ahead, packs)))
        return self.ahead.popleft()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
