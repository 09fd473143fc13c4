"""Videos for the Kimi-K2.5 / K2.6 tower: sampling, chunks of up to 4 frames, per-frame geometry.

The release's rule, step by step:

1. **Sample** at ``fps_s = min(sample_fps, fps)`` (2 fps by default):
   ``n = max(round(N * fps_s / fps), 1)`` frames of the N, at indices
   ``round(linspace(0, N - 1, n))`` (NumPy rounding, half to even).
2. **Chunk** the sampled frames into runs of ``frames_per_chunk`` (4) consecutive
   ones; the last chunk may hold 1-3. Each chunk is one item of the encoder
   (one ``(t, h, w)`` grid row): its frames attend to each other and are averaged
   by the merger, so a chunk gives ``h * w / 4`` tokens whatever its t. A
   1-frame chunk is encoded exactly like an image.
3. **Resize** every frame with the image rule of Kimi-K2.5 (a per-frame budget of
   ``in_token_limit`` = 4096 patches and the 512-patch per-side cap), Pillow
   bicubic on uint8, black padding to multiples of 28 px, then normalise and
   patchify; a chunk's ``pixel_values`` are its frames one after the other, each
   in raster order.
4. **Timestamps**: a chunk's is its first sampled frame's ``index / fps`` seconds.

Kimi K3 adds a budget for a whole video (:attr:`MoonViTVideoProcessor.video_patch_limit`),
which lowers the per-frame budget of step 3 for long videos; as every budget of the
release's resize, it sets the scale before truncation and padding, so the padded frames of
a video may exceed it.

Files are decoded with PyAV (``pip install 'moonvit[video]'``) frame by frame,
keeping only the sampled frames of the chunk at hand, so memory follows one
chunk, not the video. Frames a user already decoded (a robot's camera stream)
come in as :class:`VideoFrames` with their fps.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..files import write_text_atomic
from .image import ImageInput, ImageLoadError, image_size, load_image
from .processor import VIDEO_CONFIG_NAME, ImagePlan, ImageProcessor, MoonViTImageProcessor, patchify

__all__ = [
    "VIDEO_EXTENSIONS",
    "ChunkPlan",
    "MoonViTVideoProcessor",
    "VideoBatch",
    "VideoChunk",
    "VideoFrames",
    "VideoInfo",
    "VideoLoadError",
    "VideoNotSupportedError",
    "format_timestamp",
    "is_video",
    "sample_frame_indices",
]

VIDEO_EXTENSIONS = frozenset({".avi", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".webm"})
"""File endings taken as videos wherever inputs are scanned."""


class VideoLoadError(ImageLoadError):
    """A video cannot be read: missing, empty, truncated or not a video, no video stream, no
    frames, no frame rate, or a frame size that changes mid-stream. The message names the file.
    A subclass of :class:`ImageLoadError`, so code that skips bad images skips bad videos too."""


class VideoNotSupportedError(ValueError):
    """A video was given to a tower that takes images only (its temporal table is shorter than a
    chunk: Kimi-VL's MoonViT has none). Raised before anything is decoded."""


@dataclass(frozen=True)
class VideoFrames:
    """Frames a user already decoded, with their rate.

    Attributes:
        frames: a (T, H, W, 3) uint8 array, or a sequence of T images (PIL images, HWC uint8
            arrays, CHW tensors) of one size.
        fps: frames per second of ``frames``.
        name: what error messages and manifests call it.
    """

    frames: np.ndarray | Sequence[ImageInput]
    fps: float
    name: str = "<frames>"

    def __post_init__(self) -> None:
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise VideoLoadError(f"{self.name}: fps must be a positive number, got {self.fps!r}")
        if isinstance(self.frames, np.ndarray) and (self.frames.ndim != 4 or self.frames.shape[-1] != 3):
            raise VideoLoadError(f"{self.name}: a frame array must be (T, H, W, 3), got {self.frames.shape}")
        if len(self.frames) == 0:
            raise VideoLoadError(f"{self.name}: no frames")


VideoSource = str | os.PathLike | VideoFrames


def is_video(source: object) -> bool:
    """Whether an input is a video: :class:`VideoFrames`, or a path with a video file ending."""
    if isinstance(source, VideoFrames):
        return True
    return isinstance(source, (str, os.PathLike)) and Path(source).suffix.lower() in VIDEO_EXTENSIONS


def format_timestamp(seconds: float) -> str:
    """``HH:MM:SS.fff``, the release's timestamp of a chunk in its prompt."""
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}.{rest % 1000:03d}"


