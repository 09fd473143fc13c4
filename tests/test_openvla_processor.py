"""OpenVLA's (Prismatic's) image processors (moonvit.families.openvla.processor) and the commands on its folders.

Pinned against a plain reference written from Prismatic's code (``PrismaticImageProcessor.apply_transform``
and ``DinoSigLIPViTBackbone``'s transforms): the image converted as ``img.convert("RGB")``, letterboxed with
numpy, torchvision's ``resize`` / ``center_crop`` / ``to_tensor`` / ``normalize`` written out as Prismatic
calls them on the Pillow image (Pillow's resize, rounded crop offsets, float32 ``x / 255`` and
``(x - mean) / std``), each tower's copy stacked on channels; the processors' pixels equal it bit for bit
(the same float32 operations on the same uint8 pixels). End to end, the image through the processor and the
backbone equals the reference pixels through test_openvla's per-image reference of Prismatic's forward in
float64 within 1e-10. The commands are checked against the backbone called directly: bit for bit on the same
pack, else to float32's error across shapes (``ACROSS_SHAPES``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_close_across_shapes, folder_bytes, run_export, with_threads
from PIL import Image
from safetensors.torch import load_file
from test_openvla import PATCH, SIDE, TEXT, openvla_config, openvla_tensors, reference, write_openvla_folder

from moonvit import MoonViT
from moonvit.__main__ import main as moonvit_main
from moonvit.encode import checkpoint_processors
from moonvit.families.openvla import FusedBackbone, FusedImageProcessor, NativeFusedImageProcessor
from moonvit.media import patchify, processor_for
from moonvit.weights.storage import CheckpointError
from moonvit_eval.linear_probe import main as probe_main
from moonvit_eval.pictures import main as pictures_main
from moonvit_projector.dataset import VisualTokenDataset

IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
HALF = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
# OpenVLA's released preprocessor_config.json normalises DINOv2's half with these (ImageNet's in bfloat16)
RELEASE_DINO = ((0.484375, 0.455078125, 0.40625), (0.228515625, 0.2236328125, 0.224609375))
WIDTH = 80  # the tiny towers' 32 + 48 features
STRATEGIES = ("resize-naive", "resize-crop", "letterbox")
SIZES = [(50, 30), (31, 64), (16, 16), (9, 13), (101, 200), (640, 97)]


# ---- the reference: Prismatic's transform, from its code ---------------------------------------------


def ref_letterbox(image: Image.Image, fill: tuple[int, int, int]) -> Image.Image:
    """letterbox_pad_transform: int((max - side) / 2) pixels of ``fill`` on both ends of each side."""
    (w, h), side = image.size, max(image.size)
    across, down = int((side - w) / 2), int((side - h) / 2)
    canvas = np.empty((h + 2 * down, w + 2 * across, 3), dtype=np.uint8)
    canvas[:] = fill
    canvas[down : down + h, across : across + w] = np.asarray(image)
    return Image.fromarray(canvas)


def ref_resize(image: Image.Image, size: int | tuple[int, int], resample: int) -> Image.Image:
    """torchvision's resize of a Pillow image: (h, w) as given, or an int for the shorter side (the longer
    int(size * long / short)); unchanged at its own size; else Pillow's resize."""
    w, h = image.size
    if isinstance(size, int):
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    else:
        new_h, new_w = size
    if (new_h, new_w) == (h, w):
        return image
    return image.resize((new_w, new_h), resample)


def ref_center_crop(image: Image.Image, size: int) -> Image.Image:
    """torchvision's center_crop (the crop is never larger than the image here)."""
    w, h = image.size
    top, left = round((h - size) / 2.0), round((w - size) / 2.0)  # torchvision's int(round(...)): half to even
    return image.crop((left, top, left + size, top + size))


def ref_tower(image: Image.Image, mean: tuple, std: tuple) -> np.ndarray:
    """to_tensor then normalize, in float32: (3, H, W)."""
    x = np.asarray(image, dtype=np.uint8).astype(np.float32).transpose(2, 0, 1) / np.float32(255)
    m, s = (np.asarray(v, dtype=np.float32)[:, None, None] for v in (mean, std))
    return (x - m) / s


