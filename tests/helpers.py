"""Shared builders for the tests: non-trivial weights, packs, Kimi-VL-format folders."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
import torch.nn as nn
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moonvit import MoonViT, MoonViTConfig, MoonViTImageProcessor, preset_config
from moonvit.media.processor import patchify, unpatchify
from moonvit.model.flex import flex_unavailable
from moonvit_projector import MoonViTProjector, ProjectorConfig
from moonvit_projector.export import main as export_main

T = TypeVar("T")

# Bit-equality holds only where both sides are the same call on the same shapes. The same math on
# packs of other shapes (an image encoded alone and inside a pack, other packings of an export)
# may take other kernels: oneDNN and MKL choose them by shape and by host (AMX, AVX-512, AVX2), so
# such results agree to float error, not to the bit. These are the tolerances the tests state.
ACROSS_SHAPES = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}


FLEX = pytest.param(
    "flex",
    marks=pytest.mark.skipif(
        flex_unavailable(torch.device("cpu"), torch.float32) is not None,
        reason=str(flex_unavailable(torch.device("cpu"), torch.float32)),
    ),
)
"""The ``flex`` backend as a pytest parameter, skipped where it cannot compile here."""


def interruptible() -> None:
    """A ``preexec_fn`` that restores SIGINT's default in a child, so that a test's Ctrl-C reaches it.

    A shell that starts a job in the background without job control (``cmd &`` in a script, a CI
    runner) starts it with SIGINT ignored, and its children inherit that: Python then installs no
    KeyboardInterrupt handler and bash cannot trap the signal, so the child would never see it.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_close_across_shapes(actual: torch.Tensor, expected: torch.Tensor, message: str = "") -> None:
    """``actual`` equals ``expected`` to the float error of other kernels (:data:`ACROSS_SHAPES`)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, message
    torch.testing.assert_close(actual, expected, **ACROSS_SHAPES[actual.dtype], msg=message or None)


def randomise_(module: nn.Module, seed: int = 0, std: float = 0.2) -> nn.Module:
    """A tower of another family (the classic ViT) randomised: every parameter normal with ``std``
    (LayerNorm scales 1 + that), its tokens, table and biases too."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64) * std
            owner = module.get_submodule(name.rpartition(".")[0])
            scale = isinstance(owner, nn.LayerNorm) and name.endswith("weight")
            param.copy_((1.0 + noise) if scale else noise)
    return module


def randomize_(model: MoonViT, seed: int = 0) -> MoonViT:
    """Give every parameter values a faithful port must get right: nonzero biases,
    LayerNorm weights away from 1, a position table with large values."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64).to(param.dtype)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1.5 + 0.5 * noise)
            elif "pos_emb" in name:
                param.copy_(3.0 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5 if param.ndim == 2 else 0.05 * noise)
    return model


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> MoonViT:
    return randomize_(MoonViT(preset_config("tiny", **overrides)), seed).to(dtype).eval()


def random_pack(grids: list[tuple[int, int]], patch_size: int = 14, seed: int = 0, dtype=torch.float32):
    """(pixel_values (L, 3, p, p), grid_hws (N, 2) int64) for the given grids."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(h * w for h, w in grids)
    pixels = torch.rand(n, 3, patch_size, patch_size, generator=gen, dtype=torch.float64) * 2 - 1
    return pixels.to(dtype), torch.tensor(grids, dtype=torch.int64)


