"""Prefetching workers: the ordered background map, and the export, the probe's feature extraction
and the trainer giving with ``--workers N`` exactly what they give inline."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import tiny_model

from moonvit import MoonViTImageProcessor
from moonvit.prefetch import prefetch


def test_results_come_in_input_order_whatever_finishes_first():
    delays = [0.05, 0.0, 0.03, 0.0, 0.01, 0.0]

    def slow(i: int) -> int:
        time.sleep(delays[i])
        return i * i

    assert list(prefetch(range(6), slow, workers=3)) == [(i, i * i) for i in range(6)]
    assert list(prefetch(range(6), slow, workers=0)) == [(i, i * i) for i in range(6)]


def test_inline_runs_on_the_calling_thread_and_workers_do_not():
    caller = threading.get_ident()
    inline = [thread for _, thread in prefetch(range(3), lambda _: threading.get_ident(), workers=0)]
    background = [thread for _, thread in prefetch(range(3), lambda _: threading.get_ident(), workers=2)]
    assert set(inline) == {caller} and caller not in background


def test_at_most_workers_items_are_drawn_ahead():
    drawn: list[int] = []

    def source():
        for i in range(100):
            drawn.append(i)
            yield i

    results = prefetch(source(), lambda i: i, workers=2)
    assert next(results) == (0, 0)
    assert len(drawn) <= 3  # the one yielded and two ahead
    results.close()


def test_an_error_is_raised_at_its_item_and_a_stopped_consumer_does_not_hang():
    def fail_on_two(i: int) -> int:
        if i == 2:
            raise ValueError("item 2 is bad")
        return i

    results = prefetch(range(10), fail_on_two, workers=2)
    assert [next(results), next(results)] == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match="item 2 is bad"):
        next(results)
    stopped = prefetch(range(1000), lambda i: time.sleep(0.001) or i, workers=4)
    next(stopped)
    stopped.close()  # cancels what was queued, joins the threads


def test_negative_workers_are_refused():
    with pytest.raises(ValueError, match="workers must be 0"):
        list(prefetch(range(3), lambda i: i, workers=-1))


def test_feature_extraction_with_workers_equals_inline():
    from moonvit_eval.features import ResizePolicy, extract_features

    model, processor = tiny_model(seed=3), MoonViTImageProcessor()
    generator = torch.Generator().manual_seed(0)
    images = [torch.randint(0, 256, (3, 28 + 7 * (i % 5), 40), generator=generator, dtype=torch.uint8)
              for i in range(24)]  # fmt: skip
    arrays = [image.permute(1, 2, 0).numpy() for image in images]
    runs = [
        extract_features(model, processor, arrays, ["mean", "merged-mean"], resize=ResizePolicy(56),
                         max_patches_per_pack=256, workers=workers)
        for workers in (0, 2)
    ]  # fmt: skip
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][view], runs[1][view]) for view in runs[0])


def test_export_with_workers_writes_the_same_bytes(tmp_path):
    from helpers import make_checkpoint, write_images

    from moonvit_projector.export import main as export_main

    checkpoint, images = make_checkpoint(tmp_path / "ckpt"), tmp_path / "images"
    write_images(images, 9)
    summaries = {}
    for workers in (0, 2):
        out = tmp_path / f"out{workers}"
        summaries[workers] = export_main(
            [
                "--inputs",
                str(images),
                "--checkpoint",
                str(checkpoint),
                "--out",
                str(out),
                "--threads",
                "1",
                "--max-patches-per-pack",
                "256",
                "--workers",
                str(workers),
            ]
        )
    assert summaries[0]["images"] == summaries[2]["images"] == 9
    assert all(0.0 <= s["data_share"] <= 1.0 for s in summaries.values())
    files = [{p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
             for out in (tmp_path / "out0", tmp_path / "out2")]  # fmt: skip
    assert files[0] == files[1]


def test_training_with_render_workers_equals_inline_and_resumes_exactly(tmp_path):
    from test_train import MIXED, RUN, kill_after_steps, train, weights

    args = [*RUN, *MIXED, "--steps", "8", "--save-every", "3"]
    train(*args, "--out", tmp_path / "inline")
    train(*args, "--workers", "2", "--out", tmp_path / "workers")
    kill_after_steps([*args, "--workers", "2"], tmp_path / "killed", 4)
    train(*args, "--workers", "2", "--out", tmp_path / "killed")
    inline = weights(tmp_path / "inline")
    for run in ("workers", "killed"):
        other = weights(tmp_path / run)
        assert all(torch.equal(inline[k], other[k]) for k in inline), run
