"""LoRA adapters on a tower's linears: ``y = W x + b + (alpha / r) * B A dropout(x)``.

LoRA (Hu et al., 2021) trains a low-rank update of chosen frozen linears: ``A`` (r, in) drawn
Kaiming-uniform, as ``nn.Linear`` draws its weight, and ``B`` (out, r) zeros, so a freshly wrapped
model computes exactly what the base model does. Training moves only ``A`` and ``B``;
:func:`merge_lora` folds ``(alpha / r) * B @ A`` into each ``W`` for export, which gives back a
plain model that saves and loads as any checkpoint.

:class:`LoRALinear` subclasses ``nn.Linear`` and keeps its ``weight`` and ``bias`` under their own
names, so a wrapped model's state dict is the base's plus ``<layer>.lora_a`` / ``<layer>.lora_b``,
and code that reads a linear's sizes (``in_features``, ``out_features``) still can. It is not
exactly an ``nn.Linear``, so :func:`moonvit.model.linear.linear` runs its own forward, never the
fused CPU path that would read ``weight`` alone.

Targets are names of the tower's linears (:mod:`moonvit.model.blocks`): ``wqkv`` (the fused q, k, v
projection), ``wo`` (attention output), ``fc0`` and ``fc1`` (the MLP's), matched against the last
part of each module's name, or a dotted tail of it (``mlp.fc0``).

    >>> from moonvit import MoonViT
    >>> from moonvit.model.lora import LoRAConfig, apply_lora, merge_lora
    >>> model = MoonViT.from_preset("tiny")
    >>> wrapped = apply_lora(model, LoRAConfig(rank=4, alpha=8))  # names of the wrapped linears
    >>> len(wrapped)  # 4 linears in each of the 2 blocks
    8
    >>> model = merge_lora(model)  # a plain MoonViT again, the updates folded in
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..files import save_safetensors_atomic, write_text_atomic

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "LORA_TARGETS",
    "LoRAConfig",
    "LoRALinear",
    "apply_lora",
    "load_adapter",
    "lora_config",
    "lora_state_dict",
    "merge_lora",
    "save_adapter",
]

LORA_TARGETS = ("wqkv", "wo", "fc0", "fc1")
"""Every linear of a block: attention's fused q/k/v and output projections, the MLP's two."""
ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FORMAT = "moonvit-lora"


@dataclass(frozen=True)
class LoRAConfig:
    """Rank ``rank``, scale ``alpha / rank`` (``alpha`` None: the rank, a scale of 1), dropout on the
    adapter's input, and the linears it wraps (:data:`LORA_TARGETS` by default)."""

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {self.rank}")
        if self.alpha is not None and not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be above 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target linear (e.g. wqkv, wo, fc0, fc1)")

    @property
    def scale(self) -> float:
        """``alpha / rank``: what the adapter's output is multiplied by."""
        return (self.rank if self.alpha is None else self.alpha) / self.rank

    def to_dict(self) -> dict[str, Any]:
        return {"format": ADAPTER_FORMAT, **dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> LoRAConfig:
        if values.get("format") != ADAPTER_FORMAT:
            raise ValueError(f"not a {ADAPTER_FORMAT} adapter config (format {values.get('format')!r})")
        return cls(
            rank=int(values["rank"]),
            alpha=None if values.get("alpha") is None else float(values["alpha"]),
            dropout=float(values.get("dropout", 0.0)),
            targets=tuple(values.get("targets", LORA_TARGETS)),
        )


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (see the module docstring).

    Args:
        base: the layer wrapped; its ``weight`` and ``bias`` are taken over (the same tensors, frozen).
        rank: r, the update's rank.
        alpha: the update is scaled by ``alpha / rank``.
        dropout: dropout on the update's input (the base path sees ``x`` as it is).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)  # not nn.Linear's: it would draw a weight of its own
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        device, dtype = base.weight.device, base.weight.dtype
        self.lora_a = nn.Parameter(torch.empty(rank, self.in_features, device=device, dtype=dtype))
        self.lora_b = nn.Parameter(torch.zeros(self.out_features, rank, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # nn.Linear's own draw for a (r, in) weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out); with ``B`` zero, exactly the base layer's output."""
        update = F.linear(F.linear(self.dropout(x), self.lora_a) * self.scale, self.lora_b)
        return super().forward(x) + update

    def delta(self) -> torch.Tensor:
        """(out, in) ``scale * B @ A``, in float32 at least, what :meth:`merged` adds to ``weight``."""
        compute = torch.promote_types(self.weight.dtype, torch.float32)
        return self.scale * (self.lora_b.detach().to(compute) @ self.lora_a.detach().to(compute))

    def merged(self) -> nn.Linear:
        """A plain ``nn.Linear`` computing what this layer computes (without dropout), the update
        folded into its weight (added in float32 or wider, rounded once to the weight's dtype)."""
        weight, delta = self.weight.detach(), self.delta()
        layer = nn.Linear(
            self.in_features, self.out_features, bias=self.bias is not None, device=weight.device, dtype=weight.dtype
        )
        with torch.no_grad():
            layer.weight.copy_((weight.to(delta.dtype) + delta).to(weight.dtype))
            if self.bias is not None:
                layer.bias.copy_(self.bias)
        return layer.train(self.training)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha:g}"


def _matches(name: str, targets: Sequence[str]) -> bool:
    return any(name == target or name.endswith("." + target) for target in targets)


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def apply_lora(model: nn.Module, config: LoRAConfig) -> list[str]:
    """Wrap ``model``'s linears named by ``config.targets`` in :class:`LoRALinear`, in place, and freeze
    every parameter of ``model`` but the adapters' (``requires_grad`` False).

    Returns:
        The names of the wrapped linears, in module order.

    Raises:
        ValueError: a target names no linear of ``model`` (the linears' names are listed), or
            ``model`` already holds adapters.
    """
    if any(isinstance(module, LoRALinear) for module in model.modules()):
        raise ValueError("this model already holds LoRA adapters; merge_lora it first to add others")
    linears = [name for name, module in model.named_modules() if type(module) is nn.Linear]
    missing = [target for target in config.targets if not any(_matches(name, [target]) for name in linears)]
    if missing:
        known = sorted({name.rpartition(".")[2] for name in linears})
        raise ValueError(f"LoRA targets {', '.join(missing)} name no linear of the model (its linears: {known})")
    for param in model.parameters():
        param.requires_grad_(False)
    alpha = config.rank * config.scale
    wrapped = [name for name in linears if _matches(name, config.targets)]
    for name in wrapped:
        base = model.get_submodule(name)
        assert isinstance(base, nn.Linear)
        # In the mode of the layer it replaces (a new module starts in train mode: its dropout on)
        _set_module(model, name, LoRALinear(base, config.rank, alpha, config.dropout).train(base.training))
    return wrapped


def lora_config(model: nn.Module) -> LoRAConfig | None:
    """The :class:`LoRAConfig` of the adapters ``model`` holds (targets: the wrapped linears' last
    names), or None without any."""
    layers = [(name, module) for name, module in model.named_modules() if isinstance(module, LoRALinear)]
    if not layers:
        return None
    settings = {(m.rank, m.alpha, m.dropout.p if isinstance(m.dropout, nn.Dropout) else 0.0) for _, m in layers}
    if len(settings) > 1:
        raise ValueError(f"the model's adapters differ in (rank, alpha, dropout): {sorted(settings)}")
    rank, alpha, dropout = settings.pop()
    targets = tuple(dict.fromkeys(name.rpartition(".")[2] for name, _ in layers))
    return LoRAConfig(rank, alpha, dropout, targets)


def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every :class:`LoRALinear` of ``model`` by its :meth:`~LoRALinear.merged` plain linear, in
    place; returns ``model`` (a plain model again: its state dict has the base's names only)."""
    if isinstance(model, LoRALinear):
        return model.merged()
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            _set_module(model, name, module.merged())
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors alone, by their names in ``model.state_dict()`` (``...wqkv.lora_a``)."""
    return {name: t for name, t in model.state_dict().items() if name.endswith((".lora_a", ".lora_b"))}


def save_adapter(model: nn.Module, folder: str | Path, base: str | None = None) -> list[str]:
    """Write ``model``'s adapters to ``folder``: :data:`ADAPTER_WEIGHTS` (the tensors) and
    :data:`ADAPTER_CONFIG` (rank, alpha, dropout, targets, and ``base``: the tower they were trained on,
    when given). Returns the file names."""
    config = lora_config(model)
    if config is None:
        raise ValueError("the model holds no LoRA adapters")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(lora_state_dict(model), folder / ADAPTER_WEIGHTS, {"format": ADAPTER_FORMAT})
    about = {**config.to_dict(), **({"base": base} if base is not None else {})}
    write_text_atomic(folder / ADAPTER_CONFIG, json.dumps(about, indent=2) + "\n")
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def load_adapter(model: nn.Module, folder: str | Path) -> list[str]:
    """Wrap ``model`` as the adapter in ``folder`` says (:func:`apply_lora`) and load its tensors; every
    adapter tensor must fit the model. Returns the names of the wrapped linears."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = LoRAConfig.from_dict(json.loads((folder / ADAPTER_CONFIG).read_text()))
    wrapped = apply_lora(model, config)
    tensors = load_file(folder / ADAPTER_WEIGHTS)
    expected = lora_state_dict(model)
    if set(tensors) != set(expected):
        extra, absent = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
        raise ValueError(
            f"{folder / ADAPTER_WEIGHTS} does not fit the model: unexpected {extra[:3]}, missing {absent[:3]}"
        )
    model.load_state_dict(tensors, strict=False)
    return wrapped
