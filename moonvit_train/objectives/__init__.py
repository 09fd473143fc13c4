"""Training objectives, by name: an objective is a module that turns a pack into a loss.

A new objective (MAE, say) is one subclass of :class:`Objective` in its own module here and one
entry in :data:`OBJECTIVES`; ``python -m moonvit_train --objective NAME`` then runs it on the shared engine.
"""

from __future__ import annotations

from .base import Objective, ObjectiveOutput
from .deit import DeiTObjective
from .distill import DistillObjective
from .mae import MAEObjective
from .supervised import SupervisedObjective

__all__ = [
    "OBJECTIVES",
    "DeiTObjective",
    "DistillObjective",
    "MAEObjective",
    "Objective",
    "ObjectiveOutput",
    "SupervisedObjective",
]

OBJECTIVES: dict[str, type[Objective]] = {
    cls.name: cls for cls in (SupervisedObjective, MAEObjective, DistillObjective, DeiTObjective)
}
