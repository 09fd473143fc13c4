"""Export an encoder (and its projector) to one ONNX graph that takes any pack.

torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``, torch.export then
onnxscript) traces :class:`~moonvit.onnx.graph.OnnxEncoder` once, on a small example
pack, with every pack-dependent size symbolic: patches, position rows, items, the
longest item, merged tokens and (for towers with a temporal table) frames. The
graph is checked with ``onnx.checker`` and carries the encoder's config in its
metadata, so a deployment needs only the ``.onnx`` file (:func:`onnx_config`).

A classic ViT / DeiT tower exports the same way, as :class:`~moonvit.onnx.vit_graph.OnnxClassicViT`
(its own inputs and outputs: :mod:`moonvit.onnx.vit_inputs`, :func:`vit_output_names`).
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..families.vit.config import ClassicViTConfig
from ..families.vit.model import ClassicViT
from ..model.config import MoonViTConfig
from ..model.encoder import MoonViT
from ..model.interface import tower_name
from .graph import OnnxEncoder
from .inputs import input_names, onnx_inputs
from .vit_graph import OnnxClassicViT, vit_output_names

MIN_OPSET = 18
"""The oldest opset the exporter writes (torch's ONNX function library targets 18)."""
MAX_OPSET = 23
"""The newest opset tested with this package's pins."""
DEFAULT_OPSET = 20
"""Default opset: GELU as one ``Gelu`` node (opset 20), read by ONNX Runtime 1.17 and later."""
EXPORT_DTYPES = (torch.float32, torch.float16)
CONFIG_KEY = "moonvit.config"
"""Metadata key of the encoder's config (JSON) in an exported graph."""
# protobuf's limit on one file; larger graphs keep their weights in ``<file>.data`` beside it.
SINGLE_FILE_BYTES = 2**31 - 2**26


class OnnxUnavailableError(RuntimeError):
    """onnx or onnxscript (the exporter's dependencies) is not installed."""


def export_onnx(
    encoder: MoonViT | ClassicViT,
    path: str | Path,
    projector: nn.Module | None = None,
    *,
    opset: int = DEFAULT_OPSET,
) -> Path:
    """Write ``encoder`` (and ``projector``) as one ONNX graph that takes any pack.

    Args:
        encoder: the encoder, in float32 or float16 (the graph's dtype), on any device: a
            MoonViT, or a classic ViT / DeiT tower (:class:`~moonvit.families.vit.ClassicViT`).
        path: the ``.onnx`` file to write; graphs over 2 GB keep their weights in
            ``<path>.data`` beside it.
        projector: a :class:`~projector.MoonViTProjector` for the encoder's width, in the
            same dtype; the graph then also returns the projected tokens.
        opset: the ONNX opset, :data:`MIN_OPSET` to :data:`MAX_OPSET`.

    Returns:
        ``path``. The graph takes :func:`~moonvit.onnx.onnx_inputs` (float32 pixel values)
        and returns ``last_hidden_state`` (L, D), ``merged`` (S / 4, 4, D) and, with a
        projector, ``projected`` (S / 4, text_hidden_size), in the encoder's dtype. A classic
        ViT's graph returns :func:`vit_output_names` (``last_hidden_state`` (L, D),
        ``prefix_tokens`` (N, n_prefix, D), ``pooled`` (N, D), ``logits`` with a head, ...).

    Raises:
        ValueError: an encoder of another kind (OpenVLA's fused backbone), an opset out of range,
            a dtype other than float32 / float16, or a projector that does not fit the encoder (a
            classic ViT takes none).
        OnnxUnavailableError: onnx or onnxscript is not installed.
    """
    _check_export(encoder, projector, opset)
    onnx = _require("onnx")
    _require("onnxscript")
    path = Path(path)
    config = encoder.config
    module: nn.Module
    if isinstance(encoder, ClassicViT):
        module = OnnxClassicViT(encoder).eval()
    else:
        module = OnnxEncoder(encoder, projector).eval()
    example = example_inputs(config, encoder.device)
    outputs = exported_outputs(config, projector is not None)
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    with torch.no_grad(), _exporter_notes_silenced():
        program = torch.onnx.export(
            module,
            (),
            kwargs=example,
            input_names=list(example),
            output_names=list(outputs),
            opset_version=opset,
            dynamo=True,
            dynamic_shapes=_dynamic_shapes(config),
            optimize=True,
            verbose=False,
        )
    assert program is not None
    program.model.metadata_props[CONFIG_KEY] = json.dumps(config.to_dict())
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=size > SINGLE_FILE_BYTES)
    onnx.checker.check_model(str(path), full_check=True)
    return path


