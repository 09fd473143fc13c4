"""scikit-learn's multinomial logistic regression on frozen features: the other linear figure papers report.

Beside :mod:`moonvit_eval.probe`'s own solvers, a reference anyone can rerun: ``LogisticRegression``
(lbfgs, multinomial: scikit-learn's only mode for lbfgs, default tolerance) on the features
standardised as the probe standardises them (:class:`moonvit_eval.probe.Standardizer`: statistics of the
rows a fit trains on, optional L2 normalisation first). The inverse regularisation C is chosen on
the probe's validation cut; the choice is refitted on all of train and test is scored once.

The refit keeps the chosen C, on more rows than the search's. scikit-learn's lbfgs minimises
``C * sum_i loss_i + ||W||^2 / 2``, that is ``mean_i loss_i + ||W||^2 / (2 C N)`` over N rows, so
the same C is a weaker penalty per row on more rows (6 times weaker for a 10,000-row search and a
60,000-row refit). That is kept on purpose: C is the strength of a fixed prior on W, which more
rows should outweigh. Keeping the penalty per row instead (C * N_search / N_train) did worse on
Fashion-MNIST's fm-mae-ft features: C = 0.1 chosen on 10,000 rows, refitted on the 54,000-row
search part, scored 0.8972 on the validation cut as it is and 0.8952 scaled, and the search on all
54,000 rows itself chose a larger C (10), not a smaller one. ``refit`` records the C and rows.

Every fit starts from zero: scikit-learn's stopping rule is on the gradient of the *mean* loss,
which a change of C moves by only O(|W| / (C N)), so a fit warm-started from the previous C's
solution stops at once, where it started.

Speed: the rows go to scikit-learn in float32 (its lbfgs keeps them so; float64 takes about twice
as long for the same choice). ``max_iter`` caps each fit (1000, as DINOv2's logistic-regression
evaluation), and a fit that stops there is recorded as not converged. The search's training rows
are a stratified, seeded sample of at most ``max_search_rows`` (:data:`DEFAULT_SEARCH_ROWS`;
None: all): on Fashion-MNIST's 54,000-row search part the three fits of the grid cost about twice
the refit, and every C scored within 0.1% of the others; the refit always uses all of train.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .probe import Standardizer
from .splits import stratified_split

__all__ = [
    "DEFAULT_CS",
    "DEFAULT_SEARCH_ROWS",
    "LogRegConfig",
    "LogRegResult",
    "run_logreg",
    "sklearn_version",
]

DEFAULT_CS = (0.1, 1.0, 10.0)
DEFAULT_SEARCH_ROWS = 10_000
"""Training rows of the C search by default (a stratified sample when the search part has more)."""


def sklearn_version() -> str | None:
    """scikit-learn's version, None where it is not installed (it is an optional dependency)."""
    try:
        import sklearn
    except ImportError:
        return None
    return str(sklearn.__version__)


@dataclass(frozen=True)
class LogRegConfig:
    """Logistic-regression settings (recorded in the results).

    Attributes:
        inverse_regularization: the grid of C (scikit-learn's; larger = weaker L2 penalty).
        max_iter: lbfgs iterations per fit.
        max_search_rows: at most this many training rows in the C search (None: all).
        val_fraction, seed, l2_normalize: the probe's validation cut and standardisation.
    """

    inverse_regularization: tuple[float, ...] = DEFAULT_CS
    max_iter: int = 1000
    max_search_rows: int | None = DEFAULT_SEARCH_ROWS
    val_fraction: float = 0.1
    seed: int = 0
    l2_normalize: bool = False


@dataclass
class LogRegResult:
    """A C chosen on the validation cut, refitted on all of train.

    Attributes:
        chosen_C: the selected C (ties go to the smallest).
        grid: per C, its validation top-1, lbfgs iterations and whether lbfgs converged.
        test_top1: top-1 of the refit on test; test_predictions: (M,) its classes.
        refit: the refit's C (``chosen_C``, see the module's note on rows), rows, iterations and
            convergence.
        sizes: rows of the search's training part, the validation cut, train and test.
    """

    chosen_C: float
    grid: list[dict[str, Any]]
    test_top1: float
    test_predictions: np.ndarray
    refit: dict[str, Any]
    sizes: dict[str, int]


def run_logreg(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    config: LogRegConfig,
    threads: int | None = None,
    progress: str | None = None,
) -> LogRegResult:
    """Choose C on the validation cut, refit on all of train, score test once.

    Args:
        train_x: (N, F) features; train_y: (N,) int64 labels; test_x: (M, F); test_y: (M,).
        threads: BLAS threads of the fits (default: the library's own choice); the CLI passes
            torch's count, so ``--threads`` holds for scikit-learn too.
        progress: the description of a tqdm bar over the fits, the grid's then the refit (None: no bar).
    """
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from threadpoolctl import threadpool_limits

    labels = train_y.cpu().numpy()
    fit_index, val_index = stratified_split(labels, config.val_fraction, config.seed)
    if config.max_search_rows is not None and len(fit_index) > config.max_search_rows:
        # a stratified, seeded share of the search's rows; the validation cut stays whole
        share = config.max_search_rows / len(fit_index)
        _, sample = stratified_split(labels[fit_index], share, config.seed)
        fit_index = fit_index[sample]
    grid: list[dict[str, Any]] = []
    cs = sorted(config.inverse_regularization)
    bar = tqdm(total=len(cs) + 1, desc=progress, unit="fit", disable=progress is None)
    with bar, threadpool_limits(limits=threads), warnings.catch_warnings():
        # a fit that stops at max_iter is recorded (converged: false), not printed as a warning
        warnings.simplefilter("ignore", ConvergenceWarning)
        scaler = Standardizer.fit(train_x[fit_index], config.l2_normalize)
        x, y = _array(scaler(train_x[fit_index])), labels[fit_index]
        val_x, val_y = _array(scaler(train_x[val_index])), labels[val_index]
        for c in cs:
            bar.set_postfix_str(f"C={c:g} on {len(y)} rows")
            model = LogisticRegression(C=c, max_iter=config.max_iter).fit(x, y)
            top1 = float((model.predict(val_x) == val_y).mean()) if len(val_y) else float("nan")
            grid.append({"C": c, "val_top1": top1, **_convergence(model, config.max_iter)})
            bar.update()
        best = int(np.nanargmax([s["val_top1"] for s in grid])) if len(val_y) else 0
        chosen = grid[best]["C"]
        bar.set_postfix_str(f"refit C={chosen:g} on {len(train_x)} rows")
        scaler = Standardizer.fit(train_x, config.l2_normalize)
        final = LogisticRegression(C=chosen, max_iter=config.max_iter).fit(_array(scaler(train_x)), labels)
        predictions = final.predict(_array(scaler(test_x)))
        bar.update()
    test_top1 = float((predictions == test_y.cpu().numpy()).mean())
    sizes = {"select_train": len(fit_index), "select_val": len(val_index), "train": len(train_x), "test": len(test_x)}
    refit = {"C": chosen, "rows": len(train_x), **_convergence(final, config.max_iter)}
    return LogRegResult(chosen, grid, test_top1, predictions, refit, sizes)


def _array(x: torch.Tensor) -> np.ndarray:
    """float32 rows for scikit-learn (see the module's note on speed)."""
    return x.detach().cpu().float().numpy()


def _convergence(model: Any, max_iter: int) -> dict[str, Any]:
    iterations = int(np.max(model.n_iter_))
    return {"iterations": iterations, "converged": iterations < max_iter}