def prismatic_pixels(
    image: Image.Image,
    strategy: str,
    size: int,
    norms: tuple = (IMAGENET, HALF),
    fills: tuple = ((123, 116, 103), (127, 127, 127)),
    resamples: tuple = (Image.Resampling.BICUBIC, Image.Resampling.BICUBIC),
) -> np.ndarray:
    """One image through Prismatic's fused transform: (6, size, size) float32, DINOv2's then SigLIP's."""
    rgb = image.convert("RGB")
    halves = []
    for tower in range(2):
        x = ref_letterbox(rgb, fills[tower]) if strategy == "letterbox" else rgb
        x = ref_resize(x, (size, size) if strategy == "resize-naive" else size, resamples[tower])
        x = ref_center_crop(x, size)
        halves.append(ref_tower(x, *norms[tower]))
    return np.concatenate(halves)


def ref_patches(pixels: np.ndarray, patch: int) -> torch.Tensor:
    """The patches a strided convolution reads: the top-left whole ones, in raster order (L, 6, p, p)."""
    rows, cols = pixels.shape[1] // patch, pixels.shape[2] // patch
    kept = torch.from_numpy(np.ascontiguousarray(pixels[:, : rows * patch, : cols * patch]))
    return patchify(kept, patch)


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed + 1000 * width + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def image_in_mode(mode: str, width: int = 41, height: int = 23) -> Image.Image:
    """An image of ``mode`` with varied values (alpha too, where the mode has it; P with a transparent entry)."""
    rng = np.random.default_rng(7)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode == "P":
        image = rgba.convert("RGB").quantize(32)
        image.info["transparency"] = 3
        return image
    return rgba if mode == "RGBA" else rgba.convert(mode)


# ---- a transformers PrismaticImageProcessor file, as its __init__ writes it ---------------------------


def prismatic_file(strategy: str, size: int, **changes: Any) -> dict[str, Any]:
    """The preprocessor_config.json transformers saves for PrismaticImageProcessor(use_fused_vision_backbone=True,
    image_resize_strategy, input_sizes, interpolations, means, stds), its tvf_* parameters as __init__ derives
    them through timm (crop_pct 1: Resize(size) then CenterCrop(size)); normalised with the release's values."""
    dino, siglip = RELEASE_DINO, HALF
    values: dict[str, Any] = {
        "auto_map": {"AutoImageProcessor": "processing_prismatic.PrismaticImageProcessor"},
        "image_processor_type": "PrismaticImageProcessor",
        "processor_class": "PrismaticProcessor",
        "use_fused_vision_backbone": True,
        "image_resize_strategy": strategy,
        "input_sizes": [[3, size, size], [3, size, size]],
        "interpolations": ["bicubic", "bicubic"],
        "means": [list(IMAGENET[0]), list(HALF[0])],
        "stds": [list(IMAGENET[1]), list(HALF[1])],
        "tvf_resize_params": [
            {
                "size": [size, size] if strategy == "resize-naive" else size,
                "interpolation": 3,
                "max_size": None,
                "antialias": True,
            }
            for _ in range(2)
        ],
        "tvf_crop_params": [{"output_size": [size, size]}] * 2,
        "tvf_normalize_params": [
            {"mean": list(dino[0]), "std": list(dino[1]), "inplace": False},
            {"mean": list(siglip[0]), "std": list(siglip[1]), "inplace": False},
        ],
        "tvf_do_letterbox": strategy == "letterbox",
        "tvf_letterbox_fill": [127, 127, 127] if strategy == "letterbox" else None,  # the last tower's
    }
    values.update(changes)
    return values


def openvla_folder(root: Path, strategy: str = "resize-naive", file: dict[str, Any] | None = None) -> Path:
    folder = write_openvla_folder(root, config=openvla_config(image_resize_strategy=strategy))
    if file is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(file))
    return folder