def write_kimi_vl_folder(
    folder: Path,
    model: MoonViT,
    *,
    text_hidden_size: int = 2048,
    other_tensors: dict[str, torch.Tensor] | None = None,
    sharded: bool = False,
    storage: str = "safetensors",
) -> Path:
    """A folder laid out like a Kimi-VL release: ``vision_config`` in config.json,
    tensors under ``vision_tower.``, plus other (language-model, projector) tensors.

    With ``sharded``, the vision tensors are split over two shards, the first of
    which also holds one of the other tensors, and the rest of the other tensors
    go to a third shard of their own, as in the released index files.
    ``storage="bin"`` writes torch pickles (``pytorch_model*.bin``) as older fine-tunes ship,
    ``"bin-legacy"`` in torch's pre-1.6 (not memory-mappable) format.
    """
    folder.mkdir(parents=True, exist_ok=True)
    c: MoonViTConfig = model.config
    config = {
        "model_type": "kimi_vl",
        "architectures": ["KimiVLForConditionalGeneration"],
        "vision_config": {
            "model_type": "moonvit",
            "patch_size": c.patch_size,
            "init_pos_emb_height": c.init_pos_emb_height,
            "init_pos_emb_width": c.init_pos_emb_width,
            "num_attention_heads": c.num_attention_heads,
            "num_hidden_layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "merge_kernel_size": list(c.merge_kernel_size),
        },
        "text_config": {"model_type": "deepseek_v3", "hidden_size": text_hidden_size},
        "media_placeholder_token_id": 163605,
    }
    (folder / "config.json").write_text(json.dumps(config))
    vision = {f"vision_tower.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    other = dict(other_tensors or {})
    if storage == "safetensors":
        stem, suffix, write = "model", "safetensors", save_file
    else:
        stem, suffix = "pytorch_model", "bin"

        def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
            torch.save(tensors, path, _use_new_zipfile_serialization=storage != "bin-legacy")

    if not sharded:
        write({**vision, **other}, folder / f"{stem}.{suffix}")
        return folder
    names = list(vision)
    other_names = list(other)
    shards = {
        f"{stem}-00001-of-00003.{suffix}": {k: vision[k] for k in names[::2]} | {k: other[k] for k in other_names[:1]},
        f"{stem}-00002-of-00003.{suffix}": {k: vision[k] for k in names[1::2]},
        f"{stem}-00003-of-00003.{suffix}": {k: other[k] for k in other_names[1:]},
    }
    weight_map = {}
    for file, tensors in shards.items():
        write(tensors, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / f"{stem}.{suffix}.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def make_checkpoint(folder: Path, *, projector: bool = True) -> Path:
    """A tiny encoder, a 32-wide projector and a processor with in_token_limit=64, in one folder."""
    encoder = tiny_model()
    encoder.save_pretrained(folder)
    if projector:
        torch.manual_seed(1)
        MoonViTProjector(ProjectorConfig.for_encoder(encoder.config, 32)).save_pretrained(folder)
    MoonViTImageProcessor(in_token_limit=64).save_pretrained(folder)
    return folder


def write_images(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """``count`` noise images of assorted sizes (some over the token limit), PNG and JPEG, some in a subfolder."""
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        width, height = int(rng.integers(20, 200)), int(rng.integers(20, 160))
        path = folder / ("nested" if i % 3 == 0 else "") / f"img{i:03d}.{'png' if i % 2 else 'jpg'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def noise_pngs(folder: Path) -> list[Path]:
    """Five noise PNGs in ``folder``, sized for 16 px patches: one of a whole patch grid (64 x 48), three of
    other sizes (50 x 70, 33 x 17, 90 x 40) and one under a patch (12 x 9)."""
    rng = np.random.default_rng(0)
    paths = []
    for i, (width, height) in enumerate([(64, 48), (50, 70), (33, 17), (90, 40), (12, 9)]):
        path = folder / f"img{i}.png"
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


def noise_image(height: int, width: int, seed: int = 0) -> Image.Image:
    """A uniform-noise RGB image of ``height`` x ``width``, its draw fixed by ``seed`` and its size."""
    rng = np.random.default_rng(seed + 7919 * height + width)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def our_image(processor: Any, image: Image.Image) -> torch.Tensor:
    """One image through one of our processors, its patches put back together: (C, H, W) float32."""
    batch = processor(image)
    assert batch.pixel_values.dtype == torch.float32 and batch.grid_hws.shape == (1, 2)
    return unpatchify(batch.pixel_values, batch.grid_hws[0].tolist())


def their_image(processor: Any, image: Image.Image) -> torch.Tensor:
    """One image through a transformers image processor: its (C, H, W) ``pixel_values``."""
    return processor(image, return_tensors="pt")["pixel_values"][0]


def normal_images(
    grids: list[tuple[int, int]], patch: int, seed: int = 1, dtype: torch.dtype = torch.float64
) -> list[torch.Tensor]:
    """One (3, patch * h, patch * w) standard normal image per (h, w) grid, drawn in float64 from ``seed``,
    then cast to ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h * patch, w * patch, generator=generator, dtype=torch.float64).to(dtype) for h, w in grids]


def patch_pack(images: list[torch.Tensor], patch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, 3, p, p) patches of (3, H, W) images, each in raster order, concatenated; (N, 2) their grids."""
    pixels = torch.cat([patchify(image, patch) for image in images])
    grids = torch.tensor([[image.shape[1] // patch, image.shape[2] // patch] for image in images])
    return pixels, grids


def record_error(
    errors: dict[str, float], key: str, actual: torch.Tensor, expected: torch.Tensor, **tolerance: float
) -> None:
    """Assert ``actual`` close to ``expected`` in float64 (``tolerance``: assert_close's rtol and atol) and
    keep the largest error seen under ``key`` in ``errors`` (a module's figures)."""
    assert actual.shape == expected.shape, (key, actual.shape, expected.shape)
    error = float((actual.double() - expected.double()).abs().max())
    errors[key] = max(errors.get(key, 0.0), error)
    torch.testing.assert_close(actual.double(), expected.double(), **tolerance, msg=key)


def saved_models(
    tmp_path_factory: pytest.TempPathFactory, names: Iterable[str], build: Callable[[str], Any]
) -> dict[str, tuple[Any, Path]]:
    """Each model ``build(name)`` of ``names`` and a new folder its ``save_pretrained`` wrote, by name."""
    folders = {}
    for name in names:
        model = build(name)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        folders[name] = (model, folder)
    return folders


def check_bf16(
    errors: dict[str, float],
    key: str,
    ours: dict[str, torch.Tensor],
    theirs: dict[str, torch.Tensor],
    exact: dict[str, torch.Tensor],
) -> None:
    """Our bf16 outputs as close to the float64 reference (``exact``) as the reference's own bf16 run
    (``theirs``) is: the RMS error of each output within 1.25x the reference's + 1e-3. The largest and the
    RMS errors of both are kept in ``errors`` under ``key``."""
    for name, truth in exact.items():
        own, reference = ours[name].double() - truth, theirs[name].double() - truth
        errors[f"{key}/bf16 max/{name}"] = float(own.abs().max())
        errors[f"{key}/bf16 reference max/{name}"] = float(reference.abs().max())
        own_rms, reference_rms = float(own.square().mean().sqrt()), float(reference.square().mean().sqrt())
        errors[f"{key}/bf16 rms/{name}"] = own_rms
        errors[f"{key}/bf16 reference rms/{name}"] = reference_rms
        assert own_rms <= reference_rms * 1.25 + 1e-3, (name, own_rms, reference_rms)


def rewrite_tensors(folder: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """``folder`` with its ``model.safetensors`` rewritten after ``change`` edits its tensors in place."""
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors")
    return folder


def rewrite_config(folder: Path, change: Callable[[dict], None]) -> Path:
    """``folder`` with its ``config.json`` rewritten after ``change`` edits its values in place."""
    values = json.loads((folder / "config.json").read_text())
    change(values)
    (folder / "config.json").write_text(json.dumps(values))
    return folder


def copied_folder(source: Path, target: Path) -> Path:
    """A new folder ``target`` holding a copy of each file of ``source``."""
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def with_threads(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)``, torch's thread count restored afterwards (an export sets it)."""
    previous = torch.get_num_threads()
    try:
        return function(*args, **kwargs)
    finally:
        torch.set_num_threads(previous)


def on_one_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` on one torch thread, as the commands here run (``--threads 1``)."""

    def call() -> T:
        torch.set_num_threads(1)
        return function(*args, **kwargs)

    return with_threads(call)


def run_export(*args: str | Path, threads: int = 1) -> dict:
    """The export in this process (torch's thread count restored afterwards)."""
    return with_threads(export_main, [str(a) for a in args] + ["--threads", str(threads)])


def exported_rows(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each exported image's tensors, by id, read from its shard by its manifest line: ``merged`` (its
    offset and token count), and ``prefix_tokens`` and ``pooled`` where the line gives their rows."""
    rows = {}
    for line in (out / "manifest.jsonl").read_text().splitlines():
        record = json.loads(line)
        with safe_open(out / record["shard"], framework="pt") as shard:
            start, count = record["offset"], record["num_tokens"]
            item = {"merged": shard.get_slice("merged")[start : start + count]}
            for name, key in (("prefix_tokens", "prefix_row"), ("pooled", "pooled_row")):
                if key in record:
                    item[name] = shard.get_slice(name)[record[key]]
            rows[record["id"]] = item
    return rows


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file below ``folder`` by relative path, with its bytes (to compare folders whole)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class SafeOpenSpy:
    """Stands in for ``safe_open`` in the given modules: records the files opened
    and the tensors read (``get_tensor``), and passes everything through."""

    def __init__(self, monkeypatch, *modules) -> None:
        from safetensors import safe_open

        self.opened: set[str] = set()
        self.read: set[str] = set()
        spy = self

        class Handle:
            def __init__(self, path, *args, **kwargs):
                spy.opened.add(Path(path).name)
                self.handle = safe_open(path, *args, **kwargs)

            def __enter__(self):
                self.handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self.handle.__exit__(*exc)

            def keys(self):
                return self.handle.keys()

            def get_slice(self, name):
                return self.handle.get_slice(name)

            def get_tensor(self, name):
                spy.read.add(name)
                return self.handle.get_tensor(name)

        for module in modules:
            monkeypatch.setattr(module, "safe_open", Handle)


# ---- Kimi-K2.5 / K2.6 folders -------------------------------------------------------------------


def tiny_k25_config(text_hidden_size: int = 32, **vision):
    """transformers' Kimi_K25Config of a tiny tower (the `tiny` preset's sizes) and a tiny LLM."""
    from transformers.models.kimi_k25.configuration_kimi_k25 import Kimi_K25Config

    text = dict(
        model_type="deepseek_v3", hidden_size=text_hidden_size, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=2,
        num_experts_per_tok=1, n_shared_experts=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, vocab_size=200, first_k_dense_replace=1,
    )  # fmt: skip
    vision = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                  pos_emb_height=64, pos_emb_width=64, **vision)  # fmt: skip
    return Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=64)


def k25_full_model(model: MoonViT, projector: MoonViTProjector):
    """transformers' Kimi_K25ForConditionalGeneration holding ``model``'s tower (through
    transformers' own RoPE permutation) and ``projector``'s weights; a random tiny LLM."""
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    from moonvit.weights.transformers import to_transformers

    full = Kimi_K25ForConditionalGeneration(tiny_k25_config(projector.config.text_hidden_size)).eval()
    full.model.vision_tower.load_state_dict(to_transformers(model).state_dict())
    p = projector.state_dict()
    full.model.mm_projector.load_state_dict(
        {"pre_norm.weight": p["pre_norm.weight"], "pre_norm.bias": p["pre_norm.bias"],
         "in_proj.weight": p["linear_1.weight"], "in_proj.bias": p["linear_1.bias"],
         "out_proj.weight": p["linear_2.weight"], "out_proj.bias": p["linear_2.bias"]}
    )  # fmt: skip
    return full


def write_k25_release_folder(
    folder: Path,
    model: MoonViT,
    projector: MoonViTProjector,
    sharded: bool = True,
    processor: MoonViTImageProcessor | None = None,
) -> Path:
    """A folder laid out like a Kimi-K2.5 / K2.6 release: ``vt_*`` keys in ``vision_config`` (with
    the projector's ``mm_*`` fields), tensors ``vision_tower.*`` and ``mm_projector.proj.{0,2}``, and
    language-model tensors in a shard of their own. With ``processor``, also the release's
    ``preprocessor_config.json`` (its image settings under ``media_proc_cfg``)."""
    folder.mkdir(parents=True, exist_ok=True)
    if processor is not None:
        media = {"in_patch_limit": processor.in_token_limit, "patch_size": processor.patch_size,
                 "image_mean": list(processor.image_mean), "image_std": list(processor.image_std)}  # fmt: skip
        (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": media}))
    c = model.config
    config = {
        "model_type": "kimi_k25",
        "architectures": ["KimiK25ForConditionalGeneration"],
        "vision_config": {
            "patch_size": c.patch_size, "init_pos_emb_height": c.init_pos_emb_height,
            "init_pos_emb_width": c.init_pos_emb_width, "init_pos_emb_time": c.init_pos_emb_time,
            "pos_emb_type": "divided_fixed", "vt_hidden_size": c.hidden_size,
            "vt_intermediate_size": c.intermediate_size, "vt_num_attention_heads": c.num_attention_heads,
            "vt_num_hidden_layers": c.num_hidden_layers, "merge_kernel_size": list(c.merge_kernel_size),
            "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger",
            "mm_hidden_size": c.hidden_size, "text_hidden_size": projector.config.text_hidden_size,
            "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
        },
        "text_config": {"model_type": "kimi_k2", "hidden_size": projector.config.text_hidden_size},
        "media_placeholder_token_id": 163605,
    }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    p = projector.state_dict()
    tower = {f"vision_tower.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    proj = {
        "mm_projector.pre_norm.weight": p["pre_norm.weight"], "mm_projector.pre_norm.bias": p["pre_norm.bias"],
        "mm_projector.proj.0.weight": p["linear_1.weight"], "mm_projector.proj.0.bias": p["linear_1.bias"],
        "mm_projector.proj.2.weight": p["linear_2.weight"], "mm_projector.proj.2.bias": p["linear_2.bias"],
    }  # fmt: skip
    llm = {"language_model.model.embed_tokens.weight": torch.zeros(8, 4)}
    shards = {"model-00001-of-00002.safetensors": {**tower, **proj}, "model-00002-of-00002.safetensors": llm}
    if not sharded:
        save_file({**tower, **proj, **llm}, folder / "model.safetensors")
        return folder
    weight_map = {}
    for file, tensors in shards.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def write_k25_transformers_folders(tmp_path: Path, model: MoonViT, projector: MoonViTProjector) -> dict[str, Path]:
    """The same tower and projector as transformers keeps them: ``hybrid`` is what its own
    ``save_pretrained`` writes, ``native`` its in-memory (state-dict) names."""
    full = k25_full_model(model, projector)
    hybrid = tmp_path / "hybrid"
    full.save_pretrained(hybrid)
    native = tmp_path / "native"
    native.mkdir()
    (native / "config.json").write_text(full.config.to_json_string())
    save_file({k: v.detach().clone().contiguous() for k, v in full.state_dict().items()}, native / "model.safetensors")
    return {"hybrid": hybrid, "native": native}


# ---- videos --------------------------------------------------------------------------------------


def frame_pixels(index: int, height: int, width: int) -> np.ndarray:
    """(H, W, 3) uint8 frame that encodes its index: a gray level of 8 * index, plus a colour ramp."""
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    frame[..., 0] = (8 * index) % 256
    frame[..., 1] = np.linspace(0, 255, width, dtype=np.uint8)[None, :]
    frame[..., 2] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
    return frame


def write_video(
    path: Path, num_frames: int, fps: float, size: tuple[int, int] = (64, 48), codec: str = "ffv1", **options: str
) -> Path:
    """A synthetic video of ``num_frames`` frames (see :func:`frame_pixels`) at ``fps``.

    ``ffv1`` (in .mkv) is lossless, so decoded frames equal the written ones; ``libx264``
    (.mp4) is the common lossy case.
    """
    import fractions

    import av

    width, height = size
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=fractions.Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = width, height
        stream.pix_fmt = "bgr0" if codec == "ffv1" else "yuv420p"
        for i in range(num_frames):
            frame = av.VideoFrame.from_ndarray(frame_pixels(i, height, width), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# ---- Kimi K3 (MoonViT-V2) folders -------------------------------------------------------------------


def tiny_k3_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> MoonViT:
    """The ``tiny-v2`` preset (K3's switches at 2 x 64, attention 96), with non-trivial weights."""
    return randomize_(MoonViT(preset_config("tiny-v2")), seed).to(dtype).eval()


def tiny_k3_projector(model: MoonViT, text_hidden_size: int = 48, seed: int = 1) -> MoonViTProjector:
    config = ProjectorConfig.for_encoder(model.config, text_hidden_size, projector_type="patchmergerv2")
    projector = MoonViTProjector(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in projector.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_(1.0 + 0.3 * noise if "norm" in name else noise / param.shape[-1] ** 0.5)
    return projector.to(model.dtype).eval()


K3_MEDIA_PROC_CFG = {
    "in_patch_limit": 65536, "patch_limit_on_one_side": 512, "in_patch_limit_each_frame": 16384,
    "in_patch_limit_video": 655360, "sample_fps": 8.0, "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "patch_size": 14, "merge_kernel_size": [2, 2],
}  # fmt: skip


def k3_release_config(model: MoonViT, text_hidden_size: int) -> dict:
    """A Kimi K3 release's ``config.json``: ``vt_*`` sizes and K3's switches in ``vision_config``."""
    c = model.config
    return {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "media_placeholder_token_id": 163605,
        "text_config": {"model_type": "kimi_k3_text", "hidden_size": text_hidden_size},
        "vision_config": {
            "patch_size": c.patch_size, "init_pos_emb_height": c.init_pos_emb_height,
            "init_pos_emb_width": c.init_pos_emb_width, "init_pos_emb_time": c.init_pos_emb_time,
            "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
            "vt_hidden_size": c.hidden_size, "vt_intermediate_size": c.intermediate_size,
            "vt_num_attention_heads": c.num_attention_heads, "vt_num_hidden_layers": c.num_hidden_layers,
            "qkv_hidden_size": c.qkv_hidden_size, "norm_type": "rmsnorm", "attn_bias": False,
            "linear_bias": False, "patch_embed_proj_bias": False, "mlp_type": "mlp2",
            "activation_func": "gelu_pytorch_tanh", "merge_kernel_size": list(c.merge_kernel_size),
            "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmergerv2",
            "mm_hidden_size": c.hidden_size, "text_hidden_size": text_hidden_size, "projector_hidden_act": "gelu",
            "projector_ln_eps": 1e-5,
        },
    }  # fmt: skip


def write_k3_release_folder(folder: Path, model: MoonViT, projector: MoonViTProjector) -> Path:
    """A folder laid out like the Kimi K3 release: its ``config.json``, the tower and the projector
    in shards of their own (``vision_tower.*``, ``mm_projector.{proj.0,proj.2,post_norm}``) beside a
    language-model shard, the index, and ``preprocessor_config.json`` with K3's budgets."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(k3_release_config(model, projector.config.text_hidden_size)))
    (folder / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": K3_MEDIA_PROC_CFG}))
    p = projector.state_dict()
    shards = {
        "model-00001-of-00003.safetensors": {f"vision_tower.{k}": v for k, v in model.state_dict().items()},
        "model-00002-of-00003.safetensors": {
            "mm_projector.proj.0.weight": p["linear_1.weight"], "mm_projector.proj.2.weight": p["linear_2.weight"],
            "mm_projector.post_norm.weight": p["post_norm.weight"],
        },
        "model-00003-of-00003.safetensors": {"language_model.model.embed_tokens.weight": torch.zeros(8, 4)},
    }  # fmt: skip
    weight_map = {}
    for file, tensors in shards.items():
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, folder / file)
        weight_map.update(dict.fromkeys(tensors, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ---- NVIDIA LocateAnything-3B folders -----------------------------------------------------------------


def tiny_locateanything(seed: int = 0, dtype: torch.dtype = torch.float64, text_hidden_size: int = 48):
    """A LocateAnything-shaped pair at test size: the ``tiny`` Kimi-VL tower and an ``mlp1`` projector
    (LayerNorm over 4D, Linear 4D -> T, GELU, Linear T -> T), both with non-trivial weights."""
    model = tiny_model(seed, dtype)
    projector = MoonViTProjector(ProjectorConfig.for_encoder(model.config, text_hidden_size, projector_type="mlp1"))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in projector.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            if name.startswith("pre_norm"):
                param.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5 if param.ndim == 2 else 0.2 * noise)
    return model, projector.to(dtype).eval()


LOCATEANYTHING_PREPROCESSOR = {
    "auto_map": {
        "AutoImageProcessor": "image_processing_locateanything.LocateAnythingImageProcessor",
        "AutoProcessor": "processing_locateanything.LocateAnythingProcessor",
    },
    "in_token_limit": 25600, "patch_size": 14, "merge_kernel_size": [2, 2],
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}  # fmt: skip
LOCATEANYTHING_SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
"""The release's two shards as written here: the tower and ``mlp1`` in the first, the language model alone
in the second (which the loaders must never open)."""


def locateanything_config(model: MoonViT, text_hidden_size: int) -> dict:
    """LocateAnything-3B's ``config.json``: its top-level keys, a Kimi-VL ``vision_config`` with the
    bookkeeping keys the release carries, a Qwen2 ``text_config``."""
    c = model.config
    return {
        "model_type": "locateanything",
        "architectures": ["LocateAnythingForConditionalGeneration"],
        "auto_map": {
            "AutoConfig": "configuration_locateanything.LocateAnythingConfig",
            "AutoModel": "modeling_locateanything.LocateAnythingForConditionalGeneration",
        },
        "image_token_index": 151665, "mlp_connector_layers": 2, "torch_dtype": "bfloat16",
        "vision_config": {
            "model_type": "moonvit", "auto_map": {"AutoConfig": "configuration_vit.MoonViTConfig"},
            "torch_dtype": "bfloat16", "_attn_implementation_autoset": True,
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "patch_size": c.patch_size, "init_pos_emb_height": c.init_pos_emb_height,
            "init_pos_emb_width": c.init_pos_emb_width, "merge_kernel_size": list(c.merge_kernel_size),
        },
        "text_config": {"model_type": "qwen2", "hidden_size": text_hidden_size, "num_hidden_layers": 36,
                        "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 152681,
                        "tie_word_embeddings": True},
    }  # fmt: skip


def locateanything_tensors(model: MoonViT, projector: MoonViTProjector) -> dict[str, torch.Tensor]:
    """The release's tower and projector tensor names: ``vision_model.*`` and ``mlp1.{0,1,3}.*``."""
    p = projector.state_dict()
    tensors = {f"vision_model.{k}": v for k, v in model.state_dict().items()}
    for ours, theirs in (("pre_norm", "mlp1.0"), ("linear_1", "mlp1.1"), ("linear_2", "mlp1.3")):
        for kind in ("weight", "bias"):
            tensors[f"{theirs}.{kind}"] = p[f"{ours}.{kind}"]
    return {k: v.detach().contiguous() for k, v in tensors.items()}


def write_locateanything_folder(
    folder: Path,
    model: MoonViT,
    projector: MoonViTProjector,
    *,
    tensors: dict[str, torch.Tensor] | None = None,
    config: dict | None = None,
) -> Path:
    """A folder laid out like the LocateAnything-3B release: its ``config.json`` and
    ``preprocessor_config.json``, two shards and the index; ``tensors`` replaces the tower and
    projector tensors (a damaged or other-layout checkpoint), ``config`` the config."""
    folder.mkdir(parents=True, exist_ok=True)
    config = config or locateanything_config(model, projector.config.text_hidden_size)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(json.dumps(LOCATEANYTHING_PREPROCESSOR))
    text = projector.config.text_hidden_size
    shards = {
        LOCATEANYTHING_SHARDS[0]: locateanything_tensors(model, projector) if tensors is None else tensors,
        LOCATEANYTHING_SHARDS[1]: {
            "language_model.model.embed_tokens.weight": torch.zeros(8, text),
            "language_model.lm_head.weight": torch.zeros(8, text),
        },
    }
    weight_map = {}
    for file, content in shards.items():
        save_file(content, folder / file)
        weight_map.update(dict.fromkeys(content, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
