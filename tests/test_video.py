"""Videos: the release's sampling and chunking on synthetic files written with PyAV, the K2.5
image rule on sizes worked out by hand, decoded-frame input, bad files, and videos through
encode_images and the export."""

import json

import numpy as np
import pytest
import torch
from helpers import frame_pixels, make_checkpoint, randomize_, run_export, write_video

from moonvit import MoonViT, MoonViTImageProcessor, encode_images, iter_encode_images, preset_config
from moonvit.media.video import (
    MoonViTVideoProcessor,
    VideoFrames,
    VideoLoadError,
    VideoNotSupportedError,
    format_timestamp,
    probe_video,
    sample_frame_indices,
)
from moonvit_projector import VisualTokenDataset, collate_visual_tokens

pytest.importorskip("av")


# ---- the K2.5 image rule ----------------------------------------------------------------------

# (width, height, limit) -> (resized width, resized height, grid rows, grid cols), worked out by hand
# from scale = min(1, sqrt(limit / ((W // 14) (H // 14))), 7168 / W, 7168 / H), int() truncation,
# then padding to multiples of 28.
K25_TABLE = [
    ((500, 731, 16384), (500, 731, 54, 36)),  # under the budget: padded only (486 tokens)
    ((8000, 3000, 16384), (2929, 1098, 80, 210)),  # budget: scale 0.3662 (4200 tokens)
    ((3000, 3000, 16384), (1794, 1794, 130, 130)),  # padding lifts it over the budget: 16900 patches
    ((1920, 1080, 4096), (1196, 672, 48, 86)),  # a 1080p video frame at 4096 patches per frame
    ((20000, 100, 16384), (7168, 35, 4, 512)),  # the per-side cap binds, not the budget
    ((100, 20000, 16384), (35, 7168, 512, 4)),
    ((5, 3, 16384), (5, 3, 2, 2)),  # tiny: never upscaled, padded to one merged token
    ((14, 14, 16384), (14, 14, 2, 2)),
]


@pytest.mark.parametrize("size, expected", K25_TABLE, ids=[f"{w}x{h}@{n}" for (w, h, n), _ in K25_TABLE])
def test_k25_image_rule(size, expected):
    width, height, limit = size
    plan = MoonViTImageProcessor.kimi_k25(in_token_limit=limit).plan_image(width, height)
    assert (*plan.resized_size, *plan.grid_hw) == expected


def test_k25_preprocessor_config_forms(tmp_path):
    release = {"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384,
                                  "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 4096,
                                  "sample_fps": 2.0, "temporal_merge_kernel_size": 4,
                                  "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
               "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"}}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(release))
    image = MoonViTImageProcessor.from_pretrained(tmp_path)
    assert image == MoonViTImageProcessor.kimi_k25()
    video = MoonViTVideoProcessor.from_pretrained(tmp_path)
    assert video.frame_processor == MoonViTImageProcessor.kimi_k25(in_token_limit=4096)
    assert (video.sample_fps, video.frames_per_chunk) == (2.0, 4)

    theirs = tmp_path / "transformers"
    theirs.mkdir()
    (theirs / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Kimi_K25ImageProcessor", "max_patches": 8192, "patch_size": 14, "merge_size": 2,
         "size": {"max_height": 512, "max_width": 512}, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))  # fmt: skip
    (theirs / "video_preprocessor_config.json").write_text(
        json.dumps({"max_patches": 1024, "fps": 1, "temporal_patch_size": 2})
    )
    assert MoonViTImageProcessor.from_pretrained(theirs) == MoonViTImageProcessor.kimi_k25(in_token_limit=8192)
    video = MoonViTVideoProcessor.from_pretrained(theirs)
    assert (video.frame_processor.in_token_limit, video.sample_fps, video.frames_per_chunk) == (1024, 1.0, 2)