# ---- the openvla rule against Prismatic's transform ---------------------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("size, patch", [(224, 14), (384, 14), (30, 4)])
def test_the_openvla_rule_equals_prismatics_transform(strategy, size, patch):
    processor = FusedImageProcessor(patch_size=patch, image_size=size, image_resize_strategy=strategy)
    images = [noise_image(w, h) for w, h in SIZES]
    batch = processor(images)
    n = size // patch  # 16 at 224, 27 at 384 (378 px read), 7 at 30 px (28 read)
    assert batch.grid_hws.tolist() == [[n, n]] * len(images) and processor.in_token_limit == n * n
    assert batch.pixel_values.shape == (len(images) * n * n, 6, patch, patch)
    expected = torch.cat([ref_patches(prismatic_pixels(image, strategy, size), patch) for image in images])
    assert torch.equal(batch.pixel_values, expected)
    for w, h in SIZES:  # the grid from the size alone
        assert processor.plan_image(w, h).grid_hw == (n, n)


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK", "1", "RGB"])
def test_image_modes_convert_as_prismatics_convert_rgb(mode):
    """Alpha dropped, not composited: Prismatic's img.convert("RGB")."""
    image = image_in_mode(mode)
    for strategy in STRATEGIES:
        processor = FusedImageProcessor(patch_size=PATCH, image_size=PATCH * SIDE, image_resize_strategy=strategy)
        expected = ref_patches(prismatic_pixels(image, strategy, PATCH * SIDE), PATCH)
        assert torch.equal(processor(image).pixel_values, expected), strategy


def test_a_file_on_disk_reads_as_the_image_opened(tmp_path):
    path = tmp_path / "logo.png"
    image_in_mode("RGBA", 37, 52).save(path)
    processor = FusedImageProcessor(patch_size=PATCH, image_size=PATCH * SIDE, image_resize_strategy="letterbox")
    with Image.open(path) as opened:
        expected = ref_patches(prismatic_pixels(opened, "letterbox", PATCH * SIDE), PATCH)
    assert torch.equal(processor([path]).pixel_values, expected)


def test_letterbox_pads_each_towers_copy_with_its_own_mean():
    """Prismatic's training transform: DINOv2's copy padded with 123 / 116 / 103, SigLIP's with 127."""
    processor = FusedImageProcessor(patch_size=PATCH, image_size=PATCH * SIDE, image_resize_strategy="letterbox")
    assert processor.letterbox_fills == ((123, 116, 103), (127, 127, 127))
    black = Image.new("RGB", (16, 8))  # 4 rows of padding above and below
    rendered = processor.render(black, processor.plan_image(16, 8))
    assert rendered.shape == (6, 16, 16) and rendered.dtype == torch.uint8
    assert rendered[:3, 0, 0].tolist() == [123, 116, 103] and rendered[3:, 0, 0].tolist() == [127] * 3
    assert rendered[:, 8, 8].tolist() == [0] * 6  # the image itself
    # the normalised padding: each tower's mean, up to the truncation of int(mean * 255)
    corner = processor(black).pixel_values[0, :, 0, 0]
    assert torch.equal(corner[3:], (torch.full((3,), 127.0) / 255 - 0.5) / 0.5)
    assert corner.abs().max() < 0.012  # (123 / 255 - 0.485) / 0.229 the farthest from 0


def test_describe_names_the_strategy_and_both_normalisations():
    line = FusedImageProcessor(image_size=384, image_resize_strategy="letterbox").describe()
    assert line.startswith("OpenVLA's rule (letterbox): padded to square (DINOv2's 123/116/103, SigLIP's 127/127/127)")
    assert "shorter side to 384 (bicubic), centre crop 384x384, its top-left 378x378 px kept" in line
    assert "DINOv2's half mean 0.485/0.456/0.406, std 0.229/0.224/0.225; SigLIP's mean 0.5/0.5/0.5" in line
    assert line.endswith("27x27 patches of 14 px, 6 channels")