def sample_frame_indices(num_frames: int, fps: float, sample_fps: float = 2.0) -> list[int]:
    """The release's sampling: ``round(linspace(0, N - 1, n))`` with ``n = max(round(N * fps_s / fps), 1)``
    and ``fps_s = min(sample_fps, fps)``; at least one frame, never more than N."""
    if num_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {num_frames}")
    target = min(sample_fps, fps)
    count = max(int(np.rint(num_frames * target / fps)), 1)
    return [int(i) for i in np.rint(np.linspace(0, num_frames - 1, count))]


# ---- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoInfo:
    """A video's frame count, rate and (width, height), read from the container (no decoding)."""

    name: str
    num_frames: int
    fps: float
    size: tuple[int, int]


def _open(path: str) -> Any:
    try:
        import av
    except ImportError as error:  # pragma: no cover - the extra is installed by the dev set-up
        raise VideoLoadError(f"reading {path!r} needs PyAV: pip install 'moonvit[video]'") from error
    if not os.path.isfile(path):
        raise VideoLoadError(f"video file {path!r} does not exist")
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError) as error:
        raise VideoLoadError(f"cannot open video file {path!r}: {error}") from error
    if not container.streams.video:
        container.close()
        raise VideoLoadError(f"{path!r} has no video stream")
    return container


def probe_video(source: VideoSource) -> VideoInfo:
    """Frame count, rate and size of a video file (container metadata) or of :class:`VideoFrames`.

    Raises:
        VideoLoadError: the file cannot be opened as a video, or has no frames or no rate.
    """
    if isinstance(source, VideoFrames):
        frames = source.frames
        size = (frames.shape[2], frames.shape[1]) if isinstance(frames, np.ndarray) else image_size(frames[0])
        return VideoInfo(source.name, len(source.frames), float(source.fps), size)
    path = os.fspath(source)
    container = _open(path)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        if not rate or float(rate) <= 0:
            raise VideoLoadError(f"{path!r}: the video stream has no frame rate")
        count = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
        size = (stream.codec_context.width, stream.codec_context.height)
    finally:
        container.close()
    if count < 1 or min(size) < 1:
        raise VideoLoadError(f"{path!r}: the video stream holds no frames")
    return VideoInfo(path, int(count), float(rate), size)


class _FrameReader:
    """Decodes one file forward, frame by frame, keeping its place between calls, so that the
    chunks of a video read in order cost one decode of the file (an earlier frame reopens it)."""

    def __init__(self, path: str, size: tuple[int, int]) -> None:
        self.path, self.size = path, size
        self._container = _open(path)
        self._frames = self._container.decode(video=0)
        self.next_index = 0

    def read(self, indices: Sequence[int]) -> list[Image.Image]:
        import av

        wanted, frames = list(indices), []
        try:
            while wanted:
                frame = next(self._frames, None)
                if frame is None:
                    raise VideoLoadError(
                        f"{self.path!r} ends after {self.next_index} frames; frame {wanted[0]} was expected "
                        "(a truncated file, or a container whose frame count is wrong)"
                    )
                index, self.next_index = self.next_index, self.next_index + 1
                if (frame.width, frame.height) != self.size:
                    raise VideoLoadError(
                        f"{self.path!r}: frame {index} is {frame.width}x{frame.height}, the video "
                        f"{self.size[0]}x{self.size[1]} (the frame size changes mid-stream)"
                    )
                if index == wanted[0]:
                    frames.append(frame.to_image())
                    wanted.pop(0)
        except av.error.FFmpegError as error:
            raise VideoLoadError(f"cannot decode {self.path!r} at frame {self.next_index}: {error}") from error
        return frames

    def close(self) -> None:
        self._container.close()