# ---- sampling and chunks -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frames, fps, expected",
    [
        (30, 30.0, [0, 29]),  # 1 s at 30 fps: 2 frames, the ends
        (100, 25.0, [0, 14, 28, 42, 57, 71, 85, 99]),  # round(linspace(0, 99, 8))
        (7, 1.5, [0, 1, 2, 3, 4, 5, 6]),  # under 2 fps: every frame
        (1, 30.0, [0]),  # one frame
        (3, 30.0, [0]),  # 0.1 s: round(0.2) = 0, at least one frame
    ],
)
def test_sampling_follows_the_release(frames, fps, expected):
    assert sample_frame_indices(frames, fps) == expected


@pytest.mark.parametrize(
    "frames, fps, chunk_frames",
    [(135, 30.0, [4, 4, 1]), (150, 30.0, [4, 4, 2]), (165, 30.0, [4, 4, 3]), (8, 1.5, [4, 4])],
)
def test_chunks_of_four_with_a_trailing_remainder(tmp_path, frames, fps, chunk_frames):
    path = write_video(tmp_path / "v.mkv", frames, fps, size=(101, 57))  # odd sizes
    video = MoonViTVideoProcessor()
    batch = video(path)
    indices = sample_frame_indices(frames, fps)
    assert [len(f) for f in batch.frame_indices] == chunk_frames
    assert [i for chunk in batch.frame_indices for i in chunk] == indices
    assert batch.timestamps == pytest.approx([chunk[0] / fps for chunk in batch.frame_indices])
    assert batch.grid_thws.tolist() == [[t, 6, 8] for t in chunk_frames]  # 101x57 -> padded 112x84
    assert batch.pixel_values.shape == (sum(chunk_frames) * 48, 3, 14, 14)


def test_decoded_pixels_are_the_sampled_frames(tmp_path):
    """Lossless file: the chunk's pixel_values equal the processor run on the frames themselves."""
    path = write_video(tmp_path / "v.mkv", 40, 10.0, size=(40, 30))
    video = MoonViTVideoProcessor()
    batch = video(path)
    indices = sample_frame_indices(40, 10.0)
    frames = [frame_pixels(i, 30, 40) for i in indices]
    expected = video.frame_processor(frames).pixel_values
    assert torch.equal(batch.pixel_values, expected)
    # and the same from frames a user decoded, as a (T, H, W, 3) array with its fps
    stacked = np.stack([frame_pixels(i, 30, 40) for i in range(40)])
    from_frames = video(stacked, fps=10.0)
    assert torch.equal(from_frames.pixel_values, batch.pixel_values)
    assert from_frames.grid_thws.tolist() == batch.grid_thws.tolist()


def test_a_lossy_mp4_reads_like_the_lossless_file(tmp_path):
    lossy = video_batch = MoonViTVideoProcessor()(write_video(tmp_path / "v.mp4", 24, 24.0, codec="libx264"))
    assert video_batch.grid_thws.tolist() == [[2, 4, 6]]
    assert lossy.pixel_values.shape == (2 * 24, 3, 14, 14)


def test_timestamps_format_as_the_release():
    assert format_timestamp(0) == "00:00:00.000"
    assert format_timestamp(3723.5) == "01:02:03.500"


# ---- bad input ---------------------------------------------------------------------------------