# ---- the native rule ----------------------------------------------------------------------------------


def test_the_native_rule_keeps_each_images_aspect_with_both_normalisations():
    processor = NativeFusedImageProcessor(patch_size=PATCH, in_token_limit=16, patch_limit_on_one_side=8)
    images = [noise_image(w, h) for w, h in SIZES]
    batch = processor(images)
    start = 0
    for image, (rows, cols) in zip(images, batch.grid_hws.tolist()):
        plan = processor.plan_image(*image.size)  # from the size alone
        assert plan.grid_hw == (rows, cols) and rows * cols <= 16 and max(rows, cols) <= 8
        resized = image.resize((cols * PATCH, rows * PATCH), Image.Resampling.BICUBIC)
        halves = [ref_tower(resized, *norm) for norm in (IMAGENET, HALF)]
        expected = ref_patches(np.concatenate(halves), PATCH)
        assert torch.equal(batch.pixel_values[start : start + rows * cols], expected)
        start += rows * cols
    assert start == len(batch.pixel_values)
    wide, tall = processor.plan_image(640, 97).grid_hw, processor.plan_image(31, 64).grid_hw
    assert wide[1] > wide[0] and tall[0] > tall[1]  # the aspect kept (a fixed rule gives 4 x 4)
    assert processor([noise_image(8, 8)], in_token_limit=[1]).grid_hws.tolist() == [[1, 1]]


# ---- a folder's processor -------------------------------------------------------------------------------


def test_a_folder_without_a_file_reads_its_config_json(tmp_path):
    for strategy in STRATEGIES:
        folder = openvla_folder(tmp_path / strategy, strategy)
        processor = processor_for(folder)
        assert processor == FusedImageProcessor(
            patch_size=PATCH, image_size=PATCH * SIDE, image_resize_strategy=strategy
        )
        assert processor_for(folder, "openvla") == processor
        assert checkpoint_processors(folder, MoonViT.from_pretrained(folder).config).image == processor  # default


def test_transformers_prismatic_file_is_read_as_transformers_applies_it(tmp_path):
    """The tvf_* values win: DINOv2's half with the release's bfloat16 statistics, one letterbox colour."""
    images = [noise_image(w, h) for w, h in SIZES]
    for strategy in STRATEGIES:
        folder = openvla_folder(tmp_path / strategy, strategy, prismatic_file(strategy, PATCH * SIDE))
        processor = processor_for(folder)
        assert isinstance(processor, FusedImageProcessor) and processor.image_means[0] == RELEASE_DINO[0]
        one = (127, 127, 127)  # transformers pads once, with the last tower's colour (its file's tvf_letterbox_fill)
        expected = torch.cat(
            [
                ref_patches(prismatic_pixels(image, strategy, PATCH * SIDE, (RELEASE_DINO, HALF), (one, one)), PATCH)
                for image in images
            ]
        )
        assert torch.equal(processor(images).pixel_values, expected), strategy
    # without the file, Prismatic's training transform: each tower's colour and timm's exact statistics
    own = processor_for(openvla_folder(tmp_path / "bare", "letterbox"))
    assert own.letterbox_fills == ((123, 116, 103), (127, 127, 127)) and own.image_means[0] == IMAGENET[0]
    # a file without the tvf_* values: derived as __init__ derives them (the means, the last tower's colour)
    bare = prismatic_file("letterbox", PATCH * SIDE)
    for key in (
        "tvf_resize_params",
        "tvf_crop_params",
        "tvf_normalize_params",
        "tvf_do_letterbox",
        "tvf_letterbox_fill",
    ):
        del bare[key]
    derived = processor_for(openvla_folder(tmp_path / "derived", "letterbox", bare))
    assert derived.image_means == (IMAGENET[0], HALF[0]) and derived.letterbox_fills == ((127, 127, 127),) * 2


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"use_fused_vision_backbone": False}, "use_fused_vision_backbone False: only the fused"),
        ({"input_sizes": [[3, 32, 32]] * 2}, "input_sizes 32 px, but the backbone's towers are 16 px ones"),
        ({"input_sizes": [[3, 16, 16]]}, r"input_sizes \[\[3, 16, 16\]\]: two equal square"),
        ({"interpolations": ["bicubic", "area"]}, r"interpolations \['bicubic', 'area'\]: two of timm's names"),
        (
            {"tvf_resize_params": [{"size": 16, "interpolation": 3, "max_size": None}] * 2},
            r"tvf_resize_params\[0\] size 16 does not go with image_resize_strategy 'resize-naive'",
        ),
        ({"tvf_do_letterbox": True}, "tvf_do_letterbox True does not go with image_resize_strategy 'resize-naive'"),
        ({"tvf_normalize_params": [{"mean": [0.5] * 3, "std": [0.0] * 3}] * 2}, "image_stds positive"),
        ({"image_resize_strategy": "squash"}, "image_resize_strategy 'squash' is not one of"),
        ({"image_processor_type": "SiglipImageProcessor"}, "'SiglipImageProcessor' is not OpenVLA's"),
    ],
)  # fmt: skip
def test_a_file_this_package_cannot_reproduce_is_refused_naming_it(tmp_path, changes, message):
    folder = openvla_folder(tmp_path / "bad", file=prismatic_file("resize-naive", PATCH * SIDE, **changes))
    with pytest.raises(CheckpointError, match=message) as error:
        processor_for(folder)
    assert "preprocessor_config.json" in str(error.value)


