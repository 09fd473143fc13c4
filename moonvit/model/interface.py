"""What the rest of the package needs from an encoder, as a structural type.

``moonvit_eval/`` and ``moonvit_projector/export/`` are typed against :class:`VisionEncoder`,
not the concrete :class:`~moonvit.model.encoder.MoonViT`, so a wrapped,
compiled or future encoder (another checkpoint family) serves them as long as it
has these members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from .config import MoonViTConfig
from .grid import GridInput, PackedGrid

if TYPE_CHECKING:
    from .encoder import MoonViTOutput


@runtime_checkable
class VisionEncoder(Protocol):
    """A packed native-resolution encoder.

    Members:
        config: patch size, merge kernel, width and depth (a :class:`MoonViTConfig`).
        dtype, device: where its weights live.
        prepare_grid(grid_thws): the pack's metadata (see :class:`PackedGrid`).
        __call__(pixel_values, grid_thws=None, *, grid=None, output_hidden_states=False,
            hidden_state_indices=None): a :class:`MoonViTOutput` with ``last_hidden_state``
            (L, D) and ``merged`` (L / 4, 4, D).
    """

    config: MoonViTConfig

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def prepare_grid(self, grid_thws: GridInput, keep: Sequence[torch.Tensor] | None = None) -> PackedGrid: ...

    def __call__(
        self,
        pixel_values: torch.Tensor,
        grid_thws: GridInput | None = None,
        *,
        grid: PackedGrid | None = None,
        output_hidden_states: bool = False,
        hidden_state_indices: Sequence[int] | None = None,
    ) -> MoonViTOutput: ...