class _ReaderCache:
    """One open reader per thread: the chunks of a video come in order, pack after pack."""

    def __init__(self) -> None:
        self._local = threading.local()

    def read(self, info: VideoInfo, indices: Sequence[int]) -> list[Image.Image]:
        reader: _FrameReader | None = getattr(self._local, "reader", None)
        if reader is None or reader.path != info.name or reader.next_index > indices[0]:
            if reader is not None:
                reader.close()
            reader = self._local.reader = _FrameReader(info.name, info.size)
        frames = reader.read(indices)
        if indices[-1] == info.num_frames - 1 or reader.next_index >= info.num_frames:
            reader.close()
            self._local.reader = None
        return frames


_READERS = _ReaderCache()


def read_frames(source: VideoSource, info: VideoInfo, indices: Sequence[int]) -> list[Image.Image]:
    """The frames at ``indices`` (increasing) as RGB PIL images."""
    if isinstance(source, VideoFrames):
        frames = [source.frames[i] for i in indices]
        images = [load_image(np.ascontiguousarray(f) if isinstance(f, np.ndarray) else f) for f in frames]
        for i, image in zip(indices, images):
            if image.size != info.size:
                raise VideoLoadError(
                    f"{source.name}: frame {i} is {image.size[0]}x{image.size[1]}, the first "
                    f"{info.size[0]}x{info.size[1]} (frames must share one size)"
                )
        return images
    return _READERS.read(info, indices)


# ---- chunks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkPlan:
    """One chunk of a video: its position, its sampled frame indices and its timestamp (seconds)."""

    chunk: int
    frame_indices: tuple[int, ...]
    timestamp: float

    @property
    def frames(self) -> int:
        return len(self.frame_indices)


@dataclass(frozen=True)
class VideoChunk:
    """A chunk as an input of a pack: the video it comes from and which frames it takes."""

    source: VideoSource
    info: VideoInfo
    plan: ChunkPlan

    @property
    def name(self) -> str:
        return self.info.name


@dataclass
class VideoBatch:
    """The processor's output for a video's chunks.

    Attributes:
        pixel_values: (L, 3, p, p) float32, each chunk's frames in order, each frame raster.
        grid_thws: (N, 3) int64, (frames, rows, cols) of each chunk.
        timestamps: N seconds, each chunk's first sampled frame.
        frame_indices: N tuples, each chunk's frame indices in the source.
    """

    pixel_values: torch.Tensor
    grid_thws: torch.Tensor
    timestamps: list[float]
    frame_indices: list[tuple[int, ...]]