def compare_with_model(
    session: Any,
    encoder: MoonViT | ClassicViT,
    pixel_values: np.ndarray,
    grid_hws: Sequence[Sequence[int]],
    projector: nn.Module | None = None,
) -> dict[str, float]:
    """Run one pack through an ONNX Runtime session of the exported graph and through the
    PyTorch model; for each output, ``max |onnx - torch| / max |torch|``.

    Args:
        session: an ``onnxruntime.InferenceSession`` of the graph exported from ``encoder``
            (and ``projector``, whose output is compared when given).
        pixel_values: (L, 3, p, p) float32; grid_hws: (N, 2) or (N, 3) rows.
    """
    feeds = onnx_inputs(encoder.config, pixel_values, grid_hws)
    got = session.run(None, feeds)
    names = exported_outputs(encoder.config, projector is not None)
    with torch.no_grad():
        pixels = torch.from_numpy(feeds["pixel_values"]).to(encoder.device)
        out = encoder(pixels, torch.as_tensor(np.asarray(grid_hws)))
        if isinstance(encoder, ClassicViT):
            expected = [getattr(out, name) for name in names]
        else:
            expected = [out.last_hidden_state, out.merged]
            if projector is not None:
                expected.append(projector(out.merged))
    errors = {}
    for name, actual, reference in zip(names, got, expected):
        ref = reference.float().cpu().numpy()
        errors[name] = float(np.abs(actual.astype(np.float32) - ref).max() / np.abs(ref).max())
    return errors


def output_names(projector: bool) -> tuple[str, ...]:
    """The graph's outputs, in order (a MoonViT's; a classic ViT's are :func:`vit_output_names`)."""
    return ("last_hidden_state", "merged", "projected") if projector else ("last_hidden_state", "merged")


def exported_outputs(config: MoonViTConfig | ClassicViTConfig, projector: bool = False) -> tuple[str, ...]:
    """The outputs of the graph exported from an encoder of ``config`` (with a projector or not), in order."""
    return vit_output_names(config) if isinstance(config, ClassicViTConfig) else output_names(projector)


