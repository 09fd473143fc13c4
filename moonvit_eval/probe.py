"""Linear probes on frozen features: standardisation, two solvers, and selection on a held-out share of train.

Solvers (both multinomial, weight (F, C) and bias (C,)):
    ``adamw``: many heads trained at once on the same shuffled mini-batches, one per
        (learning rate, weight decay) of a grid; the heads lie side by side along the output, so the
        logits of all heads are one matmul (B, F) x (F, H * C), and the update is AdamW with per-head
        learning rate and decoupled weight decay (none on the bias), cosine-decayed to 0, from zero weights.
    ``lbfgs``: classic L2-penalised logistic regression, full batch, ``torch.optim.LBFGS`` with a
        strong-Wolfe line search in float64, minimising ``mean CE + ||W||^2 / (2 C N)`` (the
        scikit-learn ``LogisticRegression(C=C)`` objective divided by N; the bias is not
        penalised), for each C of a grid, warm-started from the previous, smaller C.

:func:`run_probe` selects on a seeded stratified share of train (never on test), warns when the
choice sits at an edge of the grid (other than a 0 end), refits the choice on all of train and scores test once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .splits import stratified_split

__all__ = [
    "LinearHeads",
    "ProbeConfig",
    "ProbeDataWarning",
    "ProbeResult",
    "Standardizer",
    "check_probe_labels",
    "fit_logistic_lbfgs",
    "run_probe",
    "train_adamw_heads",
]

Solver = Literal["adamw", "lbfgs"]


@dataclass(frozen=True)
class ProbeConfig:
    """Probe settings (recorded in the results).

    Attributes:
        solver: ``adamw`` (many heads) or ``lbfgs`` (logistic regression).
        learning_rates, weight_decays: the AdamW grid (their product is the set of heads).
        epochs, min_steps, batch_size: AdamW schedule: ``epochs`` passes over the data, more when
            needed to make at least ``min_steps`` steps (small datasets).
        inverse_regularization: the L-BFGS grid of C (larger = weaker penalty).
        max_iter, tolerance_grad: L-BFGS stopping rule (iterations; max |gradient| of the objective).
        val_fraction: stratified share of train held out for selection.
        l2_normalize: scale each feature vector to unit L2 norm before standardising.
        seed: seed of the selection split and the AdamW shuffles.
    """

    solver: Solver = "adamw"
    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)
    weight_decays: tuple[float, ...] = (0.0, 1e-2, 1e-1)
    epochs: int = 10
    min_steps: int = 1000
    batch_size: int = 512
    inverse_regularization: tuple[float, ...] = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
    max_iter: int = 500
    tolerance_grad: float = 1e-5
    val_fraction: float = 0.1
    l2_normalize: bool = False
    seed: int = 0

    def grid(self) -> list[dict[str, float]]:
        """The hyper-parameter settings, in the order heads are laid out."""
        if self.solver == "adamw":
            return [{"lr": lr, "weight_decay": wd} for lr in self.learning_rates for wd in self.weight_decays]
        return [{"C": c} for c in sorted(self.inverse_regularization)]


@dataclass(frozen=True)
class Standardizer:
    """Per-dimension ``(x - mean) / std`` with training statistics (after optional L2 normalisation).

    Attributes:
        mean, std: (F,) statistics of the training features; zero-variance dimensions get std 1.
        l2_normalize: whether rows are scaled to unit norm first.
    """

    mean: torch.Tensor
    std: torch.Tensor
    l2_normalize: bool

    @classmethod
    def fit(cls, x: torch.Tensor, l2_normalize: bool = False) -> Standardizer:
        """Statistics of (N, F) training features."""
        x = F.normalize(x, dim=1) if l2_normalize else x
        std = x.std(dim=0, unbiased=False)
        return cls(x.mean(dim=0), torch.where(std > 1e-8, std, torch.ones_like(std)), l2_normalize)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(N, F) -> (N, F) float32."""
        x = F.normalize(x, dim=1) if self.l2_normalize else x
        return ((x - self.mean) / self.std).float()


