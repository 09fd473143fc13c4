"""Weighted k-nearest-neighbour classification of frozen features, as DINO (Caron et al. 2021) and DINOv3 report it.

Features are L2-normalised as extracted (no standardisation: the cosine is the metric). Each
query's cosine similarity to every row of a memory bank is computed, its k most similar rows vote
for their class with weight ``exp(sim / T)`` (T = 0.07), and the class with the largest total wins
(a tie goes to the lowest class index). Queries are taken in chunks, so the (M, N) similarity
matrix never exists whole: 10,000 test images against a 60,000-image bank would be 2.4 GB in
float32.

:func:`run_knn` scores the test split with all of train as the bank, and the probe's validation
cut (:func:`moonvit_eval.splits.stratified_split`, the same seed and share) with the rest of train as the
bank, so runs can be compared without looking at test.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .splits import stratified_split

__all__ = ["DEFAULT_KS", "DEFAULT_TEMPERATURE", "KnnConfig", "KnnResult", "knn_predict", "run_knn"]

DEFAULT_KS = (10, 20)
DEFAULT_TEMPERATURE = 0.07
MAX_CHUNK_SIMILARITIES = 1 << 24
"""Similarities one chunk of queries may hold at once (64 MB in float32); sets the default chunk size."""


@dataclass(frozen=True)
class KnnConfig:
    """kNN settings (recorded in the results).

    Attributes:
        ks: the neighbour counts scored (each from the same similarities).
        temperature: T of the vote weights ``exp(sim / T)``.
        val_fraction, seed: the validation cut of train (the probe's).
    """

    ks: tuple[int, ...] = DEFAULT_KS
    temperature: float = DEFAULT_TEMPERATURE
    val_fraction: float = 0.1
    seed: int = 0


@dataclass
class KnnResult:
    """Top-1 of the kNN classifier per k.

    Attributes:
        test_top1: {k: top-1 on test}, the bank all of train.
        val_top1: {k: top-1 on the validation cut}, the bank the rest of train (None: an empty cut).
        effective_k: {k: neighbours that voted}: k, or the bank's size when it is smaller.
        sizes: rows of the bank, test, the validation bank and the validation cut.
    """

    test_top1: dict[int, float]
    val_top1: dict[int, float | None]
    effective_k: dict[int, int]
    sizes: dict[str, int]


def knn_predict(
    bank_x: torch.Tensor,
    bank_y: torch.Tensor,
    query_x: torch.Tensor,
    num_classes: int,
    ks: Sequence[int],
    *,
    temperature: float = DEFAULT_TEMPERATURE,
    chunk_size: int | None = None,
    progress: str | None = None,
) -> dict[int, torch.Tensor]:
    """Classes the weighted kNN vote gives each query, for every k.

    Similarities are computed in float32 (float64 when the features are), on the bank's device.

    Args:
        bank_x: (N, F) features of the memory bank; bank_y: (N,) int64 labels in [0, num_classes).
        query_x: (M, F) features to classify.
        ks: neighbour counts (each >= 1); a k above N uses all N rows.
        temperature: T of the weights ``exp(sim / T)``.
        chunk_size: queries per chunk (default: as many as keep a chunk's (chunk, N) similarities
            within :data:`MAX_CHUNK_SIMILARITIES`).
        progress: the description of a tqdm bar over the queries (None: no bar).

    Returns:
        {k: (M,) int64 predicted classes}.

    Raises:
        ValueError: an empty bank, no k or a k below 1.
    """
    if len(bank_x) == 0:
        raise ValueError("the kNN memory bank has no rows")
    if not ks or min(ks) < 1:
        raise ValueError(f"kNN needs neighbour counts of at least 1, got {list(ks)}")
    dtype = torch.promote_types(bank_x.dtype, torch.float32)
    bank = F.normalize(bank_x.to(dtype), dim=1)
    labels = bank_y.to(bank.device).long()
    largest = min(max(ks), len(bank))
    if chunk_size is None:
        chunk_size = max(1, MAX_CHUNK_SIMILARITIES // len(bank))
    predictions: dict[int, list[torch.Tensor]] = {k: [] for k in ks}
    bar = tqdm(total=len(query_x), desc=progress, unit="img", disable=progress is None)
    for chunk in query_x.split(chunk_size):
        similarity = F.normalize(chunk.to(bank), dim=1) @ bank.T  # (B, N) cosines
        top_similarity, top_index = similarity.topk(largest, dim=1)  # sorted: the first k are the k nearest
        weights = (top_similarity / temperature).exp()
        neighbour_labels = labels[top_index]  # (B, largest)
        for k in ks:
            used = min(k, largest)
            votes = weights.new_zeros(len(chunk), num_classes)
            votes.scatter_add_(1, neighbour_labels[:, :used], weights[:, :used])
            predictions[k].append(votes.argmax(dim=1))  # the first maximum: ties go to the lowest class
        bar.update(len(chunk))
    bar.close()
    empty = torch.zeros(0, dtype=torch.long, device=bank.device)
    return {k: torch.cat(chunks) if chunks else empty for k, chunks in predictions.items()}


def run_knn(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    test_y: torch.Tensor,
    num_classes: int,
    config: KnnConfig,
    chunk_size: int | None = None,
    progress: str | None = None,
) -> KnnResult:
    """Top-1 of the weighted kNN on test (bank: all of train) and on the validation cut (bank: the rest of train).

    Args:
        train_x: (N, F) features; train_y: (N,) int64 labels; test_x: (M, F); test_y: (M,).
        chunk_size: see :func:`knn_predict`.
        progress: what the tqdm bars of the test and validation queries are headed with (None: no bars).
    """
    kept, held = (
        torch.from_numpy(i).to(train_x.device)
        for i in stratified_split(train_y.cpu().numpy(), config.val_fraction, config.seed)
    )
    train_y, test_y = train_y.to(train_x.device), test_y.to(train_x.device)

    def top1(
        bank: torch.Tensor, bank_y: torch.Tensor, query: torch.Tensor, query_y: torch.Tensor, part: str
    ) -> dict[int, float]:
        predicted = knn_predict(
            bank,
            bank_y,
            query,
            num_classes,
            config.ks,
            temperature=config.temperature,
            chunk_size=chunk_size,
            progress=None if progress is None else f"{progress}: {part}",
        )
        return {k: float((classes == query_y).double().mean()) for k, classes in predicted.items()}

    test_top1 = top1(train_x, train_y, test_x, test_y, "test")
    val_top1: dict[int, float | None] = dict.fromkeys(config.ks)
    if len(held) and len(kept):
        val_top1.update(top1(train_x[kept], train_y[kept], train_x[held], train_y[held], "validation"))
    sizes = {"bank": len(train_x), "test": len(test_x), "val_bank": len(kept), "val": len(held)}
    return KnnResult(test_top1, val_top1, {k: min(k, len(train_x)) for k in config.ks}, sizes)