def example_inputs(
    config: MoonViTConfig | ClassicViTConfig, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The feeds of the small pack the exporter traces, as tensors on ``device``."""
    grids = _example_grids(config)
    patches = sum(t * h * w for t, h, w in grids)
    pixels = np.zeros((patches, config.num_channels, config.patch_size, config.patch_size), dtype=np.float32)
    feeds = onnx_inputs(config, pixels, np.array(grids))
    return {name: torch.from_numpy(feeds[name]).to(device) for name in input_names(config)}


def onnx_config(session: Any) -> MoonViTConfig | ClassicViTConfig:
    """The encoder config stored in an exported graph, from an ``onnxruntime.InferenceSession``
    (a :class:`~moonvit.families.vit.ClassicViTConfig` for a classic ViT's graph).

    Raises:
        ValueError: the graph was not written by :func:`export_onnx`.
    """
    stored = session.get_modelmeta().custom_metadata_map.get(CONFIG_KEY)
    if stored is None:
        raise ValueError(f"the graph has no {CONFIG_KEY!r} metadata: it was not written by moonvit's export_onnx")
    values = json.loads(stored)
    if values.get("model_type") == ClassicViTConfig.model_type:
        return ClassicViTConfig.from_dict(values)
    return MoonViTConfig.from_dict(values)


def _example_grids(config: MoonViTConfig | ClassicViTConfig) -> list[tuple[int, int, int]]:
    """The pack the exporter traces: every symbolic size at least 2 and all of them distinct
    (torch.export fixes sizes 0 and 1, and may tie equal sizes together). A repeated size
    traces the position rows apart from the patches, clips (where the tower takes them)
    the frames axis; a classic ViT's odd sides and a one-patch-wide side trace nothing special."""
    if isinstance(config, ClassicViTConfig):
        # 28 patches, 22 position rows, 5 items, at most 9 patches plus the prefix tokens per item.
        return [(1, 2, 3), (1, 3, 3), (1, 2, 3), (1, 1, 4), (1, 3, 1)]
    frames = min(config.max_frames, 3)
    return [(min(frames, 2), 4, 6), (1, 2, 2), (frames, 4, 2) if frames > 1 else (1, 4, 6), (1, 2, 4)]


def _dynamic_shapes(config: MoonViTConfig | ClassicViTConfig) -> dict[str, dict[int, Any]]:
    dim = torch.export.Dim
    patches, position_rows, items, longest, tokens = (
        dim(name) for name in ("patches", "position_rows", "items", "longest", "tokens")
    )
    if isinstance(config, ClassicViTConfig):
        return {
            "pixel_values": {0: patches},
            "pos_emb_weight_h": {0: position_rows},
            "pos_emb_weight_w": {0: position_rows},
            "pos_emb_row": {0: patches},
            "attention_rows": {0: items, 1: longest},
            "attention_slots": {0: patches},
        }
    # A Kimi-VL tower takes images only: one frame, a fixed size of the graph.
    frames = dim("frames") if config.max_frames > 1 else dim.STATIC
    shapes = {
        "pixel_values": {0: patches},
        "positions": {0: patches},
        "pos_emb_index": {0: position_rows},
        "pos_emb_weight": {0: position_rows},
        "pos_emb_row": {0: patches},
        "attention_rows": {0: items, 1: longest},
        "attention_slots": {0: patches},
        "merge_index": {0: tokens, 2: frames},
        "merge_weight": {0: tokens, 2: frames},
        "time_index": {0: patches},
    }
    return {name: shapes[name] for name in input_names(config)}


def _check_export(encoder: MoonViT | ClassicViT, projector: nn.Module | None, opset: int) -> None:
    if not isinstance(encoder, (MoonViT, ClassicViT)):
        raise ValueError(
            f"export_onnx exports one MoonViT or ViT tower (a MoonViT or ClassicViT module), not the "
            f"{tower_name(getattr(encoder, 'config', None))} ({type(encoder).__name__})"
        )
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise ValueError(f"opset must lie in {MIN_OPSET}..{MAX_OPSET}, got {opset}")
    if encoder.dtype not in EXPORT_DTYPES:
        raise ValueError(f"export an encoder in float32 or float16, not {encoder.dtype} (convert it with .to(dtype))")
    if projector is None:
        return
    if isinstance(encoder, ClassicViT):
        raise ValueError("a classic ViT / DeiT tower has no projector to export with it: export it with projector=None")
    config = getattr(projector, "config", None)
    width = getattr(config, "vision_hidden_size", None)
    kernel = tuple(getattr(config, "merge_kernel_size", ()))
    if width != encoder.config.hidden_size or kernel != tuple(encoder.config.merge_kernel_size):
        raise ValueError(
            f"the projector takes {width}-wide groups of {kernel}, the encoder gives "
            f"{encoder.config.hidden_size}-wide groups of {tuple(encoder.config.merge_kernel_size)}"
        )
    dtype = next(projector.parameters()).dtype
    if dtype != encoder.dtype:
        raise ValueError(f"the projector is {dtype}, the encoder {encoder.dtype}: export both in one dtype")


@contextmanager
def _exporter_notes_silenced() -> Iterator[None]:
    """The exporter's own notes (deprecations inside torch, renamed axes, absent torchvision)
    are not the caller's: hide its warnings and its registry's log lines while it runs."""
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module=r"(torch|onnxscript|copyreg)(\.|$)")
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def _require(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise OnnxUnavailableError(
            f"ONNX export needs {name}, which is not installed (pip install 'moonvit[onnx]')"
        ) from err