@dataclass(frozen=True)
class LinearHeads:
    """H multinomial linear classifiers side by side: weight (F, H, C), bias (H, C).

    Laying the heads along the output dimension makes all heads' logits one (N, F) x (F, H * C) matmul.
    """

    weight: torch.Tensor
    bias: torch.Tensor

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, F) features -> (H, N, C) logits."""
        dim, heads, classes = self.weight.shape
        flat = x.to(self.weight.dtype) @ self.weight.reshape(dim, heads * classes)
        return (flat.view(len(x), heads, classes) + self.bias).transpose(0, 1)


def train_adamw_heads(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    learning_rates: torch.Tensor,
    weight_decays: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    seed: int,
    min_steps: int = 0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    progress: str | None = None,
) -> LinearHeads:
    """Train H heads, one per (learning_rates[h], weight_decays[h]), on the same mini-batches.

    The mean cross-entropy's gradient with respect to the logits is ``(softmax - onehot) / B``,
    so a step is two matmuls over all heads at once, (B, F) x (F, H * C) and (F, B) x (B, H * C),
    and no autograd.

    Args:
        x: (N, F) float32 standardised features; y: (N,) int64 labels.
        learning_rates, weight_decays: (H,) peak learning rate and decoupled weight decay per head.
        epochs, batch_size: the schedule; batches are drawn from one seeded permutation per epoch.
        min_steps: more epochs than ``epochs`` when needed to make at least this many steps.
        seed: seed of the shuffles.
        progress: the description of a tqdm bar over the steps (None: no bar).
    """
    heads, dim = len(learning_rates), x.shape[1]
    width = heads * num_classes
    params = x.new_zeros(dim + 1, heads, num_classes)  # rows: the weight (F, H, C), then the bias (H, C)
    grad = torch.zeros_like(params)
    m, v = torch.zeros_like(params), torch.zeros_like(params)
    lr = learning_rates.to(x).view(1, heads, 1)
    decay = torch.cat([x.new_ones(dim), x.new_zeros(1)]).view(dim + 1, 1, 1) * weight_decays.to(x).view(1, heads, 1)
    generator = torch.Generator().manual_seed(seed)
    per_epoch = math.ceil(len(x) / batch_size)
    epochs = max(epochs, math.ceil(min_steps / per_epoch))
    steps = epochs * per_epoch
    step = 0
    bar = tqdm(total=steps, desc=progress, unit="step", disable=progress is None)
    for _ in range(epochs):
        for index in torch.randperm(len(x), generator=generator).to(x.device).split(batch_size):
            xb, yb = x[index], y[index]
            logits = (xb @ params[:dim].view(dim, width)).view(len(xb), heads, num_classes) + params[dim]
            grad_logits = torch.softmax(logits, dim=-1)  # (B, H, C)
            grad_logits[torch.arange(len(yb), device=x.device), :, yb] -= 1
            grad_logits /= len(yb)
            grad[:dim] = (xb.T @ grad_logits.view(len(xb), width)).view(dim, heads, num_classes)
            grad[dim] = grad_logits.sum(dim=0)
            step += 1
            step_lr = lr * (0.5 * (1 + math.cos(math.pi * (step - 1) / steps)))  # cosine to 0
            params.mul_(1 - step_lr * decay)
            m.lerp_(grad, 1 - betas[0])
            v.mul_(betas[1]).addcmul_(grad, grad, value=1 - betas[1])
            denominator = (v / (1 - betas[1] ** step)).sqrt_().add_(eps)
            params.sub_(step_lr / (1 - betas[0] ** step) * m / denominator)
            bar.update()
    bar.close()
    return LinearHeads(params[:dim], params[dim])


def fit_logistic_lbfgs(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    inverse_regularization: float,
    *,
    max_iter: int = 500,
    tolerance_grad: float = 1e-5,
    init: LinearHeads | None = None,
) -> LinearHeads:
    """L2-penalised multinomial logistic regression by full-batch L-BFGS in float64.

    Minimises ``mean_i CE(x_i W + b, y_i) + ||W||^2 / (2 C N)``, scikit-learn's
    ``LogisticRegression(C=C)`` objective over N.

    Args:
        x: (N, F) features; y: (N,) int64 labels.
        inverse_regularization: C.
        init: a one-head starting point (warm start), else zeros.

    Returns:
        one head: weight (F, 1, C), bias (1, C), float64.
    """
    x = x.double()
    weight = x.new_zeros(x.shape[1], num_classes) if init is None else init.weight[:, 0].double().clone()
    bias = x.new_zeros(num_classes) if init is None else init.bias[0].double().clone()
    weight.requires_grad_(True)
    bias.requires_grad_(True)
    penalty = 1 / (2 * inverse_regularization * len(x))
    optimizer = torch.optim.LBFGS(
        [weight, bias],
        lr=1,
        max_iter=max_iter,
        tolerance_grad=tolerance_grad,
        tolerance_change=1e-12,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = F.cross_entropy(x @ weight + bias, y) + penalty * weight.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    return LinearHeads(weight.detach().unsqueeze(1), bias.detach().unsqueeze(0))


class ProbeDataWarning(UserWarning):
    """Labels a probe can run on, but whose figures say less than they seem (see :func:`check_probe_labels`)."""


def check_probe_labels(
    train_labels: np.ndarray,
    test_labels: np.ndarray | None,
    classes: Sequence[str],
    val_fraction: float,
    seed: int,
    held_out: str = "selection",
    user: str = "a linear probe",
) -> list[str]:
    """Refuse labels a probe (or a classifier's training) cannot be run on, and describe the ones
    it runs on poorly.

    Works on labels alone, so it can run before any feature is extracted.

    Args:
        train_labels, test_labels: (N,) and (M,) class indices into ``classes`` (test labels
            None: not checked).
        val_fraction, seed: the selection split :func:`run_probe` will make (or the trainer's
            validation split: the same seeded stratified rule).
        held_out: what the held-out share is called in the messages ("selection", "validation").
        user: who needs the classes, for the message ("a linear probe", "a classifier").

    Returns:
        warnings: classes with no training image (never predicted), with one (absent from the
        selection split) or with no test image (no recall).

    Raises:
        ValueError: fewer than 2 classes with training images (top-1 would be 1.0 by
            construction), no test images, or a selection split with no images (no class has 2
            training images, so every setting would score nan).
    """
    train_counts = np.bincount(train_labels, minlength=len(classes))
    test_counts = None if test_labels is None else np.bincount(test_labels, minlength=len(classes))
    trained = np.flatnonzero(train_counts)
    if len(trained) < 2:
        names = [classes[int(i)] for i in trained]
        raise ValueError(f"{user} needs at least 2 classes with training images; this data has {len(trained)} {names}")
    if test_labels is not None and len(test_labels) == 0:
        raise ValueError("the test split has no images")
    _, held = stratified_split(train_labels, val_fraction, seed)
    if len(held) == 0:
        raise ValueError(
            f"the {held_out} split ({val_fraction:g} of train) is empty: no class has 2 training images "
            f"(largest: {train_counts.max()})"
        )

    def named(indices: np.ndarray) -> str:
        shown = ", ".join(repr(classes[int(i)]) for i in indices[:8])
        return shown + (f" and {len(indices) - 8} more" if len(indices) > 8 else "")

    messages = []
    single = np.flatnonzero(train_counts == 1)
    if len(single):
        messages.append(
            f"classes with one training image have none in the {held_out} split, so {held_out} ignores them: "
            f"{named(single)}"
        )
    if test_counts is not None:
        untrained = np.flatnonzero((train_counts == 0) & (test_counts > 0))
        if len(untrained):
            messages.append(
                f"classes with test images but no training image can never be predicted: {named(untrained)}"
            )
        untested = np.flatnonzero((test_counts == 0) & (train_counts > 0))
        if len(untested):
            messages.append(f"classes with no test image have no recall and do not count in top-1: {named(untested)}")
    return messages


@dataclass
class ProbeResult:
    """A selected and refitted probe.

    Attributes:
        chosen: the selected hyper-parameters.
        grid: every setting with its validation top-1, in grid order.
        edge_warnings: a message per grid axis whose chosen value is at an end of it.
        test_logits: (N_test, C) logits of the refitted probe.
        sizes: numbers of train-for-selection, validation, train and test rows.
    """

    chosen: dict[str, float]
    grid: list[dict[str, float]]
    edge_warnings: list[str]
    test_logits: torch.Tensor
    sizes: dict[str, int]


def run_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    num_classes: int,
    config: ProbeConfig,
    progress: str | None = None,
) -> ProbeResult:
    """Select hyper-parameters on a stratified ``val_fraction`` of train, refit on all of train, score test.

    Standardisation statistics come from the rows each fit trains on. The training labels are
    checked first (:func:`check_probe_labels`): what cannot be probed is refused, and the other
    findings are :class:`ProbeDataWarning` warnings.

    Args:
        train_x: (N, F) features; train_y: (N,) int64 labels; test_x: (M, F) features.
        progress: what the tqdm bars of the search and the refit are headed with (None: no bars).

    Returns:
        the :class:`ProbeResult`, with (M, C) test logits.

    Raises:
        ValueError: the labels cannot be probed (see :func:`check_probe_labels`).
    """
    if len(test_x) == 0:
        raise ValueError("the test split has no images")
    classes = [str(c) for c in range(num_classes)]
    for message in check_probe_labels(train_y.cpu().numpy(), None, classes, config.val_fraction, config.seed):
        warnings.warn(message, ProbeDataWarning, stacklevel=2)
    fit_index, val_index = (
        torch.from_numpy(i) for i in stratified_split(train_y.cpu().numpy(), config.val_fraction, config.seed)
    )
    settings = config.grid()
    scaler = Standardizer.fit(train_x[fit_index], config.l2_normalize)
    val_top1 = _fit(
        scaler(train_x[fit_index]),
        train_y[fit_index],
        scaler(train_x[val_index]),
        train_y[val_index],
        num_classes,
        config,
        settings,
        None if progress is None else f"{progress}: search",
    )
    best = int(np.argmax(val_top1))  # ties go to the first setting in grid order
    grid = [{**setting, "val_top1": score} for setting, score in zip(settings, val_top1)]
    chosen = settings[best]
    edge_warnings = _edge_warnings(chosen, config)
    for message in edge_warnings:
        warnings.warn(message, stacklevel=2)
    scaler = Standardizer.fit(train_x, config.l2_normalize)
    heads = _refit(
        scaler(train_x), train_y, num_classes, config, chosen, None if progress is None else f"{progress}: refit"
    )
    sizes = {"select_train": len(fit_index), "select_val": len(val_index), "train": len(train_x), "test": len(test_x)}
    return ProbeResult(chosen, grid, edge_warnings, heads.logits(scaler(test_x))[0].float(), sizes)


def _fit(
    x: torch.Tensor,
    y: torch.Tensor,
    val_x: torch.Tensor,
    val_y: torch.Tensor,
    num_classes: int,
    config: ProbeConfig,
    settings: list[dict[str, float]],
    progress: str | None = None,
) -> list[float]:
    """Validation top-1 of every setting, trained on (x, y); ``progress`` heads a tqdm bar (None: none)."""
    if config.solver == "adamw":
        heads = train_adamw_heads(
            x,
            y,
            num_classes,
            torch.tensor([s["lr"] for s in settings]),
            torch.tensor([s["weight_decay"] for s in settings]),
            epochs=config.epochs,
            batch_size=config.batch_size,
            seed=config.seed,
            min_steps=config.min_steps,
            progress=None if progress is None else f"{progress} ({len(settings)} heads)",
        )
        return (heads.logits(val_x).argmax(-1) == val_y).double().mean(dim=1).tolist()
    scores, previous = [], None
    for setting in tqdm(settings, desc=progress, unit="C", disable=progress is None):
        previous = fit_logistic_lbfgs(
            x,
            y,
            num_classes,
            setting["C"],
            max_iter=config.max_iter,
            tolerance_grad=config.tolerance_grad,
            init=previous,
        )
        scores.append(float((previous.logits(val_x)[0].argmax(-1) == val_y).double().mean()))
    return scores


def _refit(
    x: torch.Tensor,
    y: torch.Tensor,
    num_classes: int,
    config: ProbeConfig,
    chosen: dict[str, float],
    progress: str | None = None,
) -> LinearHeads:
    """The chosen setting trained on (x, y); ``progress`` heads an AdamW tqdm bar (None: none; an
    L-BFGS fit has no steps to show)."""
    if config.solver == "adamw":
        return train_adamw_heads(
            x,
            y,
            num_classes,
            torch.tensor([chosen["lr"]]),
            torch.tensor([chosen["weight_decay"]]),
            epochs=config.epochs,
            batch_size=config.batch_size,
            seed=config.seed,
            min_steps=config.min_steps,
            progress=progress,
        )
    return fit_logistic_lbfgs(
        x, y, num_classes, chosen["C"], max_iter=config.max_iter, tolerance_grad=config.tolerance_grad
    )


def _edge_warnings(chosen: dict[str, float], config: ProbeConfig) -> list[str]:
    axes: dict[str, Any] = (
        {"lr": config.learning_rates, "weight_decay": config.weight_decays}
        if config.solver == "adamw"
        else {"C": config.inverse_regularization}
    )
    messages = []
    for name, values in axes.items():
        values = sorted(values)
        edges = [value for value in (values[0], values[-1]) if value != 0]  # 0 is no edge: nothing lies below
        if len(values) > 1 and chosen[name] in edges:
            side = "smallest" if chosen[name] == values[0] else "largest"
            messages.append(
                f"selected {name}={chosen[name]:g} is the {side} value of its grid {values}; "
                "the optimum may lie outside it"
            )
    return messages