def test_rules_by_name_round_trips_and_their_errors(tmp_path):
    folder = openvla_folder(tmp_path / "file", file=prismatic_file("resize-naive", PATCH * SIDE))
    native = processor_for(folder, "native")
    # the budget of the towers' native grid, the folder's own normalisations
    assert native == NativeFusedImageProcessor(
        patch_size=PATCH, in_token_limit=SIDE * SIDE, image_means=(RELEASE_DINO[0], HALF[0]),
        image_stds=(RELEASE_DINO[1], HALF[1]),
    )  # fmt: skip
    assert processor_for(folder, "native", in_token_limit=64).in_token_limit == 64
    for processor in (processor_for(folder), native):
        saved = tmp_path / type(processor).__name__
        write_openvla_folder(saved)
        processor.save_pretrained(saved)
        assert processor_for(saved) == processor  # its own file, read back
    # the default rule on a folder whose file is a native one: openvla, with that file's normalisations
    assert checkpoint_processors(saved, MoonViT.from_pretrained(saved).config).image == FusedImageProcessor(
        patch_size=PATCH, image_size=PATCH * SIDE, image_means=native.image_means, image_stds=native.image_stds
    )
    with pytest.raises(ValueError, match=r"unknown processor rule 'siglip' .* choose one of openvla, native"):
        processor_for(folder, "siglip")
    with pytest.raises(ValueError, match="has no such setting"):
        processor_for(folder, shortest_edge=3)
    with pytest.raises(ValueError, match=r"normalises 6 channels .* got pixels of shape \(2, 3, 4, 4\)"):
        native.normalize(torch.zeros(2, 3, 4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="image_resize_strategy must be one of"):
        FusedImageProcessor(image_resize_strategy="squash")  # type: ignore[arg-type]
    assert native([]).pixel_values.shape == (0, 6, PATCH, PATCH)


# ---- image -> tokens: the processor and the backbone against Prismatic ------------------------------------


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_images_through_the_folder_match_prismatic_in_float64(tmp_path, strategy):
    tensors = openvla_tensors()
    folder = openvla_folder(tmp_path / "openvla", strategy, prismatic_file(strategy, PATCH * SIDE))
    model = FusedBackbone.from_pretrained(folder, dtype=torch.float64)
    images = [noise_image(w, h) for w, h in SIZES[:4]]
    batch = processor_for(folder)(images)
    one = (127, 127, 127)
    pixels = torch.cat(
        [
            ref_patches(prismatic_pixels(image, strategy, PATCH * SIDE, (RELEASE_DINO, HALF), (one, one)), PATCH)
            for image in images
        ]
    ).double()
    features, tokens = reference({name: t.double() for name, t in tensors.items()}, pixels, [(SIDE, SIDE)] * 4)
    out = model(batch.pixel_values.double(), batch.grid_hws)
    torch.testing.assert_close(out.last_hidden_state, features, rtol=0, atol=1e-10)
    torch.testing.assert_close(model.project(out.last_hidden_state), tokens, rtol=0, atol=1e-10)


# ---- the commands ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return openvla_folder(tmp_path_factory.mktemp("openvla"), "letterbox")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("images")
    paths = []
    for i, (w, h) in enumerate(SIZES[:4]):
        paths.append(root / f"img{i}.png")
        noise_image(w, h, seed=i).save(paths[-1])
    return paths


def direct(folder: Path, sources: list, rule: str | None = None) -> tuple[FusedBackbone, torch.Tensor, torch.Tensor]:
    """The backbone of ``folder`` on one pack of ``sources`` in order, on one thread: (model, features, grid_hws)."""

    def call():
        torch.set_num_threads(1)
        model = FusedBackbone.from_pretrained(folder, dtype=torch.float32)
        batch = processor_for(folder, rule)(sources)
        with torch.no_grad():
            return model, model(batch.pixel_values, batch.grid_hws).last_hidden_state, batch.grid_hws

    return with_threads(call)


def test_main_job_writes_features_and_projected_tokens(folder, images, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--checkpoint", str(folder), "--images", *map(str, images), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*args, "--threads", "1", "--save-checkpoint", str(tmp_path / "saved")])
    printed = capsys.readouterr().out
    assert "processor: OpenVLA's rule (letterbox): padded to square (DINOv2's 123/116/103" in printed
    assert "per image also projected (n, T), in projected.safetensors" in printed
    model, features, grids = direct(folder, images)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["projected"] == {"shape": ["tokens", TEXT]} and "pooled" not in summary
    assert sorted(p.name for p in out.iterdir()) == ["merged.safetensors", "projected.safetensors", "summary.json"]
    merged, projected = load_file(out / "merged.safetensors"), load_file(out / "projected.safetensors")
    rows = features.split([h * w for h, w in grids.tolist()])
    for i, entry in enumerate(summary["images"]):
        key = entry["image"]
        assert entry["grid_hw"] == [SIDE, SIDE] and entry["num_tokens"] == SIDE * SIDE
        assert merged[key].shape == (SIDE * SIDE, 1, WIDTH) and projected[key].shape == (SIDE * SIDE, TEXT)
        assert torch.equal(merged[key][:, 0], rows[i])  # the same pack, the same call
        with torch.no_grad():
            assert_close_across_shapes(projected[key], model.project(rows[i]))
    # the saved folder is the backbone's own, with the processor it ran
    saved = MoonViT.from_pretrained(tmp_path / "saved")
    assert isinstance(saved, FusedBackbone) and saved.config == model.config
    assert checkpoint_processors(tmp_path / "saved", saved.config).image == processor_for(folder)


def test_main_job_reads_a_folder_at_native_resolution_by_name(folder, images, tmp_path):
    out = tmp_path / "out"
    args = ["--checkpoint", str(folder), "--images", *map(str, images), "--out", str(out), "--dtype", "fp32"]
    with_threads(moonvit_main, [*args, "--threads", "1", "--image-rule", "native"])
    _, features, grids = direct(folder, images, "native")
    summary = json.loads((out / "summary.json").read_text())
    assert [entry["grid_hw"] for entry in summary["images"]] == grids.tolist()
    assert len({tuple(g) for g in grids.tolist()}) > 1  # each image's own grid
    merged = load_file(out / "merged.safetensors")
    for entry, rows in zip(summary["images"], features.split([h * w for h, w in grids.tolist()])):
        assert torch.equal(merged[entry["image"]][:, 0], rows)


def test_export_stores_features_and_projected_tokens(folder, images, tmp_path):
    out = tmp_path / "out"
    run_export("--inputs", images[0].parent, "--checkpoint", folder, "--out", out, "--store", "both", "--dtype", "fp32")
    run = json.loads((out / "run.json").read_text())
    assert run["models"]["projector"] == {
        "tower": "fused DINOv2 + SigLIP backbone of OpenVLA", "vision_hidden_size": WIDTH, "text_hidden_size": TEXT,
        "source": "the encoder's own",
    }  # fmt: skip
    assert run["processor"]["image_processor_type"] == "FusedImageProcessor" and "pooled" not in run
    model, features, grids = direct(folder, images)
    dataset = VisualTokenDataset(out)
    assert dataset.kinds == ("merged", "projected")
    for path, rows in zip(images, features.split([h * w for h, w in grids.tolist()])):
        item = dataset.by_id(path.name)
        assert item["merged"].shape == (SIDE * SIDE, 1, WIDTH) and item["projected"].shape == (SIDE * SIDE, TEXT)
        assert_close_across_shapes(item["merged"][:, 0], rows)
        with torch.no_grad():
            assert_close_across_shapes(item["projected"], model.project(rows))
    # the default store: projected tokens alone, through the folder's own projector
    run_export("--inputs", images[0].parent, "--checkpoint", folder, "--out", tmp_path / "projected")
    assert VisualTokenDataset(tmp_path / "projected").kinds == ("projected",)


def test_the_ray_engine_writes_the_local_export_s_bytes(folder, images, tmp_path):
    """6-channel packs decoded in Ray's tasks, features and projected tokens from its encoder actors."""
    pytest.importorskip("ray")
    args = ["--inputs", images[0].parent, "--checkpoint", folder, "--store", "both", "--shard-size", "2"]
    run_export(*args, "--max-patches-per-pack", "32", "--out", tmp_path / "local")
    run_export(*args, "--max-patches-per-pack", "32", "--out", tmp_path / "ray", "--engine", "ray")
    assert folder_bytes(tmp_path / "ray") == folder_bytes(tmp_path / "local")


PROBE = ["--dataset", "digits", "--short-side", "32", "--no-baseline", "--solver", "lbfgs", "--Cs", "1", "--no-logreg"]


def test_linear_probe_takes_the_mean_view(folder, tmp_path):
    argv = ["--checkpoint", str(folder), "--features", "mean", *PROBE, "--out", str(tmp_path / "out"), "--threads", "1"]
    results = with_threads(probe_main, argv)
    assert results["features"] == "mean" and results["feature_dim"] == WIDTH
    assert results["top1"] > 0.3  # a random tiny backbone on 10 classes, well above chance


@pytest.mark.parametrize(
    "view, reason",
    [
        ("cls", "--features cls reads the CLS token, and this encoder (a fused DINOv2 + SigLIP backbone of OpenVLA)"),
        ("both", "--features both reads the CLS token"),
        ("pooled", "--features pooled reads the tower's pooled output, and this encoder (a fused DINOv2 + SigLIP"),
        ("last4", "--features last4 reads the last 4 blocks' hidden states, and this encoder (a fused DINOv2"),
    ],
)  # fmt: skip
def test_probe_views_the_backbone_cannot_give_are_refused_before_any_work(folder, tmp_path, capsys, view, reason):
    with pytest.raises(SystemExit):
        probe_main(["--checkpoint", str(folder), "--features", view, *PROBE, "--out", str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert reason in error and "choose mean" in error and "(mean, merged-mean)" in error
    assert not (tmp_path / "out").exists()


def test_position_pictures_are_refused_by_name(folder, tmp_path, capsys):
    with pytest.raises(SystemExit):
        pictures_main(["--checkpoint", str(folder), "--out", str(tmp_path / "p.png")])
    assert "holds a fused DINOv2 + SigLIP backbone of OpenVLA, not one tower" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