@dataclass(frozen=True)
class MoonViTVideoProcessor:
    """Kimi-K2.5's video rule (see the module docstring).

    Attributes:
        frame_processor: the image processor each frame goes through; its ``in_token_limit``
            is the per-frame budget (4096 for K2.5) and its ``side_limit_mode`` should be
            ``"resize"`` (K2.5's per-side cap).
        sample_fps: frames per second sampled (at most the source's rate).
        frames_per_chunk: the most frames of a chunk (K2.5's ``temporal_merge_kernel_size``).
        video_patch_limit: Kimi K3's budget for a whole video (``in_patch_limit_video``): a video of
            n sampled frames has a per-frame limit of min(the frame processor's,
            max(1, round(video_patch_limit / n))), so long videos get smaller frames; None (K2.5):
            no such budget. As in the release, the per-frame limit only sets the resize's scale,
            ``sqrt(limit / ((W // p) * (H // p)))``, as an image's budget does; nothing counts the
            padded frames against the video's budget, and they can exceed it (480 frames of
            640x480: 34x44 = 1496 patches each, 718,080 in all, 9.6% over 655,360).
    """

    frame_processor: ImageProcessor = dataclasses.field(
        default_factory=lambda: MoonViTImageProcessor(in_token_limit=4096, side_limit_mode="resize")
    )
    sample_fps: float = 2.0
    frames_per_chunk: int = 4
    video_patch_limit: int | None = None

    def __post_init__(self) -> None:
        if not (self.sample_fps > 0 and math.isfinite(self.sample_fps)):
            raise ValueError(f"sample_fps must be a positive number, got {self.sample_fps!r}")
        if not isinstance(self.frames_per_chunk, int) or self.frames_per_chunk < 1:
            raise ValueError(f"frames_per_chunk must be a positive int, got {self.frames_per_chunk!r}")
        if self.video_patch_limit is not None and (
            not isinstance(self.video_patch_limit, int) or self.video_patch_limit < 1
        ):
            raise ValueError(f"video_patch_limit must be a positive int or None, got {self.video_patch_limit!r}")

    @classmethod
    def for_images(cls, processor: ImageProcessor, frame_limit: int = 4096) -> MoonViTVideoProcessor:
        """The video processor that goes with an image processor: its normalisation and
        geometry, K2.5's per-frame budget and per-side cap. Another family's rule (the classic
        ViT's, whose towers take single images) is used for the frames as it is."""
        if not isinstance(processor, MoonViTImageProcessor):
            return cls(frame_processor=processor)
        frames = dataclasses.replace(
            processor, in_token_limit=min(frame_limit, processor.in_token_limit), side_limit_mode="resize"
        )
        return cls(frame_processor=frames)

    @classmethod
    def kimi_k3(cls) -> MoonViTVideoProcessor:
        """Kimi K3's video rule: K2.5's, at 8 fps, 16384 patches a frame and 655360 a video."""
        frames = MoonViTImageProcessor(in_token_limit=16384, side_limit_mode="resize")
        return cls(frame_processor=frames, sample_fps=8.0, video_patch_limit=655360)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> MoonViTVideoProcessor:
        """Read a checkpoint folder's ``preprocessor_config.json`` (this project's, a K2.5 / K3
        release's ``media_proc_cfg``, or transformers' form) and ``video_preprocessor_config.json``
        (this project's, written by :meth:`save_pretrained`, or transformers'); see
        :func:`moonvit.media.processor.read_video_settings`."""
        from .processor import read_video_settings

        return read_video_settings(path, cls, **overrides)

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write the video settings to ``directory/video_preprocessor_config.json`` and return that path.

        The frames' other settings (normalisation, patch size, per-side cap) are the image
        processor's, which :meth:`MoonViTImageProcessor.save_pretrained` writes beside it;
        :meth:`from_pretrained` on the folder reads both back.
        """
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        file = directory / VIDEO_CONFIG_NAME
        write_text_atomic(
            file, json.dumps({"video_processor_type": type(self).__name__, **self.to_dict()}, indent=2) + "\n"
        )
        return file

    def to_dict(self) -> dict[str, Any]:
        return {
            "sample_fps": self.sample_fps,
            "frames_per_chunk": self.frames_per_chunk,
            "in_patch_limit_each_frame": self.frame_processor.in_token_limit,
            "in_patch_limit_video": self.video_patch_limit,
        }

    def check_tower(self, max_frames: int, name: str = "a video") -> None:
        """Refuse videos for a tower whose clips hold fewer than :attr:`frames_per_chunk` frames.

        Raises:
            VideoNotSupportedError: naming ``name`` and both frame counts.
        """
        if max_frames < self.frames_per_chunk:
            kind = "takes images only" if max_frames == 1 else f"takes clips of at most {max_frames} frames"
            raise VideoNotSupportedError(
                f"{name} needs a tower with a temporal table of {self.frames_per_chunk} frames (Kimi-K2.5 / K2.6, "
                f"K3, or a -3d preset); this one {kind}: use such a tower, or pass the frames as images"
            )

    # ---- planning ------------------------------------------------------------------------

    def plan_chunks(self, info: VideoInfo) -> list[ChunkPlan]:
        """The chunks of a video from its metadata alone."""
        indices = sample_frame_indices(info.num_frames, info.fps, self.sample_fps)
        runs = [indices[i : i + self.frames_per_chunk] for i in range(0, len(indices), self.frames_per_chunk)]
        return [ChunkPlan(k, tuple(run), run[0] / info.fps) for k, run in enumerate(runs)]

    def frame_limit(self, info: VideoInfo) -> int:
        """The per-frame patch limit of a video: the frame processor's, lowered by
        :attr:`video_patch_limit` over the video's sampled frames where that is set (Kimi K3)."""
        limit = self.frame_processor.in_token_limit
        if self.video_patch_limit is None:
            return limit
        sampled = len(sample_frame_indices(info.num_frames, info.fps, self.sample_fps))
        return min(limit, max(1, round(self.video_patch_limit / sampled)))

    def plan_frame(self, info: VideoInfo, in_token_limit: int | None = None) -> ImagePlan:
        """Every frame's geometry (all frames of a video share one size); ``in_token_limit``
        (a pack budget's) defaults to :meth:`frame_limit`."""
        limit = self.frame_limit(info) if in_token_limit is None else in_token_limit
        return self.frame_processor.plan_image(*info.size, in_token_limit=limit)

    def chunks(self, source: VideoSource) -> list[VideoChunk]:
        """The chunks of ``source`` as pack inputs (metadata only, nothing decoded)."""
        info = probe_video(source)
        return [VideoChunk(source, info, plan) for plan in self.plan_chunks(info)]

    # ---- processing ----------------------------------------------------------------------

    def process_chunk(self, chunk: VideoChunk, in_token_limit: int | None = None) -> tuple[torch.Tensor, tuple]:
        """Decode and process one chunk: ((t * h * w, 3, p, p) float32 pixels, its (t, h, w))."""
        plan = self.plan_frame(chunk.info, in_token_limit)
        frames = read_frames(chunk.source, chunk.info, chunk.plan.frame_indices)
        p = self.frame_processor.patch_size
        patches = torch.cat([patchify(self.frame_processor.render(frame, plan), p) for frame in frames])
        return self.frame_processor.normalize(patches), (len(frames), *plan.grid_hw)

    def iter_chunks(self, source: VideoSource | np.ndarray, fps: float | None = None) -> Iterator[VideoBatch]:
        """Process ``source`` chunk by chunk (one :class:`VideoBatch` of one chunk each)."""
        for chunk in self.chunks(_as_source(source, fps)):
            pixels, thw = self.process_chunk(chunk)
            yield VideoBatch(pixels, torch.tensor([thw]), [chunk.plan.timestamp], [chunk.plan.frame_indices])

    def __call__(self, source: VideoSource | np.ndarray | Sequence[ImageInput], fps: float | None = None) -> VideoBatch:
        """Process a whole video: a file path, or decoded frames with their ``fps``.

        Raises:
            VideoLoadError: the video cannot be read (the message names it).
        """
        parts = list(self.iter_chunks(_as_source(source, fps)))
        return VideoBatch(
            torch.cat([part.pixel_values for part in parts]),
            torch.cat([part.grid_thws for part in parts]),
            [t for part in parts for t in part.timestamps],
            [f for part in parts for f in part.frame_indices],
        )


def _as_source(source: Any, fps: float | None) -> VideoSource:
    if isinstance(source, VideoFrames):
        return source
    if isinstance(source, (str, os.PathLike)):
        if fps is not None:
            raise ValueError("fps is read from the file; pass it only with decoded frames")
        return source
    if fps is None:
        raise ValueError("decoded frames need their fps: processor(frames, fps=30.0)")
    return VideoFrames(source, float(fps))
