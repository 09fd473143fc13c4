"""Data parallelism for the trainer: DDP (the default under torchrun) or FSDP2 (``fully_shard``),
and full state dicts in and out of either, so checkpoints do not depend on the world size.

Both average gradients over ranks; the engine scales each rank's loss by the world size and
divides by the step's global count of units, so the average is the exact global mean.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from moonvit.distributed import Ranks

from .classic import tower_blocks
from .objectives import Objective, ObjectiveOutput

__all__ = ["Parallel", "TrainModule"]


class TrainModule(nn.Module):
    """The encoder and the objective as one module, the unit that DDP / FSDP wraps."""

    def __init__(self, encoder: nn.Module, objective: Objective) -> None:
        super().__init__()
        self.encoder = encoder
        self.objective = objective

    def forward(self, batch: Any, evaluate: bool = False) -> ObjectiveOutput:
        if evaluate:
            return self.objective.evaluate(self.encoder, batch)
        return self.objective(self.encoder, batch)


class Parallel:
    """A :class:`TrainModule` as the ranks run it: itself (one process), under DDP, or sharded by FSDP2."""

    def __init__(self, module: TrainModule, ranks: Ranks, device: torch.device, fsdp: bool) -> None:
        self.module = module
        self.ranks = ranks
        self.fsdp = fsdp and ranks.distributed
        self.runner: nn.Module = module
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (ranks.world_size,))
            for block in tower_blocks(module.encoder):
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
        elif ranks.distributed:
            # Buffers (a distillation teacher's statistics) are the same on every rank, so DDP's
            # default buffer sync changes nothing (and passing broadcast_buffers, deprecated in newer
            # torch, prints a warning on every rank).
            self.runner = DistributedDataParallel(module)

    def __call__(self, batch: Any, evaluate: bool = False) -> ObjectiveOutput:
        """The pack's output: through DDP / FSDP in training, through the module itself in evaluation.

        Why evaluation bypasses DDP: DDP's forward broadcasts the buffers (a collective) at a rank's
        first forward after a training step, and a rank with no evaluation pack (a split of fewer packs
        than ranks) never makes that forward; it waits in the evaluation's all-reduce instead, and the
        ranks hang. Evaluation needs no gradient hooks, and the buffers (a distillation teacher's
        statistics) are already equal on every rank. FSDP2 shards the module itself, so there the
        module is the runner, and every rank runs every evaluation forward.
        """
        runner = self.module if evaluate else self.runner
        return runner(batch, evaluate=evaluate)

    def gradient_sync(self, enabled: bool) -> AbstractContextManager:
        """Within it, backward accumulates gradients locally (all but a rank's last pack of a step)."""
        if enabled:
            return nullcontext()
        if isinstance(self.runner, DistributedDataParallel):
            return self.runner.no_sync()
        if self.fsdp:
            return _FsdpNoSync(self.module)
        return nullcontext()

    # ---- full state dicts (identical on every rank, independent of the world size) ----------------

    _OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def model_state(self) -> dict[str, torch.Tensor]:
        if self.fsdp:
            return get_model_state_dict(self.module, options=self._OPTIONS)  # type: ignore[return-value]
        return {name: tensor.detach().cpu() for name, tensor in self.module.state_dict().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.fsdp:
            set_model_state_dict(self.module, dict(state), options=StateDictOptions(full_state_dict=True))
        else:
            self.module.load_state_dict(state)

    # The optimizer's state goes through the distributed state-dict API in every case, keyed by
    # parameter name (not by index, as optimizer.state_dict() keys it): a run saved by one process
    # resumes under FSDP2 on several ranks, and the reverse.
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return get_optimizer_state_dict(self.module, optimizer, options=self._OPTIONS)

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        # Unsharded, the full state is this process's own (the full-state path needs existing
        # optimizer state to find its device, which a fresh optimizer lacks).
        options = StateDictOptions(full_state_dict=self.fsdp)
        set_optimizer_state_dict(self.module, optimizer, state, options=options)


class _FsdpNoSync(AbstractContextManager):
    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __enter__(self) -> None:
        self.module.set_requires_gradient_sync(False)  # type: ignore[operator]

    def __exit__(self, *exc: object) -> None:
        self.module.set_requires_gradient_sync(True)  # type: ignore[operator]