def test_bad_video_files_are_named(tmp_path):
    with pytest.raises(VideoLoadError, match="missing.mp4.*does not exist"):
        probe_video(tmp_path / "missing.mp4")
    (tmp_path / "empty.mp4").write_bytes(b"")
    with pytest.raises(VideoLoadError, match="empty.mp4"):
        probe_video(tmp_path / "empty.mp4")
    (tmp_path / "text.mp4").write_text("not a video at all\n" * 100)
    with pytest.raises(VideoLoadError, match="text.mp4"):
        probe_video(tmp_path / "text.mp4")
    # the index up front (faststart) promises 60 frames; half the data is gone
    good = write_video(tmp_path / "good.mp4", 60, 30.0, codec="libx264", movflags="faststart").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(good[: len(good) // 2])
    with pytest.raises(VideoLoadError, match="cut.mp4"):
        MoonViTVideoProcessor()(tmp_path / "cut.mp4")
    # the index at the end: cut, the file cannot be opened
    good = write_video(tmp_path / "late.mp4", 60, 30.0, codec="libx264").read_bytes()
    (tmp_path / "late-cut.mp4").write_bytes(good[: len(good) // 2])
    with pytest.raises(VideoLoadError, match="late-cut.mp4"):
        MoonViTVideoProcessor()(tmp_path / "late-cut.mp4")


def test_an_audio_only_file_has_no_video_stream(tmp_path):
    import av

    path = tmp_path / "audio.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), dtype=np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    with pytest.raises(VideoLoadError, match="audio.mkv.*has no video stream"):
        probe_video(path)


def test_decoded_frames_must_share_one_size_and_have_a_rate():
    frames = [frame_pixels(0, 30, 40), frame_pixels(1, 30, 40), frame_pixels(2, 32, 40)] * 4
    with pytest.raises(VideoLoadError, match="frame 2 is 40x32, the first 40x30"):
        MoonViTVideoProcessor(sample_fps=30.0)(frames, fps=30.0)
    with pytest.raises(VideoLoadError, match="fps must be a positive number"):
        VideoFrames(frames, fps=0)
    with pytest.raises(VideoLoadError, match="no frames"):
        VideoFrames(np.zeros((0, 4, 4, 3), np.uint8), fps=1.0)
    with pytest.raises(ValueError, match="need their fps"):
        MoonViTVideoProcessor()(frames)


# ---- through the encoder -----------------------------------------------------------------------


def k25_encoder():
    return randomize_(MoonViT(preset_config("tiny", init_pos_emb_time=4))).eval()


def test_encode_images_takes_videos_chunk_by_chunk(tmp_path):
    encoder = k25_encoder()
    path = write_video(tmp_path / "v.mkv", 30, 10.0, size=(40, 30))  # 6 sampled frames: chunks of 4 and 2
    image = frame_pixels(99, 50, 60)
    video = MoonViTVideoProcessor()
    results = list(iter_encode_images(encoder, MoonViTImageProcessor(), [image, path, image], video_processor=video))
    assert [(r.index, r.chunk, r.frames) for r in results] == [(0, None, 1), (1, 0, 4), (1, 1, 2), (2, None, 1)]
    assert results[2].timestamp == pytest.approx(sample_frame_indices(30, 10.0)[4] / 10.0)
    # a chunk's tokens equal the encoder on the processor's output for that video alone
    batch = video(path)
    with torch.no_grad():
        alone = encoder(batch.pixel_values, batch.grid_thws).merged
    torch.testing.assert_close(torch.cat([results[1].tokens, results[2].tokens]), alone, rtol=1e-5, atol=1e-5)
    # encode_images: one entry per chunk, each mapped back to its input
    encoded = encode_images(encoder, MoonViTImageProcessor(), [image, path, image], video_processor=video)
    assert len(encoded) == 4 and encoded.indices == [0, 1, 1, 2] and encoded.chunks == [None, 0, 1, None]
    assert encoded.grid_thws == [(1, *results[0].grid_hw), (4, 4, 4), (2, 4, 4), (1, *results[0].grid_hw)]
    assert encoded.timestamps == [None, 0.0, results[2].timestamp, None]
    sampled = sample_frame_indices(30, 10.0)
    assert encoded.frame_indices == [None, tuple(sampled[:4]), tuple(sampled[4:]), None]
    assert all(torch.equal(a, r.tokens) for a, r in zip(encoded, results))  # the same packs: the same calls


def test_an_image_only_encoder_refuses_videos_before_reading_them(tmp_path):
    (tmp_path / "v.mkv").write_text("not even a video: refused before it is opened")
    encoder = randomize_(MoonViT(preset_config("tiny")))
    with pytest.raises(VideoNotSupportedError, match=r"input 1 \(.*v\.mkv\) is a video: it needs a tower with a"):
        encode_images(encoder, MoonViTImageProcessor(), [frame_pixels(0, 28, 28), tmp_path / "v.mkv"])


def test_export_writes_one_record_per_chunk_and_resumes(tmp_path):
    checkpoint = tmp_path / "ckpt"
    encoder = k25_encoder()
    make_checkpoint(checkpoint)
    encoder.save_pretrained(checkpoint)  # the K2.5 tower over make_checkpoint's image-only one
    inputs = tmp_path / "in"
    inputs.mkdir()
    write_video(inputs / "clip.mkv", 30, 10.0, size=(40, 30))
    (inputs / "broken.mp4").write_text("nope")
    np.save(tmp_path / "unused.npy", np.zeros(1))
    from PIL import Image

    Image.fromarray(frame_pixels(1, 40, 40)).save(inputs / "still.png")
    out = tmp_path / "out"
    run_export("--inputs", inputs, "--checkpoint", checkpoint, "--out", out, "--store", "both", "--dtype", "fp32")
    lines = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ["clip.mkv#0", "clip.mkv#1", "still.png"]
    first, second = lines[0], lines[1]
    assert (first["video_id"], first["chunk"], first["frames"], first["grid_thw"]) == ("clip.mkv", 0, 4, [4, 4, 4])
    assert second["timestamp"] == pytest.approx(sample_frame_indices(30, 10.0)[4] / 10.0)
    assert first["num_tokens"] == 4 and "video_id" not in lines[2]
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    assert [f["id"] for f in failures] == ["broken.mp4"] and "broken.mp4" in failures[0]["reason"]
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix == ".safetensors"}
    run_export("--inputs", inputs, "--checkpoint", checkpoint, "--out", out, "--store", "both", "--dtype", "fp32")
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix == ".safetensors"} == before
    # read back: a chunk's item carries what video_prompt and expand_media_pads need
    items = VisualTokenDataset(out)
    chunk, still = items.by_id("clip.mkv#1"), items.by_id("still.png")
    assert (chunk["video_id"], chunk["chunk"], chunk["frames"], chunk["grid_thw"]) == ("clip.mkv", 1, 2, (2, 4, 4))
    assert chunk["timestamp"] == second["timestamp"] and chunk["frame_indices"] == tuple(second["frame_indices"])
    assert "video_id" not in still and still["grid_thw"] == (1, *still["grid_hw"])
    batch = collate_visual_tokens([items[0], items[1], items[2]])
    assert batch["grid_thws"].tolist() == [[4, 4, 4], [2, 4, 4], [1, *still["grid_hw"]]]
    assert batch["timestamps"] == [0.0, second["timestamp"], None]


# ---- saved folders and presets keep their family's rules ------------------------------------------


def _family_processors(family: str) -> tuple[MoonViTImageProcessor, MoonViTVideoProcessor | None]:
    """What each family's folder holds: Kimi-VL's tower takes images only (no video file is written)."""
    k25 = MoonViTImageProcessor.kimi_k25()
    return {
        "kimi-vl": (MoonViTImageProcessor(), None),
        "k25": (k25, MoonViTVideoProcessor.for_images(k25)),
        "k3": (MoonViTImageProcessor.kimi_k3(), MoonViTVideoProcessor.kimi_k3()),
    }[family]


@pytest.mark.parametrize(
    "family, expected",
    [("kimi-vl", (2.0, 4096, None, 4)), ("k25", (2.0, 4096, None, 4)), ("k3", (8.0, 16384, 655360, 4))],
)
def test_a_saved_folder_reads_back_its_video_rule(tmp_path, family, expected):
    image, video = _family_processors(family)
    image.save_pretrained(tmp_path)
    if video is not None:
        assert video.save_pretrained(tmp_path) == tmp_path / "video_preprocessor_config.json"
    loaded = MoonViTVideoProcessor.from_pretrained(tmp_path)
    fps, frame_limit, video_limit, chunk = expected
    assert (loaded.sample_fps, loaded.frame_processor.in_token_limit, loaded.video_patch_limit) == (
        fps,
        frame_limit,
        video_limit,
    )
    assert loaded.frames_per_chunk == chunk and MoonViTImageProcessor.from_pretrained(tmp_path) == image
    assert loaded == (video or MoonViTVideoProcessor.for_images(image))  # every field, frames' settings too
    if family == "k3":
        assert loaded.to_dict() == MoonViTVideoProcessor.kimi_k3().to_dict()
        written = json.loads((tmp_path / "video_preprocessor_config.json").read_text())
        assert written == {"video_processor_type": "MoonViTVideoProcessor", **MoonViTVideoProcessor.kimi_k3().to_dict()}


def test_every_preset_brings_its_family_s_processors():
    from moonvit import PRESETS, preset_processors
    from moonvit.media.presets import PRESET_FAMILIES

    assert set(PRESET_FAMILIES) == set(PRESETS)
    for name in PRESETS:
        config, rule = preset_config(name), preset_processors(name)
        if name.endswith("-v2"):
            assert config.norm_type == "rmsnorm" and rule.family == "Kimi K3"
            assert (rule.image, rule.video) == (MoonViTImageProcessor.kimi_k3(), MoonViTVideoProcessor.kimi_k3())
        elif name.endswith("-3d"):
            assert config.max_frames == 4 and rule.family == "Kimi-K2.5"
            assert rule.image == MoonViTImageProcessor.kimi_k25()
            assert (rule.video.sample_fps, rule.video.frame_processor.in_token_limit) == (2.0, 4096)
        else:
            assert config.max_frames == 1 and rule.family == "Kimi-VL" and rule.image == MoonViTImageProcessor()
    assert preset_processors("tiny-v2", side_limit_mode="error").image.side_limit_mode == "error"
    from moonvit_eval.encoder import load_frozen_encoder  # the probe's --preset takes the same rule

    assert load_frozen_encoder(preset="tiny-v2", random_init=True).processor == MoonViTImageProcessor.kimi_k3()
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset_processors("nope")


@pytest.mark.parametrize(
    "preset, chunks, header",
    [
        ("tiny-v2", [4, 4], "processor: Kimi K3's rule: images 65536 patches, padded to 28 px "
         "(sides over 512 resized); videos 8 fps, 16384 patches a frame, 655360 a video"),
        ("tiny-3d", [2], "processor: Kimi-K2.5's rule: images 16384 patches, padded to 28 px "
         "(sides over 512 resized); videos 2 fps, 4096 patches a frame"),
    ],
)  # fmt: skip
def test_the_main_job_samples_and_saves_with_a_preset_s_rule(tmp_path, capsys, preset, chunks, header):
    from moonvit.__main__ import main

    clip = write_video(tmp_path / "clip.mkv", 10, 10.0, size=(40, 30))  # 1 s: 8 frames at 8 fps, 2 at 2 fps
    saved, out = tmp_path / "saved", tmp_path / "out"
    args = ["--preset", preset, "--videos", str(clip), "--dtype", "fp32", "--out", str(out)]
    main([*args, "--threads", "1", "--save-checkpoint", str(saved)])
    assert header in capsys.readouterr().out.splitlines()
    summary = json.loads((out / "summary.json").read_text())["images"]
    assert [entry["frames"] for entry in summary] == chunks
    # the saved folder samples as the preset did, and the main job reads it back so
    from moonvit import preset_processors

    rule = preset_processors(preset)
    assert MoonViTVideoProcessor.from_pretrained(saved) == rule.video
    assert MoonViTImageProcessor.from_pretrained(saved) == rule.image
    main(["--checkpoint", str(saved), *args[2:], "--threads", "1", "--out", str(tmp_path / "again")])
    again = json.loads((tmp_path / "again" / "summary.json").read_text())["images"]
    assert [entry["frames"] for entry in again] == chunks
    assert header in capsys.readouterr().out.splitlines()  # the folder's processors match the family's rule


def test_an_image_only_preset_saves_no_video_settings(tmp_path, capsys):
    from moonvit.__main__ import main

    main(["--preset", "tiny", "--dtype", "fp32", "--out", str(tmp_path / "out"), "--threads", "1",
          "--save-checkpoint", str(tmp_path / "saved")])  # fmt: skip
    header = "processor: Kimi-VL's rule: images 4096 patches, padded to 28 px (sides over 512 refused)"
    assert header in capsys.readouterr().out
    assert not (tmp_path / "saved" / "video_preprocessor_config.json").exists()
    assert (tmp_path / "saved" / "preprocessor_config.json").is_file()
