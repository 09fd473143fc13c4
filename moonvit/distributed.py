"""torchrun processes: this process's rank, joining the process group, and the few collectives the programs use.

Without torchrun's environment (``RANK``, ``WORLD_SIZE``) a program runs as one process and
every helper here is a no-op, so the same code serves both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Ranks", "close_ranks", "init_ranks", "process_group_backend"]


@dataclass(frozen=True)
class Ranks:
    """This process's place in the job: torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or one process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        if not self.distributed:
            return [value]
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values

    def from_main(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the ranks, in place (returned for chaining)."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise maximum of ``tensor`` over the ranks, in place."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def process_group_backend(device: torch.device) -> str:
    """The process group's backend for a job on ``device``: gloo on CPU; on CUDA, NCCL for CUDA
    tensors and gloo for CPU ones (``"cpu:gloo,cuda:nccl"``), so that small statistics reduced on
    the host (loss sums, timings, object gathers) and gradients on the GPU each take a backend
    that accepts them: NCCL alone refuses CPU tensors."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_ranks(device: str) -> tuple[Ranks, torch.device]:
    """Join torchrun's process group (:func:`process_group_backend`) and pick this rank's device."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Ranks(), torch.device(device)
    ranks = Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    target = torch.device(device)
    if target.type == "cuda":
        target = torch.device("cuda", ranks.local_rank)
        torch.cuda.set_device(target)
    dist.init_process_group(backend=process_group_backend(target))
    return ranks, target


def close_ranks() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_initialized():
        dist.destroy_process_group()
