"""moonvit.ray_data.EncodeImages in a small Ray Data pipeline on a local Ray instance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import assert_close_across_shapes, make_checkpoint, write_images

from moonvit import MoonViT, MoonViTImageProcessor, MoonViTProjector, encode_images

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ray_udf")
    checkpoint = make_checkpoint(folder / "checkpoint")
    images = write_images(folder / "images", 5)
    bad = folder / "images" / "broken.png"
    bad.write_bytes(b"not an image")
    return checkpoint, images, bad


def expected(checkpoint, images):
    encoder = MoonViT.from_pretrained(checkpoint).float().eval()
    return encode_images(encoder, MoonViTImageProcessor.from_pretrained(checkpoint), images, max_patches_per_pack=256)


def test_map_batches_gives_the_tokens_of_encode_images(local_ray, inputs):
    from moonvit.ray_data import EncodeImages

    checkpoint, images, bad = inputs
    paths = [str(p) for p in images]
    rows = [{"image": p, "id": i} for i, p in enumerate([*paths[:2], str(bad), *paths[2:]])]
    ds = ray.data.from_items(rows).map_batches(
        EncodeImages,
        fn_constructor_args=(str(checkpoint),),
        fn_constructor_kwargs={"dtype": "fp32", "device": "cpu", "max_patches_per_pack": 256},
        concurrency=1,
        batch_size=4,
    )
    out = sorted(ds.take_all(), key=lambda row: row["id"])
    assert [row["image"] for row in out] == [row["image"] for row in rows]
    assert "broken.png" in out[2]["error"] and out[2]["token_count"] == 0 and out[2]["tokens"].shape[0] == 0
    good = [row for row in out if not row["error"]]
    assert len(good) == len(images)
    reference = expected(checkpoint, images)
    for row, tokens, thw in zip(good, reference, reference.grid_thws):
        assert tuple(row["grid_thw"]) == thw
        assert row["token_count"] == tokens.shape[0]
        got = torch.tensor(np.asarray(row["tokens"], dtype=np.float32))
        assert_close_across_shapes(got, tokens.flatten(1), f"image {row['id']}")


def test_bytes_and_projected_tokens(local_ray, inputs):
    from moonvit.ray_data import EncodeImages

    checkpoint, images, bad = inputs
    sources = [*images[:2], bad]
    ds = ray.data.from_items([{"bytes": p.read_bytes()} for p in sources]).map_batches(
        EncodeImages,
        fn_constructor_args=(str(checkpoint),),
        fn_constructor_kwargs={"dtype": "fp32", "projector": True, "image_column": "bytes"},
        concurrency=1,
        batch_size=8,
    )
    out = ds.take_all()
    assert out[2]["error"].startswith("cannot decode image bytes") and out[2]["tokens"].shape == (0, 32)
    projector = MoonViTProjector.from_pretrained(checkpoint).float().eval()
    reference = expected(checkpoint, images[:2])
    for row, merged in zip(out[:2], reference):
        assert row["error"] == ""
        with torch.no_grad():
            assert_close_across_shapes(torch.tensor(np.asarray(row["tokens"])), projector(merged))
